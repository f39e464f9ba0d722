package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// sentBody is the part of a request body the fake server checks.
type sentBody struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	Messages      []chatMessage   `json:"messages"`
	MaxTokens     int             `json:"max_tokens"`
	MinTokens     int             `json:"min_tokens"`
	IgnoreEOS     bool            `json:"ignore_eos"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
}

// readBody decodes the request body or fails the test.
func readBody(t *testing.T, r *http.Request) sentBody {
	t.Helper()
	var b sentBody
	if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
		t.Errorf("decode request body: %v", err)
	}
	return b
}

// sse writes one SSE event and flushes it to the client.
func sse(w http.ResponseWriter, data string) {
	fmt.Fprintf(w, "data: %s\n\n", data)
	w.(http.Flusher).Flush()
}

// textChunk is a vLLM /v1/completions stream chunk carrying text.
func textChunk(text string) string {
	return fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}`, text)
}

// usageChunk is vLLM's last chunk with stream_options.include_usage.
func usageChunk(prompt, completion, cached int) string {
	return fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}`,
		prompt, prompt+completion, completion, cached)
}

// startStream writes the headers of a streamed response.
func startStream(w http.ResponseWriter, replica string) {
	w.Header().Set("Content-Type", "text/event-stream")
	if replica != "" {
		w.Header().Set(ReplicaHeader, replica)
	}
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
}

// vllm is a fake vLLM that streams max_tokens one-word chunks, then usage
// claiming the prompt's first half was cached.
func vllm(t *testing.T, replica string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B","object":"model"},{"id":"other"}]}`)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		b := readBody(t, r)
		var ids []uint32
		if err := json.Unmarshal(b.Prompt, &ids); err != nil {
			t.Errorf("prompt is not token ids: %s", b.Prompt)
		}
		startStream(w, replica)
		for i := range b.MaxTokens {
			sse(w, textChunk(fmt.Sprintf(" w%d", i)))
		}
		sse(w, usageChunk(len(ids), b.MaxTokens, len(ids)/2))
		sse(w, "[DONE]")
	})
	return mux
}

// checkNoLeak fails the test if a goroutine of Run is still alive. A
// goroutine that has called wg.Done may not have returned yet when Run does;
// there is no event for a goroutine's exit, so, like go.uber.org/goleak, it
// retries for a while before reporting.
func checkNoLeak(t *testing.T) {
	t.Helper()
	var alive []string
	for deadline := time.Now().Add(2 * time.Second); ; {
		alive = alive[:0]
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "internal/loadgen.Run") || strings.Contains(g, "internal/loadgen.startProgress") {
				alive = append(alive, g)
			}
		}
		if len(alive) == 0 || time.Now().After(deadline) {
			break
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
	for _, g := range alive {
		t.Errorf("goroutine of Run still alive after it returned:\n%s", g)
	}
}

func tokens(n int, base uint32) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = base + uint32(i)
	}
	return ts
}

func TestRunStreaming(t *testing.T) {
	srv := httptest.NewServer(vllm(t, "replica-1"))
	defer srv.Close()
	reqs := []workload.Request{
		{ID: 0, Arrival: 0, Tokens: tokens(10, 1), OutputTokens: 5, Session: "s1", Group: "g1"},
		{ID: 1, Arrival: time.Millisecond, Tokens: tokens(20, 1), OutputTokens: 1},
	}
	cfg := DefaultConfig()
	cfg.Target = srv.URL + "/v1/"
	cfg.Policy, cfg.Rate, cfg.Workload = "e2", 2, "shared-prefix"
	out, err := Run(context.Background(), cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	checkNoLeak(t)
	if out.Model != "meta-llama/Llama-3.1-8B" {
		t.Errorf("Model = %q, want the first listed", out.Model)
	}
	if len(out.Records) != 2 {
		t.Fatalf("got %d records, want 2", len(out.Records))
	}
	r0 := out.Records[0]
	if r0.Error != "" {
		t.Fatalf("record 0 failed: %s", r0.Error)
	}
	if r0.ID != 0 || r0.Policy != "e2" || r0.Rate != 2 || r0.Replica != "replica-1" || r0.Session != "s1" || r0.Group != "g1" {
		t.Errorf("record 0 labels = %+v", r0)
	}
	if r0.PromptTokens != 10 || r0.CachedTokens != 5 || r0.OutputTokens != 5 {
		t.Errorf("record 0 tokens: prompt %d cached %d output %d, want 10 5 5", r0.PromptTokens, r0.CachedTokens, r0.OutputTokens)
	}
	if len(r0.ITLMs) != 4 {
		t.Errorf("record 0 has %d ITL samples, want 4 (5 chunks)", len(r0.ITLMs))
	}
	if !(r0.TTFTMs > 0 && r0.LatencyMs >= r0.TTFTMs) {
		t.Errorf("record 0: ttft %v, latency %v", r0.TTFTMs, r0.LatencyMs)
	}
	if want := report.TPOT(r0.TTFTMs, r0.LatencyMs, 5); r0.TPOTMs != want {
		t.Errorf("TPOT = %v, want %v", r0.TPOTMs, want)
	}
	res := out.Result
	if res.Requests != 2 || res.Errors != 0 || res.Completed != 2 || res.Policy != "e2" || res.Workload != "shared-prefix" {
		t.Errorf("result = %+v", res)
	}
	if res.Target != srv.URL {
		t.Errorf("Target = %q, want %q (trailing /v1/ stripped)", res.Target, srv.URL)
	}
	// (5 + 10) cached of (10 + 20) prompt tokens.
	if res.PrefixHitRatio != 0.5 {
		t.Errorf("PrefixHitRatio = %v, want 0.5", res.PrefixHitRatio)
	}
	if res.ITL == nil || res.SendLag == nil || res.ThroughputRPS <= 0 || res.OutputTokensPerS <= 0 {
		t.Errorf("result extras missing: %+v", res)
	}
	if len(res.PerReplica) != 1 || res.PerReplica[0].Replica != "replica-1" || res.PerReplica[0].Requests != 2 {
		t.Errorf("PerReplica = %+v", res.PerReplica)
	}
}

func TestRequestBodies(t *testing.T) {
	type seen struct {
		path string
		body sentBody
	}
	got := make(chan seen, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			http.NotFound(w, r) // no /v1/models: the model is "default"
			return
		}
		got <- seen{r.URL.Path, readBody(t, r)}
		startStream(w, "")
		sse(w, `{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`)
		sse(w, `{"choices":[{"index":0,"delta":{"content":"a"},"text":"a"}]}`)
		sse(w, "[DONE]")
	}))
	defer srv.Close()
	req := workload.Request{Tokens: []uint32{7, 8, 9}, OutputTokens: 4}
	tests := []struct {
		mode       Mode
		model      string
		wantPath   string
		wantPrompt string
		wantChat   string
		wantModel  string
	}{
		{ModeCompletions, "", "/v1/completions", "[7,8,9]", "", "default"},
		{ModeText, "m", "/v1/completions", `"t7 t8 t9"`, "", "m"},
		{ModeChat, "m", "/v1/chat/completions", "", "t7 t8 t9", "m"},
	}
	for _, tt := range tests {
		t.Run(string(tt.mode), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Target, cfg.Mode, cfg.Model = srv.URL, tt.mode, tt.model
			out, err := Run(context.Background(), cfg, []workload.Request{req})
			if err != nil {
				t.Fatal(err)
			}
			s := <-got
			if s.path != tt.wantPath {
				t.Errorf("path = %q, want %q", s.path, tt.wantPath)
			}
			b := s.body
			if tt.wantPrompt != "" && string(b.Prompt) != tt.wantPrompt {
				t.Errorf("prompt = %s, want %s", b.Prompt, tt.wantPrompt)
			}
			if tt.wantChat != "" && (len(b.Messages) != 1 || b.Messages[0].Role != "user" || b.Messages[0].Content != tt.wantChat) {
				t.Errorf("messages = %+v, want one user message %q", b.Messages, tt.wantChat)
			}
			if b.Model != tt.wantModel || b.MaxTokens != 4 || b.MinTokens != 4 || !b.IgnoreEOS || !b.Stream ||
				b.StreamOptions == nil || !b.StreamOptions.IncludeUsage {
				t.Errorf("body = %+v", b)
			}
			// No usage: one content chunk (the role-only chunk doesn't
			// count), prompt length from the workload.
			r := out.Records[0]
			if r.Error != "" || r.OutputTokens != 1 || r.PromptTokens != 3 || r.CachedTokens != 0 {
				t.Errorf("record = %+v", r)
			}
		})
	}
}

// TestChunksSplitAcrossWrites sends each event in pieces, flushed apart, so
// that the client reads partial lines.
func TestChunksSplitAcrossWrites(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		startStream(w, "")
		var stream strings.Builder
		for i := range 3 {
			fmt.Fprintf(&stream, "data: %s\r\n\r\n", textChunk(fmt.Sprintf("x%d", i)))
		}
		fmt.Fprintf(&stream, ": keep-alive\n\ndata: %s\n\ndata: [DONE]\n\n", usageChunk(3, 3, 0))
		s := stream.String()
		for i := 0; i < len(s); i += 7 {
			io.WriteString(w, s[i:min(i+7, len(s))])
			w.(http.Flusher).Flush()
		}
	}))
	defer srv.Close()
	cfg := DefaultConfig()
	cfg.Target, cfg.Model = srv.URL, "m"
	out, err := Run(context.Background(), cfg, []workload.Request{{Tokens: tokens(3, 0), OutputTokens: 3}})
	if err != nil {
		t.Fatal(err)
	}
	r := out.Records[0]
	if r.Error != "" || r.OutputTokens != 3 || len(r.ITLMs) != 2 || r.PromptTokens != 3 {
		t.Errorf("record = %+v", r)
	}
}

// TestTTFTAfterDelayedFirstChunk holds the first content chunk until the
// test releases it, after a role-only chunk that must not count.
func TestTTFTAfterDelayedFirstChunk(t *testing.T) {
	const hold = 80 * time.Millisecond
	arrived, first, second := make(chan struct{}), make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		startStream(w, "")
		sse(w, `{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`)
		close(arrived)
		<-first
		sse(w, `{"choices":[{"index":0,"delta":{"content":"a"}}]}`)
		<-second
		sse(w, `{"choices":[{"index":0,"delta":{"content":"b"}}]}`)
		sse(w, "[DONE]")
	}))
	defer srv.Close()
	cfg := DefaultConfig()
	cfg.Target, cfg.Model, cfg.Mode = srv.URL, "m", ModeChat
	type result struct {
		out Output
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := Run(context.Background(), cfg, []workload.Request{{Tokens: tokens(3, 0), OutputTokens: 2}})
		done <- result{out, err}
	}()
	<-arrived
	time.Sleep(hold) // the server holds the first token this long
	close(first)
	time.Sleep(hold)
	close(second)
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	r := res.out.Records[0]
	if r.Error != "" {
		t.Fatal(r.Error)
	}
	holdMs := float64(hold / time.Millisecond)
	if r.TTFTMs < holdMs {
		t.Errorf("TTFT = %.1fms, want ≥ %.0fms (the role-only chunk must not count)", r.TTFTMs, holdMs)
	}
	if len(r.ITLMs) != 1 || r.ITLMs[0] < holdMs {
		t.Errorf("ITL = %v, want one gap ≥ %.0fms", r.ITLMs, holdMs)
	}
	if r.LatencyMs < r.TTFTMs+holdMs || r.OutputTokens != 2 {
		t.Errorf("latency %.1fms, ttft %.1fms, output %d", r.LatencyMs, r.TTFTMs, r.OutputTokens)
	}
}

func TestErrors(t *testing.T) {
	tests := []struct {
		name    string
		handler http.HandlerFunc
		want    string // substring of the record's error
	}{
		{
			name: "openai error json",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusBadRequest)
				io.WriteString(w, `{"error":{"message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}}`)
			},
			want: "http 400: This model's maximum context length is 4096 tokens.",
		},
		{
			name: "old vllm top-level error",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusServiceUnavailable)
				io.WriteString(w, `{"object":"error","message":"overloaded","type":"ServiceUnavailable","code":503}`)
			},
			want: "http 503: overloaded",
		},
		{
			name: "plain text error",
			handler: func(w http.ResponseWriter, r *http.Request) {
				http.Error(w, "no healthy replica", http.StatusBadGateway)
			},
			want: "http 502: no healthy replica",
		},
		{
			name: "empty error body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusTooManyRequests)
			},
			want: "http 429 Too Many Requests",
		},
		{
			name: "error chunk in stream",
			handler: func(w http.ResponseWriter, r *http.Request) {
				startStream(w, "")
				sse(w, textChunk("a"))
				sse(w, `{"error":{"message":"engine died","type":"InternalServerError","code":500}}`)
			},
			want: "stream error: engine died",
		},
		{
			name: "stream ends without done",
			handler: func(w http.ResponseWriter, r *http.Request) {
				startStream(w, "")
				sse(w, textChunk("a"))
				sse(w, textChunk("b"))
			},
			want: "stream ended before [DONE] after 2 content chunks",
		},
		{
			name: "connection cut mid-chunk",
			handler: func(w http.ResponseWriter, r *http.Request) {
				startStream(w, "")
				sse(w, textChunk("a"))
				io.WriteString(w, `data: {"choi`)
				w.(http.Flusher).Flush()
				conn, _, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Errorf("hijack: %v", err)
					return
				}
				conn.Close()
			},
			want: "stream ended before [DONE] after 1 content chunks",
		},
		{
			name: "bad json chunk",
			handler: func(w http.ResponseWriter, r *http.Request) {
				startStream(w, "")
				sse(w, `{"choices":[`)
			},
			want: "decode chunk 1",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			cfg := DefaultConfig()
			cfg.Target, cfg.Model = srv.URL, "m"
			out, err := Run(context.Background(), cfg, []workload.Request{{Tokens: tokens(4, 0), OutputTokens: 2}})
			if err != nil {
				t.Fatal(err)
			}
			r := out.Records[0]
			if !strings.Contains(r.Error, tt.want) {
				t.Errorf("error = %q, want it to contain %q", r.Error, tt.want)
			}
			if out.Result.Errors != 1 || out.Result.Completed != 0 {
				t.Errorf("result errors %d completed %d, want 1 0", out.Result.Errors, out.Result.Completed)
			}
		})
	}
}

func TestNonStreamingResponse(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"abc"}],"usage":{"prompt_tokens":4,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2}}}`)
	}))
	defer srv.Close()
	cfg := DefaultConfig()
	cfg.Target, cfg.Model = srv.URL, "m"
	out, err := Run(context.Background(), cfg, []workload.Request{{Tokens: tokens(4, 0), OutputTokens: 3}})
	if err != nil {
		t.Fatal(err)
	}
	r := out.Records[0]
	if r.Error != "" || r.OutputTokens != 3 || r.CachedTokens != 2 || r.TTFTMs <= 0 || r.TTFTMs != r.LatencyMs {
		t.Errorf("record = %+v", r)
	}
}

// blockingServer holds every request until release is closed or the client
// goes away, and reports each arrival on arrived.
type blockingServer struct {
	*httptest.Server
	arrived chan time.Time
	release chan struct{}
}

func newBlockingServer(t *testing.T, n int) *blockingServer {
	b := &blockingServer{arrived: make(chan time.Time, n), release: make(chan struct{})}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.arrived <- time.Now()
		startStream(w, "")
		select {
		case <-b.release:
		case <-r.Context().Done():
			return
		}
		sse(w, textChunk("a"))
		sse(w, "[DONE]")
	}))
	return b
}

// TestOpenLoop checks that requests leave at their arrival offsets even
// though no earlier request has finished.
func TestOpenLoop(t *testing.T) {
	const n = 4
	const gap = 60 * time.Millisecond
	srv := newBlockingServer(t, n)
	defer srv.Close()
	var reqs []workload.Request
	for i := range n {
		// Given out of order: Run sorts by arrival.
		reqs = append(reqs, workload.Request{ID: n - 1 - i, Arrival: time.Duration(n-1-i) * gap, Tokens: tokens(2, 0), OutputTokens: 1})
	}
	cfg := DefaultConfig()
	cfg.Target, cfg.Model = srv.URL, "m"
	done := make(chan Output, 1)
	start := time.Now()
	go func() {
		out, err := Run(context.Background(), cfg, reqs)
		if err != nil {
			t.Error(err)
		}
		done <- out
	}()
	var got []time.Duration
	for range n {
		got = append(got, (<-srv.arrived).Sub(start))
	}
	close(srv.release) // nothing finished before all n arrived
	out := <-done
	checkNoLeak(t)
	for i, d := range got {
		if want := time.Duration(i) * gap; d < want {
			t.Errorf("request %d arrived at %v, before its arrival %v", i, d, want)
		}
	}
	if len(out.Records) != n || out.Result.Delayed != 0 || out.Result.Errors != 0 {
		t.Fatalf("records %d, delayed %d, errors %d", len(out.Records), out.Result.Delayed, out.Result.Errors)
	}
	for i, r := range out.Records {
		if r.ID != i {
			t.Errorf("record %d has ID %d, want sending order", i, r.ID)
		}
		if lag := r.SentS - r.ArrivalS; lag < 0 || lag > gap.Seconds() {
			t.Errorf("request %d sent %.3fs after its arrival %.3fs", r.ID, lag, r.ArrivalS)
		}
	}
}

func TestMaxInFlight(t *testing.T) {
	// Each request is held until the test lets it go, one at a time: the
	// next request must not arrive while one is held, and it finds the
	// limit full (delayed) because the one before it is still held when
	// the sender, which moves on at once, tries to send it.
	arrived, gate := make(chan struct{}, 3), make(chan struct{}, 3)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		startStream(w, "")
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
		sse(w, textChunk("a"))
		sse(w, "[DONE]")
	}))
	defer srv.Close()
	reqs := slices.Repeat([]workload.Request{{Tokens: tokens(2, 0), OutputTokens: 1}}, 3)
	cfg := DefaultConfig()
	cfg.Target, cfg.Model, cfg.MaxInFlight = srv.URL, "m", 1
	done := make(chan Output, 1)
	go func() {
		out, err := Run(context.Background(), cfg, reqs)
		if err != nil {
			t.Error(err)
		}
		done <- out
	}()
	for i := range 3 {
		<-arrived
		select {
		case <-arrived:
			t.Fatalf("request %d was sent while request %d was held, past MaxInFlight 1", i+1, i)
		case <-time.After(50 * time.Millisecond):
		}
		gate <- struct{}{}
	}
	out := <-done
	if out.Result.Delayed != 2 || out.Result.Completed != 3 {
		t.Errorf("delayed %d completed %d, want 2 3", out.Result.Delayed, out.Result.Completed)
	}
}

func TestCancel(t *testing.T) {
	srv := newBlockingServer(t, 2)
	defer srv.Close()
	reqs := []workload.Request{
		{ID: 0, Tokens: tokens(2, 0), OutputTokens: 1},
		{ID: 1, Tokens: tokens(2, 0), OutputTokens: 1},
		{ID: 2, Arrival: time.Hour, Tokens: tokens(2, 0), OutputTokens: 1},
	}
	cfg := DefaultConfig()
	cfg.Target, cfg.Model = srv.URL, "m"
	var progress bytes.Buffer
	cfg.Progress, cfg.ProgressAlways = &syncWriter{w: &progress}, true
	ctx, cancel := context.WithCancel(context.Background())
	type result struct {
		out Output
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := Run(ctx, cfg, reqs)
		done <- result{out, err}
	}()
	<-srv.arrived
	<-srv.arrived
	cancel()
	var res result
	select {
	case res = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5s of cancellation")
	}
	checkNoLeak(t)
	if !errors.Is(res.err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", res.err)
	}
	if len(res.out.Records) != 2 || res.out.Result.Errors != 2 {
		t.Fatalf("records %d, errors %d, want the 2 sent, both failed", len(res.out.Records), res.out.Result.Errors)
	}
	for _, r := range res.out.Records {
		if !strings.Contains(r.Error, "context canceled") {
			t.Errorf("record %d error = %q", r.ID, r.Error)
		}
	}
	if !strings.Contains(progress.String(), "sent 2/3") {
		t.Errorf("final progress line missing: %q", progress.String())
	}
}

func TestMaxDuration(t *testing.T) {
	srv := httptest.NewServer(vllm(t, ""))
	defer srv.Close()
	reqs := []workload.Request{
		{ID: 0, Arrival: 0, Tokens: tokens(2, 0), OutputTokens: 1},
		{ID: 1, Arrival: 10 * time.Millisecond, Tokens: tokens(2, 0), OutputTokens: 1},
		{ID: 2, Arrival: time.Hour, Tokens: tokens(2, 0), OutputTokens: 1},
	}
	cfg := DefaultConfig()
	cfg.Target, cfg.MaxDuration = srv.URL, time.Second
	out, err := Run(context.Background(), cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Records) != 2 || out.Result.Completed != 2 {
		t.Errorf("records %d completed %d, want 2 2", len(out.Records), out.Result.Completed)
	}
}

func TestProgress(t *testing.T) {
	srv := httptest.NewServer(vllm(t, ""))
	defer srv.Close()
	reqs := []workload.Request{{Tokens: tokens(2, 0), OutputTokens: 2}, {Tokens: tokens(2, 0), OutputTokens: 2}}
	for _, always := range []bool{false, true} {
		var buf bytes.Buffer
		cfg := DefaultConfig()
		cfg.Target, cfg.Model = srv.URL, "m"
		cfg.Progress, cfg.ProgressAlways = &syncWriter{w: &buf}, always
		if _, err := Run(context.Background(), cfg, reqs); err != nil {
			t.Fatal(err)
		}
		if !always && buf.Len() != 0 {
			t.Errorf("progress written to a non-terminal without ProgressAlways: %q", buf.String())
		}
		if always && !strings.Contains(buf.String(), "sent 2/2  done 2  errors 0  in-flight 0") {
			t.Errorf("progress = %q", buf.String())
		}
	}
}

// syncWriter serialises writes to w.
type syncWriter struct {
	mu sync.Mutex // guards w
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

func TestValidate(t *testing.T) {
	ok := DefaultConfig()
	ok.Target = "http://x"
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	tests := []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no target", func(c *Config) { c.Target = "" }, "Target is required"},
		{"bad target", func(c *Config) { c.Target = "localhost:8000" }, "Target"},
		{"bad mode", func(c *Config) { c.Mode = "grpc" }, "Mode"},
		{"bad cap", func(c *Config) { c.MaxInFlight = 0 }, "MaxInFlight"},
		{"bad timeout", func(c *Config) { c.RequestTimeout = -1 }, "RequestTimeout"},
	}
	for _, tt := range tests {
		c := ok
		tt.edit(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Validate() = %v, want an error naming %s", tt.name, err, tt.want)
		}
	}
	if _, err := Run(context.Background(), Config{Target: "ftp://x"}, nil); err == nil {
		t.Error("Run with an invalid config: want an error")
	}
}

// TestAdapterModel: a request for a LoRA adapter carries the adapter as its
// model, in every mode; one for the base model carries the configured model.
func TestAdapterModel(t *testing.T) {
	for _, m := range []Mode{ModeCompletions, ModeText, ModeChat} {
		for _, tt := range []struct{ adapter, want string }{{"sql", "sql"}, {"", "base"}} {
			raw, err := body(m, "base", workload.Request{Tokens: []uint32{1}, OutputTokens: 1, Adapter: tt.adapter}, nil)
			if err != nil {
				t.Fatal(err)
			}
			var b sentBody
			if err := json.Unmarshal(raw, &b); err != nil || b.Model != tt.want {
				t.Errorf("%s, adapter %q: model %q (%v), want %q", m, tt.adapter, b.Model, err, tt.want)
			}
		}
	}
}

// TestTextHook: Config.Text renders the prompts of text and chat requests,
// and the result carries the mean prompt sizes (usage's and the
// workload's) and the error classes.
func TestTextHook(t *testing.T) {
	got := make(chan sentBody, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			http.NotFound(w, r)
			return
		}
		b := readBody(t, r)
		got <- b
		if len(b.Messages) > 0 {
			http.Error(w, `{"error":{"message":"too long: 12 tokens"}}`, http.StatusBadRequest)
			return
		}
		startStream(w, "")
		sse(w, `{"choices":[{"index":0,"text":"a"}]}`)
		sse(w, `{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}`)
		sse(w, "[DONE]")
	}))
	defer srv.Close()
	text := func(ids []uint32) string { return fmt.Sprintf("rendered %d", len(ids)) }
	for _, mode := range []Mode{ModeText, ModeChat} {
		cfg := DefaultConfig()
		cfg.Target, cfg.Mode, cfg.Model, cfg.Text = srv.URL, mode, "m", text
		out, err := Run(context.Background(), cfg, []workload.Request{{Tokens: []uint32{1, 2, 3}, OutputTokens: 1}})
		if err != nil {
			t.Fatal(err)
		}
		b := <-got
		switch mode {
		case ModeText:
			if string(b.Prompt) != `"rendered 3"` {
				t.Errorf("prompt = %s, want the hook's text", b.Prompt)
			}
			if out.Result.PromptTokensMean != 7 || out.Result.WorkloadPromptTokensMean != 3 || out.Result.ErrorClasses != nil {
				t.Errorf("means %v/%v, classes %v; want 7/3, none", out.Result.PromptTokensMean, out.Result.WorkloadPromptTokensMean, out.Result.ErrorClasses)
			}
		case ModeChat:
			if len(b.Messages) != 1 || b.Messages[0].Content != "rendered 3" {
				t.Errorf("messages = %+v, want the hook's text", b.Messages)
			}
			want := map[string]report.ErrorClassCount{"http 400: too long: N tokens": {Count: 1, Example: "http 400: too long: 12 tokens"}}
			if !maps.Equal(out.Result.ErrorClasses, want) || out.Result.WorkloadPromptTokensMean != 0 {
				t.Errorf("classes %v, workload mean %v; want %v, 0", out.Result.ErrorClasses, out.Result.WorkloadPromptTokensMean, want)
			}
		}
	}
}

// TestAwaitPrevious checks the closed loop within a conversation: a turn
// marked AwaitPrevious leaves only once its session's previous request has
// finished, while other sessions' requests leave at their arrivals; and
// that a dataset request's own text and messages are what is sent.
func TestAwaitPrevious(t *testing.T) {
	arrived := make(chan string, 8)
	var mu sync.Mutex
	release := map[string]chan struct{}{"s0": make(chan struct{}), "s1": make(chan struct{}), "t0": make(chan struct{})}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b := readBody(t, r)
		var name string
		if err := json.Unmarshal(b.Prompt, &name); err != nil {
			t.Errorf("prompt %s is not a string", b.Prompt)
		}
		arrived <- name
		mu.Lock()
		ch := release[name]
		mu.Unlock()
		startStream(w, "")
		select {
		case <-ch:
		case <-r.Context().Done():
			return
		}
		sse(w, textChunk("a"))
		sse(w, "[DONE]")
	}))
	defer srv.Close()
	reqs := []workload.Request{
		{Session: "s", Text: "s0", Tokens: tokens(2, 0), OutputTokens: 1},
		{Session: "t", Text: "t0", Tokens: tokens(2, 0), OutputTokens: 1, Arrival: 10 * time.Millisecond},
		{Session: "s", Text: "s1", Tokens: tokens(3, 0), OutputTokens: 1, AwaitPrevious: true, Arrival: 20 * time.Millisecond},
	}
	for i := range reqs {
		reqs[i].ID = i
	}
	cfg := DefaultConfig()
	cfg.Target, cfg.Model, cfg.Mode = srv.URL, "m", ModeText
	done := make(chan Output, 1)
	go func() {
		out, err := Run(context.Background(), cfg, reqs)
		if err != nil {
			t.Error(err)
		}
		done <- out
	}()
	got := []string{<-arrived, <-arrived}
	if !slices.Equal(got, []string{"s0", "t0"}) {
		t.Fatalf("first arrivals %v, want [s0 t0]", got)
	}
	close(release["t0"]) // another session's end does not let s1 go
	select {
	case name := <-arrived:
		t.Fatalf("%s arrived before s0 finished", name)
	case <-time.After(100 * time.Millisecond):
	}
	close(release["s0"])
	if name := <-arrived; name != "s1" {
		t.Fatalf("arrived %s, want s1", name)
	}
	close(release["s1"])
	out := <-done
	checkNoLeak(t)
	if len(out.Records) != 3 || out.Result.Errors != 0 {
		t.Fatalf("records %d, errors %d", len(out.Records), out.Result.Errors)
	}
	if r := out.Records[2]; r.ID != 2 || r.SentS < 0.1 {
		t.Errorf("s1: record %+v, want it sent after s0's end (≥ 0.1 s)", r)
	}
	if lag := out.Result.SendLag; lag == nil || lag.P99 > 50 {
		t.Errorf("send lag %+v ms: a turn's lag counts from its previous turn's end", lag)
	}

	// Chat mode sends the conversation's messages.
	r := workload.Request{Messages: []workload.Message{{Role: "user", Content: "a"}, {Role: "assistant", Content: "b"}, {Role: "user", Content: "c"}}, OutputTokens: 1}
	payload, err := body(ModeChat, "m", r, nil)
	if err != nil {
		t.Fatal(err)
	}
	var b sentBody
	if err := json.Unmarshal(payload, &b); err != nil {
		t.Fatal(err)
	}
	if want := []chatMessage{{"user", "a"}, {"assistant", "b"}, {"user", "c"}}; !slices.Equal(b.Messages, want) {
		t.Errorf("messages %v, want %v", b.Messages, want)
	}
}
