package engine

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// testConfig is a fast engine: an H100 8B profile run 1000 times faster.
func testConfig(t testing.TB) Config {
	t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Replica.Profile = prof
	cfg.TimeScale = 1000
	cfg.Logger = slog.New(slog.DiscardHandler)
	return cfg
}

// start runs an engine behind an httptest server until the test ends, and
// checks that Run returns when its context is cancelled.
func start(t *testing.T, mod func(*Config)) (*Engine, *httptest.Server) {
	t.Helper()
	cfg := testConfig(t)
	if mod != nil {
		mod(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	srv := httptest.NewServer(e.Handler())
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after its context was cancelled")
		}
		srv.Close()
	})
	return e, srv
}

// words is a text prompt of n words, distinct per tag.
func words(tag string, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = fmt.Sprintf("%s%d", tag, i)
	}
	return strings.Join(w, " ")
}

func post(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

// response mirrors what a client decodes.
type testResponse struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         *string `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Delta        *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func complete(t *testing.T, url string, body map[string]any) testResponse {
	t.Helper()
	status, out := post(t, url, body)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, out)
	}
	var r testResponse
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("decode %s: %v", out, err)
	}
	if r.Usage == nil || r.Usage.PromptTokensDetails == nil {
		t.Fatalf("no usage with prompt_tokens_details: %s", out)
	}
	if len(r.Choices) != 1 {
		t.Fatalf("want 1 choice: %s", out)
	}
	return r
}

func (r testResponse) text() string {
	c := r.Choices[0]
	switch {
	case c.Text != nil:
		return *c.Text
	case c.Message != nil:
		return c.Message.Content
	}
	return ""
}

// readSSE reads a whole event stream, checking its framing: every event is
// "data: PAYLOAD\n\n", the last one [DONE]. It returns the payloads before
// [DONE].
func readSSE(t *testing.T, r io.Reader) []testResponse {
	t.Helper()
	raw, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	s := string(raw)
	if !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("stream does not end with [DONE]: %q", s)
	}
	var out []testResponse
	events := strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n")
	for i, ev := range events {
		payload, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(payload, "\n") {
			t.Fatalf("event %d is not one data line: %q", i, ev)
		}
		if i == len(events)-1 {
			break // [DONE]
		}
		var c testResponse
		if err := json.Unmarshal([]byte(payload), &c); err != nil {
			t.Fatalf("event %d: %v: %s", i, err, payload)
		}
		out = append(out, c)
	}
	return out
}

func streamReq(t *testing.T, url string, body map[string]any) []testResponse {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		out, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("Content-Type %q", ct)
	}
	return readSSE(t, resp.Body)
}

func TestCompletion(t *testing.T) {
	_, srv := start(t, nil)
	r := complete(t, srv.URL+"/v1/completions", map[string]any{
		"model": "whatever", "prompt": words("a", 40), "max_tokens": 7, "temperature": 0, "unknown": []int{1},
	})
	if r.Object != "text_completion" || r.Model != DefaultModel || !strings.HasPrefix(r.ID, "cmpl-") || r.Created == 0 {
		t.Errorf("header fields: %+v", r)
	}
	if got := len(strings.Fields(r.text())); got != 7 {
		t.Errorf("text %q has %d words, want 7", r.text(), got)
	}
	if fr := r.Choices[0].FinishReason; fr == nil || *fr != "length" {
		t.Errorf("finish_reason %v, want length", fr)
	}
	u := r.Usage
	if u.PromptTokens != 40 || u.CompletionTokens != 7 || u.TotalTokens != 47 || u.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("usage %+v, want 40+7=47, 0 cached", *u)
	}
	// max_tokens defaults to 16.
	r = complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": words("b", 3)})
	if r.Usage.CompletionTokens != DefaultMaxTokens {
		t.Errorf("default output %d tokens, want %d", r.Usage.CompletionTokens, DefaultMaxTokens)
	}
}

func TestCompletionStream(t *testing.T) {
	_, srv := start(t, nil)
	const n = 9
	for _, usage := range []bool{true, false} {
		t.Run(fmt.Sprintf("include_usage=%v", usage), func(t *testing.T) {
			body := map[string]any{"prompt": words("s", 30), "max_tokens": n, "stream": true}
			if usage {
				body["stream_options"] = map[string]any{"include_usage": true}
			}
			chunks := streamReq(t, srv.URL+"/v1/completions", body)
			want := n
			if usage {
				want++
			}
			if len(chunks) != want {
				t.Fatalf("%d chunks, want %d", len(chunks), want)
			}
			var text strings.Builder
			for i, c := range chunks[:n] {
				if c.Object != "text_completion" || len(c.Choices) != 1 || c.Choices[0].Text == nil || c.Usage != nil {
					t.Fatalf("chunk %d: %+v", i, c)
				}
				text.WriteString(*c.Choices[0].Text)
				fr := c.Choices[0].FinishReason
				if (i == n-1) != (fr != nil) || (fr != nil && *fr != "length") {
					t.Errorf("chunk %d: finish_reason %v", i, fr)
				}
			}
			if usage {
				last := chunks[n]
				if len(last.Choices) != 0 || last.Usage == nil || last.Usage.CompletionTokens != n ||
					last.Usage.PromptTokens != 30 || last.Usage.PromptTokensDetails == nil {
					t.Errorf("usage chunk: %+v", last)
				}
			}
			// The stream's text is the non-streamed text.
			whole := complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": words("s", 30), "max_tokens": n})
			if text.String() != whole.text() {
				t.Errorf("streamed %q, whole %q", text.String(), whole.text())
			}
		})
	}
}

func TestContinuousUsage(t *testing.T) {
	_, srv := start(t, nil)
	chunks := streamReq(t, srv.URL+"/v1/completions", map[string]any{"prompt": "a b c", "max_tokens": 3, "stream": true,
		"stream_options": map[string]any{"continuous_usage_stats": true}})
	if len(chunks) != 3 {
		t.Fatalf("%d chunks", len(chunks))
	}
	for i, c := range chunks {
		if c.Usage == nil || c.Usage.CompletionTokens != i+1 || c.Usage.PromptTokens != 3 {
			t.Errorf("chunk %d usage %+v", i, c.Usage)
		}
	}
}

func TestPromptForms(t *testing.T) {
	_, srv := start(t, nil)
	text := words("p", 50)
	status, out := post(t, srv.URL+"/tokenize", map[string]any{"prompt": text})
	if status != http.StatusOK {
		t.Fatalf("tokenize: %d %s", status, out)
	}
	var tok struct {
		Tokens      []uint32 `json:"tokens"`
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
	}
	if err := json.Unmarshal(out, &tok); err != nil {
		t.Fatal(err)
	}
	if tok.Count != 50 || len(tok.Tokens) != 50 || tok.MaxModelLen != DefaultMaxModelLen {
		t.Fatalf("tokenize: %s", out)
	}
	forms := map[string]any{
		"string":         text,
		"list of string": []string{text},
		"token ids":      tok.Tokens,
		"list of ids":    [][]uint32{tok.Tokens},
	}
	var want string
	for _, name := range []string{"string", "list of string", "token ids", "list of ids"} {
		r := complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": forms[name], "max_tokens": 5})
		if r.Usage.PromptTokens != 50 {
			t.Errorf("%s: prompt_tokens %d, want 50", name, r.Usage.PromptTokens)
		}
		if want == "" {
			want = r.text()
		} else if r.text() != want {
			t.Errorf("%s: text %q, want %q (same tokens)", name, r.text(), want)
		}
	}
}

func TestChat(t *testing.T) {
	_, srv := start(t, nil)
	msgs := []map[string]any{
		{"role": "system", "content": "you are a test"},
		{"role": "user", "content": []map[string]any{{"type": "text", "text": "hello there"}}},
	}
	r := complete(t, srv.URL+"/v1/chat/completions", map[string]any{"messages": msgs, "max_completion_tokens": 4, "max_tokens": 99})
	if r.Object != "chat.completion" || !strings.HasPrefix(r.ID, "chatcmpl-") {
		t.Errorf("chat response: %+v", r)
	}
	if m := r.Choices[0].Message; m == nil || m.Role != "assistant" || len(strings.Fields(m.Content)) != 4 {
		t.Errorf("message %+v, want 4 words from the assistant", m)
	}
	// <|system|> you are a test <|user|> hello there <|assistant|>
	if r.Usage.PromptTokens != 9 || r.Usage.CompletionTokens != 4 {
		t.Errorf("usage %+v", *r.Usage)
	}
	// /tokenize renders the same template.
	status, out := post(t, srv.URL+"/tokenize", map[string]any{"messages": msgs})
	if status != http.StatusOK || !strings.Contains(string(out), `"count":9`) {
		t.Errorf("tokenize messages: %d %s", status, out)
	}

	chunks := streamReq(t, srv.URL+"/v1/chat/completions", map[string]any{
		"messages":   []map[string]any{{"role": "system", "content": "you are a test"}, {"role": "user", "content": "hello there"}},
		"max_tokens": 4, "stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	if len(chunks) != 1+4+1 {
		t.Fatalf("%d chunks, want role + 4 tokens + usage", len(chunks))
	}
	if d := chunks[0].Choices[0].Delta; d == nil || d.Role != "assistant" || d.Content == nil || *d.Content != "" {
		t.Errorf("first chunk %+v, want the assistant role", chunks[0])
	}
	var text strings.Builder
	for i, c := range chunks[1:5] {
		if c.Object != "chat.completion.chunk" || c.Choices[0].Delta == nil || c.Choices[0].Delta.Content == nil {
			t.Fatalf("chunk %d: %+v", i+1, c)
		}
		text.WriteString(*c.Choices[0].Delta.Content)
	}
	if text.String() != r.Choices[0].Message.Content {
		t.Errorf("streamed %q, whole %q (string and text-part content are the same prompt)", text.String(), r.Choices[0].Message.Content)
	}
	if u := chunks[5].Usage; u == nil || u.PromptTokens != 9 || u.CompletionTokens != 4 {
		t.Errorf("usage chunk %+v", chunks[5])
	}
}

func TestCachedTokens(t *testing.T) {
	e, srv := start(t, nil)
	url := srv.URL + "/v1/completions"
	shared := words("shared", 64) // 4 blocks of 16
	tests := []struct {
		name   string
		prompt string
		want   int
	}{
		{"cold", shared + " " + words("x", 36), 0},
		{"same prompt", shared + " " + words("x", 36), 96},   // 100 tokens: 6 full blocks, the last token recomputed
		{"shared prefix", shared + " " + words("y", 36), 64}, // 4 shared blocks
		{"other", words("z", 100), 0},
	}
	for _, tt := range tests {
		r := complete(t, url, map[string]any{"prompt": tt.prompt, "max_tokens": 2})
		if got := r.Usage.PromptTokensDetails.CachedTokens; got != tt.want {
			t.Errorf("%s: cached_tokens %d, want %d", tt.name, got, tt.want)
		}
	}
	st := e.Stats()
	if st.PrefixCacheHits != 96+64 || st.PrefixCacheQueries != 400 {
		t.Errorf("stats: hits %d queries %d, want 160 and 400", st.PrefixCacheHits, st.PrefixCacheQueries)
	}
}

func TestDeterministicText(t *testing.T) {
	_, srv := start(t, nil)
	url := srv.URL + "/v1/completions"
	a := complete(t, url, map[string]any{"prompt": "one two three", "max_tokens": 12}).text()
	b := complete(t, url, map[string]any{"prompt": "one two three", "max_tokens": 12}).text()
	c := complete(t, url, map[string]any{"prompt": "one two four", "max_tokens": 12}).text()
	short := complete(t, url, map[string]any{"prompt": "one two three", "max_tokens": 5}).text()
	if a != b {
		t.Errorf("same request, different text: %q, %q", a, b)
	}
	if a == c {
		t.Errorf("different prompts, same text %q", a)
	}
	if !strings.HasPrefix(a, short) {
		t.Errorf("5-token text %q is not a prefix of the 12-token text %q", short, a)
	}
	// Another engine gives the same text.
	_, srv2 := start(t, nil)
	if d := complete(t, srv2.URL+"/v1/completions", map[string]any{"prompt": "one two three", "max_tokens": 12}).text(); d != a {
		t.Errorf("other engine: %q, want %q", d, a)
	}
}

// apiErr is the OpenAI error body.
type apiErr struct {
	Error *struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

func TestErrors(t *testing.T) {
	_, srv := start(t, func(c *Config) {
		c.MaxModelLen = 100
		c.MaxBodyBytes = 4096
		c.StrictModel = true
	})
	big := `{"prompt":"` + strings.Repeat("a ", 3000) + `"}`
	tests := []struct {
		name, path, body string
		status           int
		msg              string // a substring of the message
	}{
		{"malformed", "/v1/completions", `{"prompt":`, 400, "malformed JSON"},
		{"trailing data", "/v1/completions", `{"prompt":"a"} x`, 400, "malformed JSON"},
		{"not an object", "/v1/completions", `[1,2]`, 400, "JSON object"},
		{"max_tokens string", "/v1/completions", `{"prompt":"a","max_tokens":"5"}`, 400, `"max_tokens"`},
		{"max_tokens fraction", "/v1/completions", `{"prompt":"a","max_tokens":1.5}`, 400, `"max_tokens"`},
		{"max_tokens zero", "/v1/completions", `{"prompt":"a","max_tokens":0}`, 400, "max_tokens"},
		{"stream string", "/v1/completions", `{"prompt":"a","stream":"yes"}`, 400, `"stream"`},
		{"include_usage string", "/v1/completions", `{"prompt":"a","stream_options":{"include_usage":1}}`, 400, "include_usage"},
		{"prompt number", "/v1/completions", `{"prompt":5}`, 400, "prompt must be"},
		{"no prompt", "/v1/completions", `{"max_tokens":3}`, 400, "prompt is required"},
		{"empty prompt", "/v1/completions", `{"prompt":""}`, 400, "empty"},
		{"empty ids", "/v1/completions", `{"prompt":[]}`, 400, "empty"},
		{"negative id", "/v1/completions", `{"prompt":[1,-2]}`, 400, "out of range"},
		{"mixed list", "/v1/completions", `{"prompt":[1,"a"]}`, 400, "integers"},
		{"batched strings", "/v1/completions", `{"prompt":["a","b"]}`, 400, "batched prompts not supported"},
		{"batched ids", "/v1/completions", `{"prompt":[[1],[2]]}`, 400, "batched prompts not supported"},
		{"n=2", "/v1/completions", `{"prompt":"a","n":2}`, 400, "n must be 1"},
		{"min over max", "/v1/completions", `{"prompt":"a","max_tokens":2,"min_tokens":3}`, 400, "min_tokens"},
		{"too long", "/v1/completions", `{"prompt":"` + words("l", 95) + `","max_tokens":10}`, 400, "maximum context length is 100"},
		{"body too large", "/v1/completions", big, 413, "over 4096 bytes"},
		{"other model", "/v1/completions", `{"prompt":"a","model":"gpt-9"}`, 404, "gpt-9"},
		{"chat no messages", "/v1/chat/completions", `{"messages":[]}`, 400, "messages"},
		{"chat messages string", "/v1/chat/completions", `{"messages":"hi"}`, 400, `"messages"`},
		{"chat no role", "/v1/chat/completions", `{"messages":[{"content":"hi"}]}`, 400, "role is required"},
		{"chat content number", "/v1/chat/completions", `{"messages":[{"role":"user","content":3}]}`, 400, "content"},
		{"chat image part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}`, 400, "image_url"},
		{"chat max_completion_tokens string", "/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],"max_completion_tokens":"3"}`, 400, "max_completion_tokens"},
		{"chat too long", "/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],"max_tokens":100}`, 400, "maximum context length"},
		{"tokenize nothing", "/tokenize", `{}`, 400, "required"},
		{"tokenize prompt ids", "/tokenize", `{"prompt":[1,2]}`, 400, "prompt"},
		{"tokenize body too large", "/tokenize", big, 413, "4096"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, out := post(t, srv.URL+tt.path, tt.body)
			if status != tt.status {
				t.Fatalf("status %d, want %d: %s", status, tt.status, out)
			}
			var e apiErr
			if err := json.Unmarshal(out, &e); err != nil || e.Error == nil {
				t.Fatalf("not an OpenAI error body: %s", out)
			}
			if e.Error.Code != tt.status || e.Error.Type == "" || !strings.Contains(e.Error.Message, tt.msg) {
				t.Errorf("error %+v, want code %d and a message containing %q", *e.Error, tt.status, tt.msg)
			}
		})
	}
	// Unknown fields are ignored and the model's own name is accepted.
	if status, out := post(t, srv.URL+"/v1/completions", `{"prompt":"a b","max_tokens":2,"model":"prefixlb-sim","logprobs":null,"echo":false,"stop":["x"]}`); status != 200 {
		t.Errorf("lenient request: %d %s", status, out)
	}
}

func TestKVCapacityLimit(t *testing.T) {
	_, srv := start(t, func(c *Config) { c.Replica.KVCapacity = 64 }) // 4 blocks
	status, out := post(t, srv.URL+"/v1/completions", map[string]any{"prompt": words("k", 40), "max_tokens": 10})
	if status != 400 || !strings.Contains(string(out), "KV blocks") {
		t.Errorf("over KV capacity: %d %s", status, out)
	}
}

func TestModelsHealth(t *testing.T) {
	_, srv := start(t, func(c *Config) { c.Model = "meta-llama/Llama-3.1-8B" })
	resp, err := http.Get(srv.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if err != nil || models.Object != "list" || len(models.Data) != 1 ||
		models.Data[0].ID != "meta-llama/Llama-3.1-8B" || models.Data[0].Object != "model" || models.Data[0].OwnedBy != "prefixlb" {
		t.Errorf("models: %+v (%v)", models, err)
	}
	resp, err = http.Get(srv.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("health %d", resp.StatusCode)
	}
}

func TestStopped(t *testing.T) {
	e, err := New(testConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	health := func() int {
		resp, err := http.Get(srv.URL + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := health(); got != 503 {
		t.Errorf("health before Run: %d, want 503", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.Run(ctx); err != nil {
		t.Fatalf("Run with a cancelled context: %v", err)
	}
	if err := e.Run(context.Background()); !errors.Is(err, ErrRunning) {
		t.Errorf("second Run: %v, want ErrRunning", err)
	}
	if got := health(); got != 503 {
		t.Errorf("health after Run: %d, want 503", got)
	}
	status, out := post(t, srv.URL+"/v1/completions", map[string]any{"prompt": "a"})
	if status != 503 || !strings.Contains(string(out), "stopped") {
		t.Errorf("request after Run: %d %s", status, out)
	}
}

// TestStopMidRequest: requests in flight when Run returns fail, streamed ones
// with an error event and [DONE].
func TestStopMidRequest(t *testing.T) {
	cfg := testConfig(t)
	cfg.TimeScale = 1
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()

	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"prompt":"a b c","max_tokens":100000,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil { // the first token
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"error"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("stream after stop ends %q", tail(string(rest), 300))
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// metricValue returns the value of the sample name{labels...} (labels as
// written, in order), or -1.
func metricValue(t *testing.T, text, series string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindStringSubmatch(text)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatalf("%s: %v", series, err)
	}
	return v
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Errorf("metrics Content-Type %q", ct)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestMetrics(t *testing.T) {
	e, srv := start(t, nil)
	for range 3 {
		complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": words("m", 40), "max_tokens": 5})
	}
	const model = `model_name="prefixlb-sim"`
	// The last response can reach the client a moment before the engine's
	// driver has counted its request out of "running": wait for it.
	text := scrape(t, srv.URL)
	for deadline := time.Now().Add(5 * time.Second); metricValue(t, text, `vllm:num_requests_running{`+model+`}`) != 0; {
		if time.Now().After(deadline) {
			break // the check below reports it
		}
		runtime.Gosched()
		text = scrape(t, srv.URL)
	}
	st := e.Stats()
	want := map[string]float64{
		`vllm:num_requests_running{` + model + `}`:                           0,
		`vllm:num_requests_waiting{` + model + `}`:                           0,
		`vllm:kv_cache_usage_perc{` + model + `}`:                            0,
		`vllm:gpu_cache_usage_perc{` + model + `}`:                           0,
		`vllm:prefix_cache_queries_total{` + model + `}`:                     120,
		`vllm:prefix_cache_hits_total{` + model + `}`:                        64, // 2 × 32
		`vllm:num_preemptions_total{` + model + `}`:                          0,
		`vllm:prompt_tokens_total{` + model + `}`:                            120,
		`vllm:generation_tokens_total{` + model + `}`:                        15,
		`vllm:request_success_total{finished_reason="length",` + model + `}`: 3,
		`vllm:request_success_total{finished_reason="abort",` + model + `}`:  0,
		`vllm:time_to_first_token_seconds_count{` + model + `}`:              3,
		`vllm:inter_token_latency_seconds_count{` + model + `}`:              12,
		`vllm:e2e_request_latency_seconds_count{` + model + `}`:              3,
		`vllm:e2e_request_latency_seconds_bucket{` + model + `,le="+Inf"}`:   3,
		`vllm:time_to_first_token_seconds_bucket{` + model + `,le="2560"}`:   3,
		fmt.Sprintf(`vllm:cache_config_info{block_size="16",enable_prefix_caching="True",%s,num_gpu_blocks="%d"}`, model, st.TotalBlocks): 1,
	}
	for series, v := range want {
		if got := metricValue(t, text, series); got != v {
			t.Errorf("%s = %v, want %v", series, got, v)
		}
	}
	for _, name := range []string{"vllm:num_requests_running", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"} {
		if !strings.Contains(text, "# TYPE "+name+" ") {
			t.Errorf("no TYPE line for %s", name)
		}
	}
	if strings.Contains(text, "NaN") {
		t.Errorf("NaN in metrics")
	}
}

// TestLoadAndDisconnect: with one request slot, a second request waits; the
// metrics show it, and clients that go away free the replica.
func TestLoadAndDisconnect(t *testing.T) {
	e, srv := start(t, func(c *Config) {
		c.TimeScale = 1
		c.Replica.MaxRunning = 1
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitStats := func(what string, cond func(replica.Stats) bool) {
		t.Helper()
		if err := e.waitStats(ctx, cond); err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
	}

	// A: a long stream; read its first token.
	actx, acancel := context.WithCancel(ctx)
	defer acancel()
	req, _ := http.NewRequestWithContext(actx, "POST", srv.URL+"/v1/completions",
		strings.NewReader(`{"prompt":"a b c d","max_tokens":100000,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first chunk %q: %v", line, err)
	}
	waitStats("A running", func(s replica.Stats) bool { return s.Running == 1 })

	// B: waits behind A.
	bctx, bcancel := context.WithCancel(ctx)
	bdone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(bctx, "POST", srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"x y z","max_tokens":3}`))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		bdone <- err
	}()
	waitStats("B waiting", func(s replica.Stats) bool { return s.Waiting == 1 })
	text := scrape(t, srv.URL)
	const model = `{model_name="prefixlb-sim"}`
	if r, w := metricValue(t, text, "vllm:num_requests_running"+model), metricValue(t, text, "vllm:num_requests_waiting"+model); r != 1 || w != 1 {
		t.Errorf("under load: running %v waiting %v, want 1 and 1", r, w)
	}
	if u := metricValue(t, text, "vllm:kv_cache_usage_perc"+model); !(u > 0) {
		t.Errorf("kv_cache_usage_perc %v under load, want > 0", u)
	}

	bcancel()
	if err := <-bdone; !errors.Is(err, context.Canceled) {
		t.Errorf("B: %v, want context.Canceled", err)
	}
	waitStats("B cancelled", func(s replica.Stats) bool { return s.Waiting == 0 && s.Cancelled == 1 })
	acancel() // the client goes away mid-stream
	waitStats("A cancelled", func(s replica.Stats) bool { return s.Running == 0 && s.Cancelled == 2 })
	text = scrape(t, srv.URL)
	if r := metricValue(t, text, "vllm:num_requests_running"+model); r != 0 {
		t.Errorf("running %v after disconnects", r)
	}
	if a := metricValue(t, text, `vllm:request_success_total{finished_reason="abort",model_name="prefixlb-sim"}`); a != 2 {
		t.Errorf("aborted %v, want 2", a)
	}
	if st := e.Stats(); st.KVUsage != 0 || st.Finished != 0 {
		t.Errorf("after disconnects: %+v", st)
	}
}

// TestKVEvents: the hook sees the blocks a request stores, keyed like the
// router keys them, and a reset clears them.
func TestKVEvents(t *testing.T) {
	var (
		mu  sync.Mutex
		got []replica.Event
	)
	_, srv := start(t, func(c *Config) {
		c.OnKVEvent = func(ev replica.Event) {
			mu.Lock()
			got = append(got, ev)
			mu.Unlock()
		}
	})
	prompt := words("kv", 40)
	complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 2})
	var stored []blocks.Key
	mu.Lock()
	for _, ev := range got {
		if ev.Kind != replica.BlocksStored || ev.At.IsZero() {
			t.Errorf("event %+v", ev)
		}
		stored = append(stored, ev.Keys...)
	}
	mu.Unlock()
	want := blocks.Keys(nil, WordTokenizer{}.Encode(prompt), 16)
	if !slices.Equal(stored, want) {
		t.Errorf("stored %v, want %v", stored, want)
	}
	status, out := post(t, srv.URL+"/reset_prefix_cache", "")
	if status != 200 {
		t.Fatalf("reset: %d %s", status, out)
	}
	mu.Lock()
	last := got[len(got)-1]
	mu.Unlock()
	if last.Kind != replica.AllCleared {
		t.Errorf("last event %v, want AllCleared", last.Kind)
	}
	r := complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 2})
	if c := r.Usage.PromptTokensDetails.CachedTokens; c != 0 {
		t.Errorf("cached_tokens %d after reset, want 0", c)
	}
}

func TestConcurrentRequests(t *testing.T) {
	e, srv := start(t, nil)
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			body := map[string]any{"prompt": words("shared", 48) + " " + words(fmt.Sprint("c", i), 10), "max_tokens": 5 + i}
			if i%2 == 0 {
				body["stream"] = true
				chunks := streamReq(t, srv.URL+"/v1/completions", body)
				if len(chunks) != 5+i {
					t.Errorf("request %d: %d chunks", i, len(chunks))
				}
				return
			}
			r := complete(t, srv.URL+"/v1/completions", body)
			if r.Usage.CompletionTokens != 5+i {
				t.Errorf("request %d: usage %+v", i, *r.Usage)
			}
		})
	}
	wg.Wait()
	if st := e.Stats(); st.Finished != 20 || st.Running != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestConfigValidate(t *testing.T) {
	good := testConfig(t)
	tests := []struct {
		name string
		mod  func(*Config)
	}{
		{"no profile", func(c *Config) { c.Replica.Profile = nil }},
		{"negative time scale", func(c *Config) { c.TimeScale = -1 }},
		{"max model len", func(c *Config) { c.MaxModelLen = 1 }},
		{"body bytes", func(c *Config) { c.MaxBodyBytes = -1 }},
		{"local", func(c *Config) { c.Replica.Local = "nope" }},
	}
	for _, tt := range tests {
		c := good
		tt.mod(&c)
		if _, err := New(c); !errors.Is(err, ErrInvalidConfig) && !errors.Is(err, replica.ErrInvalidConfig) {
			t.Errorf("%s: New: %v, want an invalid-config error", tt.name, err)
		}
	}
	if _, err := New(good); err != nil {
		t.Errorf("good config: %v", err)
	}
}

// TestCPUOffloadEvents: with a CPU offload tier the engine publishes the
// tier's changes as vLLM's OffloadingConnector does (BlockStored without
// token ids or parent, medium CPU), a prompt pushed out of a small GPU
// cache comes back from the tier (cached_tokens counts it, as vLLM's counts
// a connector's tokens), and prefixlb's own index maps the token-less CPU
// blocks to the prompt's router keys.
func TestCPUOffloadEvents(t *testing.T) {
	rec := &kvRecorder{}
	e, srv := start(t, func(c *Config) {
		c.Replica.KVCapacity = 5 * 16
		c.Replica.CPUOffloadTokens = 64 * 16
		c.KVPublisher = rec
	})
	a, b := words("tierA", 48), words("tierB", 48)
	complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": a, "max_tokens": 2})
	complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": b, "max_tokens": 2})
	r := complete(t, srv.URL+"/v1/completions", map[string]any{"prompt": a, "max_tokens": 2})
	if c := r.Usage.PromptTokensDetails.CachedTokens; c != 32 {
		t.Errorf("cached_tokens %d, want 32 (GPU and CPU-tier blocks, the last block recomputed)", c)
	}
	if st := e.Stats(); st.OffloadLoads != 1 {
		t.Errorf("%d loads from the CPU tier, want 1", st.OffloadLoads)
	}
	rec.mu.Lock()
	events := slices.Clone(rec.events)
	rec.mu.Unlock()
	var cpuHashes []uint64
	for _, ev := range events {
		switch ev := ev.(type) {
		case kvevents.BlockStored:
			if ev.Medium != kvevents.MediumCPU {
				continue
			}
			if len(ev.TokenIDs) != 0 || ev.HasParent || ev.BlockSize != 16 || ev.LoRAName != nil {
				t.Errorf("CPU BlockStored %+v: want vLLM's (no token ids, no parent, block size 16)", ev)
			}
			cpuHashes = append(cpuHashes, ev.BlockHashes...)
		case kvevents.BlockRemoved:
			if ev.Medium != kvevents.MediumGPU && ev.Medium != kvevents.MediumCPU {
				t.Errorf("BlockRemoved medium %q", ev.Medium)
			}
		}
	}
	keysA := blocks.Keys(nil, WordTokenizer{}.Encode(a), 16)
	for _, k := range keysA {
		if !slices.Contains(cpuHashes, uint64(k)) {
			t.Errorf("prompt block %d never written to the CPU tier (CPU stores %v)", k, cpuHashes)
		}
	}
	ix := kvevents.NewIndex()
	if _, err := ix.Apply("e", events, nil); err != nil {
		t.Fatal(err)
	}
	for _, k := range keysA {
		if got, ok := ix.Lookup("e", kvevents.MediumCPU, uint64(k)); !ok || got != k {
			t.Errorf("index: CPU block %d → %d, %v", k, got, ok)
		}
	}
}

// TestLoRARequestsInfo: with one adapter slot, a long request for sql runs
// and one for chat waits (max_loras); /metrics reports them as vLLM's
// vllm:lora_requests_info does, which the router's scraper reads back.
func TestLoRARequestsInfo(t *testing.T) {
	e, srv := start(t, func(c *Config) {
		c.TimeScale = 1
		c.Replica.MaxLoras = 1
		c.LoRAModules = []string{"sql", "chat"}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if l, err := upstream.ParseLoad(strings.NewReader(scrape(t, srv.URL))); err != nil || l.LoRA == nil || l.LoRA.MaxLoRAs != 1 || len(l.LoRA.Running)+len(l.LoRA.Waiting) != 0 {
		t.Fatalf("idle: LoRA %+v (%v), want max 1, none running or waiting", l.LoRA, err)
	}
	stream := func(model string) {
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/completions",
			strings.NewReader(`{"model":"`+model+`","prompt":"a b c d","max_tokens":100000,"stream":true}`))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			go func() { _, _ = io.Copy(io.Discard, resp.Body); resp.Body.Close() }()
		}
	}
	go stream("sql")
	if err := e.waitStats(ctx, func(s replica.Stats) bool { return s.Running == 1 }); err != nil {
		t.Fatal(err)
	}
	go stream("chat")
	if err := e.waitStats(ctx, func(s replica.Stats) bool { return s.Waiting == 1 }); err != nil {
		t.Fatal(err)
	}
	l, err := upstream.ParseLoad(strings.NewReader(scrape(t, srv.URL)))
	if err != nil || l.LoRA == nil || !slices.Equal(l.LoRA.Running, []string{"sql"}) || !slices.Equal(l.LoRA.Waiting, []string{"chat"}) || l.LoRA.MaxLoRAs != 1 {
		t.Errorf("under load: LoRA %+v (%v), want sql running, chat waiting, max 1", l.LoRA, err)
	}
	cancel()
}
