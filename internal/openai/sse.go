package openai

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"sync"

	"github.com/prefixlb/prefixlb/internal/calibrate"
)

// MaxEventBytes bounds one Server-Sent Event (all its lines): a chunk of an
// OpenAI stream is a few hundred bytes, a big usage or logprobs object a few
// kilobytes.
const MaxEventBytes = 8 << 20

// ErrEventTooLong is returned by the framer for an event over its limit.
var ErrEventTooLong = errors.New("sse event too long")

// Event is one event of a stream: its exact bytes and its data.
type Event struct {
	// Raw is the event's bytes as received, through the blank line that
	// ends it (or, at the end of input, whatever is left).
	Raw []byte
	// Data is the event's "data:" field values joined with "\n"; HasData
	// says whether it had any.
	Data    []byte
	HasData bool
}

// Framer cuts a Server-Sent Events stream (WHATWG HTML, "server-sent
// events") into events without changing a byte, so a front door can forward
// each event the moment its blank line arrives and read its data on the side.
//
// Lines end in "\n" or "\r\n". A lone "\r" does not end a line (no
// OpenAI-compatible server sends one): such input only makes events longer.
// Where the input is split across reads does not change the events. Raw and
// Data are valid until the next call to Next.
//
// Framer is not safe for concurrent use.
type Framer struct {
	br   *bufio.Reader
	max  int
	raw  []byte
	data []byte
}

// framerBufSize is a framer's read buffer: what arrived together beyond it
// is framed after the next read.
const framerBufSize = 32 << 10

// framerKeep bounds the event buffers a released framer keeps for the next
// one: a stream's rare big event does not pin its memory in the pool.
const framerKeep = 64 << 10

// framers are released framers, their buffers kept: a proxy frames one
// stream per request, and the read buffer alone is 32 KB.
var framers = sync.Pool{New: func() any { return &Framer{br: bufio.NewReaderSize(nil, framerBufSize)} }}

// NewFramer returns a framer reading r, accepting events up to max bytes
// (MaxEventBytes if max ≤ 0). Release it when done to let the next framer
// reuse its buffers.
func NewFramer(r io.Reader, max int) *Framer {
	if max <= 0 {
		max = MaxEventBytes
	}
	f := framers.Get().(*Framer)
	f.br.Reset(r)
	f.max = max
	return f
}

// Release hands f's buffers to the next NewFramer. Neither f nor the Raw
// and Data of the events it returned may be used after; a framer that is
// not released is simply collected.
func (f *Framer) Release() {
	f.br.Reset(nil)
	if cap(f.raw) > framerKeep {
		f.raw = nil
	}
	if cap(f.data) > framerKeep {
		f.data = nil
	}
	f.raw, f.data = f.raw[:0], f.data[:0]
	framers.Put(f)
}

// Next returns the next event. At the end of input it returns io.EOF when
// the input ended between events, or the partial event and
// io.ErrUnexpectedEOF when it ended inside one. Other errors are the
// reader's or ErrEventTooLong (with the partial event).
func (f *Framer) Next() (Event, error) {
	f.raw, f.data = f.raw[:0], f.data[:0]
	hasData := false
	for {
		line, err := f.readLine()
		if err != nil {
			ev := Event{Raw: f.raw, Data: f.data, HasData: hasData}
			if err == io.EOF {
				if len(f.raw) == 0 {
					return Event{}, io.EOF
				}
				return ev, io.ErrUnexpectedEOF
			}
			return ev, err
		}
		body := bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
		if len(body) == 0 {
			return Event{Raw: f.raw, Data: f.data, HasData: hasData}, nil
		}
		if body[0] == ':' {
			continue // a comment
		}
		name, value, found := bytes.Cut(body, []byte(":"))
		if found && len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
		if string(name) == "data" {
			if hasData {
				f.data = append(f.data, '\n')
			}
			f.data = append(f.data, value...)
			hasData = true
		}
	}
}

// Ready reports whether the input already read holds the whole next event
// (Next will return it without reading): the stream's writer uses it to
// flush once for events that arrived together.
func (f *Framer) Ready() bool {
	n := f.br.Buffered()
	if n == 0 {
		return false
	}
	b, _ := f.br.Peek(n)
	// An event ends at a blank line: one at the start of what is buffered
	// (the last event ended just before it), or after a line's "\n".
	return b[0] == '\n' || bytes.HasPrefix(b, []byte("\r\n")) ||
		bytes.Contains(b, []byte("\n\n")) || bytes.Contains(b, []byte("\n\r\n"))
}

// readLine appends the next line (with its "\n") to f.raw and returns it.
// At the end of input a final line without "\n" is appended and io.EOF
// returned.
func (f *Framer) readLine() ([]byte, error) {
	start := len(f.raw)
	for {
		chunk, err := f.br.ReadSlice('\n')
		if len(f.raw)+len(chunk) > f.max {
			f.raw = append(f.raw, chunk[:max(0, f.max-len(f.raw))]...)
			return nil, ErrEventTooLong
		}
		f.raw = append(f.raw, chunk...)
		switch err {
		case nil:
			return f.raw[start:], nil
		case bufio.ErrBufferFull:
			continue
		default:
			return nil, err
		}
	}
}

// chunkInfo is what a front door reads from one event's data on the side: the
// fields of an OpenAI completion or chat chunk (or a whole non-streamed
// response) that tell it about tokens and usage, and llama.cpp's timings.
type chunkInfo struct {
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Content          *string         `json:"content"`
			ReasoningContent *string         `json:"reasoning_content"`
			Reasoning        *string         `json:"reasoning"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		Message *struct {
			Content *string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *Usage          `json:"usage"`
	Error json.RawMessage `json:"error"`
	// Timings is llama.cpp's timings object, kept raw: a server whose
	// "timings" has another shape must not make its chunks garbage
	// (ParseTimings reads it leniently).
	Timings json.RawMessage `json:"timings"`
}

// Usage is an OpenAI usage object.
type Usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// Timings is the timings object llama.cpp's llama-server adds to a
// completion or chat response, and to a stream's final chunk
// (examples/server/server.cpp, result_timings, at commit c392e50): what
// the request's prefill and decode cost on the replica. PromptN is the
// prompt tokens actually computed, so the prompt tokens served from the
// replica's cache are usage.prompt_tokens − PromptN.
type Timings struct {
	// PromptN is the prompt tokens computed; PromptMs the prefill's wall
	// time, PromptPerTokenMs its time per computed token.
	PromptN          int     `json:"prompt_n"`
	PromptMs         float64 `json:"prompt_ms"`
	PromptPerTokenMs float64 `json:"prompt_per_token_ms"`
	// PredictedN is the tokens generated; PredictedMs the decode's wall
	// time, PredictedPerTokenMs its time per token.
	PredictedN          int     `json:"predicted_n"`
	PredictedMs         float64 `json:"predicted_ms"`
	PredictedPerTokenMs float64 `json:"predicted_per_token_ms"`
}

// Calibration is what calibration reads of t (nil for a nil t).
func (t *Timings) Calibration() *calibrate.Timings {
	if t == nil {
		return nil
	}
	return &calibrate.Timings{PromptN: t.PromptN, PromptMs: t.PromptMs, PredictedN: t.PredictedN, PredictedMs: t.PredictedMs}
}

// maxTimingsCount caps the token counts read from a timings object.
const maxTimingsCount = 1 << 31

// ParseTimings reads a timings object leniently: nil when raw is absent,
// null, not an object of numbers, or has no non-negative prompt_n
// (llama.cpp's -1 means "not measured"). Counts are rounded and capped,
// and times that are negative or absent read as 0.
func ParseTimings(raw json.RawMessage) *Timings {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var t struct {
		PromptN             *float64 `json:"prompt_n"`
		PromptMs            float64  `json:"prompt_ms"`
		PromptPerTokenMs    float64  `json:"prompt_per_token_ms"`
		PredictedN          float64  `json:"predicted_n"`
		PredictedMs         float64  `json:"predicted_ms"`
		PredictedPerTokenMs float64  `json:"predicted_per_token_ms"`
	}
	if json.Unmarshal(raw, &t) != nil || t.PromptN == nil || *t.PromptN < 0 {
		return nil
	}
	count := func(v float64) int { return int(math.Round(min(max(v, 0), maxTimingsCount))) }
	ms := func(v float64) float64 { return max(v, 0) }
	return &Timings{
		PromptN: count(*t.PromptN), PromptMs: ms(t.PromptMs), PromptPerTokenMs: ms(t.PromptPerTokenMs),
		PredictedN: count(t.PredictedN), PredictedMs: ms(t.PredictedMs), PredictedPerTokenMs: ms(t.PredictedPerTokenMs),
	}
}

// CachedFromTimings is the prompt tokens a llama.cpp replica served from
// its cache: promptTokens (usage.prompt_tokens) less the tokens it
// computed (t.PromptN), at least 0; -1 without timings or without a
// prompt count (a usage object that lacks prompt_tokens says nothing).
func CachedFromTimings(promptTokens int, t *Timings) int {
	if t == nil || promptTokens <= 0 {
		return -1
	}
	return max(promptTokens-t.PromptN, 0)
}

// output reports whether a chunk carried output: text, content, reasoning
// or tool calls.
func (c *chunkInfo) output() bool {
	for _, ch := range c.Choices {
		if (ch.Text != nil && *ch.Text != "") ||
			(ch.Delta != nil && ((ch.Delta.Content != nil && *ch.Delta.Content != "") ||
				(ch.Delta.ReasoningContent != nil && *ch.Delta.ReasoningContent != "") ||
				(ch.Delta.Reasoning != nil && *ch.Delta.Reasoning != "") ||
				(len(ch.Delta.ToolCalls) > 0 && string(ch.Delta.ToolCalls) != "null"))) {
			return true
		}
	}
	return false
}

// Chunk is what ReadChunk learns from one completion or chat chunk.
type Chunk struct {
	// Output says whether the chunk carried output tokens.
	Output bool
	// HasUsage says whether it reported usage; PromptTokens,
	// CompletionTokens and CachedTokens (-1: not reported) are then set.
	// CachedTokens is usage.prompt_tokens_details.cached_tokens (vLLM,
	// SGLang) when present, else usage.prompt_tokens − timings.prompt_n
	// when the chunk has llama.cpp's timings.
	HasUsage                                     bool
	PromptTokens, CompletionTokens, CachedTokens int
	// Timings is the chunk's llama.cpp timings (nil: none). A stream sends
	// them on its final chunk, with the usage; a request with
	// timings_per_token on every chunk.
	Timings *Timings
}

// ReadChunk parses one completion or chat chunk — an SSE event's data, or
// a whole non-streamed response — the way serve reads replies on the
// side (the endpoint picker shares it). ok is false when data is not JSON.
func ReadChunk(data []byte) (c Chunk, ok bool) {
	if out, u, ok := quickChunk(data); ok {
		c.Output = out
		if u != nil {
			c.HasUsage = true
			c.PromptTokens, c.CompletionTokens = u.PromptTokens, u.CompletionTokens
			c.CachedTokens = u.Cached(nil)
		}
		return c, true
	}
	var ci chunkInfo
	if json.Unmarshal(data, &ci) != nil {
		return Chunk{}, false
	}
	c.Output = ci.output()
	c.Timings = ParseTimings(ci.Timings)
	if ci.Usage != nil {
		c.HasUsage = true
		c.PromptTokens, c.CompletionTokens = ci.Usage.PromptTokens, ci.Usage.CompletionTokens
		c.CachedTokens = ci.Usage.Cached(c.Timings)
	}
	return c, true
}

// Cached returns the reported cached prompt tokens: prompt_tokens_details
// when present (vLLM, SGLang), else from llama.cpp's timings t
// (CachedFromTimings; nil: none), else -1. A nil Usage reports -1.
func (u *Usage) Cached(t *Timings) int {
	if u == nil {
		return -1
	}
	if u.PromptTokensDetails != nil && u.PromptTokensDetails.CachedTokens != nil {
		return max(*u.PromptTokensDetails.CachedTokens, 0)
	}
	return CachedFromTimings(u.PromptTokens, t)
}

// done reports whether data is the stream's terminator "[DONE]".
func done(data []byte) bool { return string(bytes.TrimSpace(data)) == "[DONE]" }

// ErrNotJSON is returned by Stream.Observe for an event whose data is
// neither "[DONE]" nor JSON: a replica answering garbage.
var ErrNotJSON = errors.New("event data is not JSON")

// Stream accumulates what a front door learns from a stream's events.
type Stream struct {
	// Tokens counts events that carried output (text, content, reasoning or
	// tool calls): one token per chunk for vLLM without speculative decoding.
	Tokens int
	// Usage is the last usage object seen (nil if none).
	Usage *Usage
	// Timings is the last llama.cpp timings object seen (nil if none): on
	// the final chunk, with the usage.
	Timings *Timings
	// SawDone is set by the "[DONE]" event.
	SawDone bool
	// UpstreamError is set by an in-stream {"error":...} event.
	UpstreamError bool
}

// Observe reads one event. It returns whether the event carried output
// tokens, and ErrNotJSON if its data is neither "[DONE]" nor JSON.
func (s *Stream) Observe(ev *Event) (token bool, err error) {
	if !ev.HasData {
		return false, nil
	}
	if done(ev.Data) {
		s.SawDone = true
		return false, nil
	}
	if out, u, ok := quickChunk(ev.Data); ok {
		// No error or timings: tokens and usage.
		if u != nil {
			s.Usage = u
		}
		if out {
			s.Tokens++
		}
		return out, nil
	}
	var c chunkInfo
	if err := json.Unmarshal(ev.Data, &c); err != nil {
		return false, ErrNotJSON
	}
	if c.Usage != nil {
		s.Usage = c.Usage
	}
	if t := ParseTimings(c.Timings); t != nil {
		s.Timings = t
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		s.UpstreamError = true
	}
	token = c.output()
	if token {
		s.Tokens++
	}
	return token, nil
}

// Cached is the stream's reported cached prompt tokens (its last usage,
// with its timings), or -1.
func (s *Stream) Cached() int { return s.Usage.Cached(s.Timings) }
