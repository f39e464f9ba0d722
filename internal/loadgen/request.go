package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/workload"
)

// ReplicaHeader is the response header in which `prefixlb serve` names the
// replica that served a request.
const ReplicaHeader = "x-prefixlb-replica"

// PrefillReplicaHeader is the response header in which `prefixlb serve`
// names the replica that ran a disaggregated request's prefill leg.
const PrefillReplicaHeader = "x-prefixlb-prefill-replica"

// maxErrorBody bounds how much of an error response is read.
const maxErrorBody = 64 << 10

// completionRequest is the body of POST /v1/completions and
// /v1/chat/completions. ignore_eos and min_tokens are vLLM's extensions
// (SGLang accepts ignore_eos too); with max_tokens they make every request
// generate exactly the workload's output length.
type completionRequest struct {
	Model         string         `json:"model"`
	Prompt        any            `json:"prompt,omitempty"`
	Messages      []chatMessage  `json:"messages,omitempty"`
	MaxTokens     int            `json:"max_tokens"`
	MinTokens     int            `json:"min_tokens"`
	IgnoreEOS     bool           `json:"ignore_eos"`
	Temperature   float64        `json:"temperature"`
	Stream        bool           `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// usage is the OpenAI usage object.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// Timings is what llama.cpp's llama-server reports of a request's cost in
// its timings object (on a non-streamed response, and on a stream's final
// chunk, with the usage): PromptN is the prompt tokens it computed, so
// usage.prompt_tokens − PromptN were served from its prefix cache.
type Timings struct {
	// PromptN is the prompt tokens computed; PromptMs the prefill's wall
	// time in ms.
	PromptN  int     `json:"prompt_n"`
	PromptMs float64 `json:"prompt_ms"`
	// PredictedN is the tokens generated; PredictedPerTokenMs the decode's
	// time per token in ms.
	PredictedN          int     `json:"predicted_n"`
	PredictedPerTokenMs float64 `json:"predicted_per_token_ms"`
}

// parseTimings reads a timings object leniently: nil when raw is absent,
// not an object of numbers, or has no non-negative prompt_n (a server
// whose "timings" means something else must not fail the request).
func parseTimings(raw json.RawMessage) *Timings {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var t struct {
		PromptN             *float64 `json:"prompt_n"`
		PromptMs            float64  `json:"prompt_ms"`
		PredictedN          float64  `json:"predicted_n"`
		PredictedPerTokenMs float64  `json:"predicted_per_token_ms"`
	}
	if json.Unmarshal(raw, &t) != nil || t.PromptN == nil || *t.PromptN < 0 {
		return nil
	}
	count := func(v float64) int { return int(math.Round(min(max(v, 0), 1<<31))) }
	return &Timings{PromptN: count(*t.PromptN), PromptMs: max(t.PromptMs, 0),
		PredictedN: count(t.PredictedN), PredictedPerTokenMs: max(t.PredictedPerTokenMs, 0)}
}

// apiError is the OpenAI error object, {"error":{...}}. vLLM's older
// releases sent the fields at the top level, {"message":..,"code":..}.
type apiError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    any    `json:"code"`
}

// chunk is one streamed completion or chat-completion chunk, or a whole
// non-streamed response (choices carry "message" instead of "delta" then).
type chunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta struct {
			Content          string `json:"content"`
			ReasoningContent string `json:"reasoning_content"`
			Reasoning        string `json:"reasoning"`
		} `json:"delta"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *usage          `json:"usage"`
	Error json.RawMessage `json:"error"`
	// Timings is llama.cpp's timings object, kept raw (parseTimings).
	Timings json.RawMessage `json:"timings"`
}

// hasContent reports whether the chunk carries generated text.
func (c *chunk) hasContent() bool {
	for _, ch := range c.Choices {
		if ch.Text != "" || ch.Delta.Content != "" || ch.Delta.ReasoningContent != "" ||
			ch.Delta.Reasoning != "" || ch.Message.Content != "" {
			return true
		}
	}
	return false
}

// errorMessage extracts a readable message from an error value: an object
// with "message", or a plain string.
func errorMessage(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var e apiError
	if json.Unmarshal(raw, &e) == nil && e.Message != "" {
		return e.Message
	}
	var s string
	if json.Unmarshal(raw, &s) == nil && s != "" {
		return s
	}
	return string(raw)
}

// promptText renders token ids as words "t<id>" joined by spaces, so that
// prompts sharing a token prefix share a text prefix for a real tokenizer.
func promptText(tokens []uint32) string {
	var b strings.Builder
	b.Grow(len(tokens) * 6)
	for i, t := range tokens {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteByte('t')
		b.WriteString(strconv.FormatUint(uint64(t), 10))
	}
	return b.String()
}

// body builds the JSON body of r's request in mode m: in ModeText its
// Text, in ModeChat its Messages (a dataset's request), else its tokens
// rendered with text (nil: promptText). Its "model"
// is r's LoRA adapter when it has one (vLLM serves an adapter under its
// own model name, --lora-modules NAME=PATH), else model.
func body(m Mode, model string, r workload.Request, text func([]uint32) string) ([]byte, error) {
	if text == nil {
		text = promptText
	}
	out := max(r.OutputTokens, 1)
	if r.Adapter != "" {
		model = r.Adapter
	}
	req := completionRequest{
		Model:         model,
		MaxTokens:     out,
		MinTokens:     out,
		IgnoreEOS:     true,
		Stream:        true,
		StreamOptions: &streamOptions{IncludeUsage: true},
	}
	switch m {
	case ModeCompletions:
		tokens := r.Tokens
		if tokens == nil {
			tokens = []uint32{}
		}
		req.Prompt = tokens
	case ModeText:
		if r.Text != "" {
			req.Prompt = r.Text // a dataset's own text
		} else {
			req.Prompt = text(r.Tokens)
		}
	case ModeChat:
		if len(r.Messages) > 0 {
			req.Messages = make([]chatMessage, len(r.Messages)) // a dataset's conversation
			for i, m := range r.Messages {
				req.Messages[i] = chatMessage{Role: m.Role, Content: m.Content}
			}
		} else {
			req.Messages = []chatMessage{{Role: "user", Content: text(r.Tokens)}}
		}
	default:
		return nil, fmt.Errorf("loadgen: unknown mode %q", m)
	}
	return json.Marshal(req)
}

// path returns the API path of mode m.
func (m Mode) path() string {
	if m == ModeChat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// outcome is what one request measured, before it becomes a record.
type outcome struct {
	replica      string
	prefill      string        // PrefillReplicaHeader
	ttft         time.Duration // 0 if no content arrived
	latency      time.Duration
	itl          []float64 // ms between successive content chunks
	promptTokens int       // from usage; 0 if not reported
	cachedTokens int
	outputTokens int
	timings      *Timings // llama.cpp's, when the server sent them
	err          error
}

// do sends one request to url and measures its response stream. It returns
// when the stream ends, fails, or ctx is done.
func do(ctx context.Context, client *http.Client, url string, header http.Header, payload []byte, maxLine int) (o outcome) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		o.err = err
		return o
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	start := time.Now()
	defer func() {
		if o.latency == 0 {
			o.latency = time.Since(start)
		}
	}()
	resp, err := client.Do(req)
	if err != nil {
		o.err = err
		return o
	}
	defer resp.Body.Close()
	o.replica = resp.Header.Get(ReplicaHeader)
	o.prefill = resp.Header.Get(PrefillReplicaHeader)
	if resp.StatusCode != http.StatusOK {
		o.err = statusError(resp)
		return o
	}
	if ct, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); ct == "application/json" {
		// The server ignored "stream": one JSON response; TTFT = latency.
		o.readJSON(resp.Body, start)
		return o
	}
	o.readStream(resp.Body, start, maxLine)
	return o
}

// statusError describes a non-200 response, with the OpenAI error message
// when the body has one.
func statusError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	msg := strings.TrimSpace(string(b))
	var e struct {
		Error json.RawMessage `json:"error"`
		apiError
	}
	if json.Unmarshal(b, &e) == nil {
		if m := errorMessage(e.Error); m != "" {
			msg = m
		} else if e.Message != "" {
			msg = e.Message
		}
	}
	if len(msg) > 500 {
		msg = msg[:500] + "…"
	}
	if msg == "" {
		return fmt.Errorf("http %d %s", resp.StatusCode, http.StatusText(resp.StatusCode))
	}
	return fmt.Errorf("http %d: %s", resp.StatusCode, msg)
}

// readStream consumes an SSE response until [DONE].
func (o *outcome) readStream(body io.Reader, start time.Time, maxLine int) {
	sse := newSSEReader(body, maxLine)
	var last time.Time
	chunks := 0
	var u *usage
	for {
		ev, err := sse.Next()
		if err != nil {
			switch {
			case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
				o.err = fmt.Errorf("stream ended before [DONE] after %d content chunks", chunks)
			default:
				o.err = fmt.Errorf("read stream after %d content chunks: %w", chunks, err)
			}
			break
		}
		now := time.Now()
		data := strings.TrimSpace(ev.Data)
		if data == "[DONE]" {
			break
		}
		if ev.Name == "error" {
			o.err = fmt.Errorf("stream error: %s", data)
			break
		}
		var c chunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			o.err = fmt.Errorf("decode chunk %d: %w", chunks+1, err)
			break
		}
		if m := errorMessage(c.Error); m != "" {
			o.err = fmt.Errorf("stream error: %s", m)
			break
		}
		if c.Usage != nil {
			u = c.Usage
		}
		if t := parseTimings(c.Timings); t != nil {
			o.timings = t
		}
		if !c.hasContent() {
			continue
		}
		chunks++
		if o.ttft == 0 {
			o.ttft = max(now.Sub(start), time.Nanosecond)
		} else {
			o.itl = append(o.itl, float64(now.Sub(last))/float64(time.Millisecond))
		}
		last = now
	}
	o.latency = time.Since(start)
	o.outputTokens = chunks
	o.applyUsage(u)
}

// readJSON consumes a non-streamed JSON response.
func (o *outcome) readJSON(body io.Reader, start time.Time) {
	var c chunk
	if err := json.NewDecoder(body).Decode(&c); err != nil {
		o.err = fmt.Errorf("decode response: %w", err)
		return
	}
	if m := errorMessage(c.Error); m != "" {
		o.err = fmt.Errorf("response error: %s", m)
		return
	}
	o.ttft = max(time.Since(start), time.Nanosecond)
	o.latency = o.ttft
	if c.hasContent() {
		o.outputTokens = 1
	}
	o.timings = parseTimings(c.Timings)
	o.applyUsage(c.Usage)
}

// applyUsage takes token counts from the server's usage object when it sent
// one; the server's count of output tokens beats the number of chunks. The
// cached prompt tokens are usage.prompt_tokens_details.cached_tokens (vLLM,
// SGLang) when present, else usage.prompt_tokens − timings.prompt_n when the
// server sent llama.cpp's timings (o.timings, read before).
func (o *outcome) applyUsage(u *usage) {
	if u == nil {
		return
	}
	o.promptTokens = u.PromptTokens
	if u.CompletionTokens > 0 {
		o.outputTokens = u.CompletionTokens
	}
	switch {
	case u.PromptTokensDetails != nil && u.PromptTokensDetails.CachedTokens != nil:
		o.cachedTokens = *u.PromptTokensDetails.CachedTokens
	case o.timings != nil && u.PromptTokens > 0:
		o.cachedTokens = max(u.PromptTokens-o.timings.PromptN, 0)
	}
}
