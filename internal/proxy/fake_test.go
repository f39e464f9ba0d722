package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Modes of a fakeReplica.
const (
	modeOK      = "ok"      // answer like vLLM
	modeGarbage = "garbage" // non-stream: not JSON; stream: one good event, then garbage
	modeCut     = "cut"     // stream: one good event, then the connection closes
	modeStatus  = "status"  // 503 with a JSON error
	modeHold    = "hold"    // stream: one good event, then wait for release or cancel
	modeNoEvent = "noevent" // stream: headers, then the connection closes
)

// fakeReplica is an httptest server that speaks vLLM's OpenAI API: SSE in
// vLLM's format (deterministic, so direct and proxied bytes compare),
// /health, /metrics and /v1/models.
type fakeReplica struct {
	name    string
	srv     *httptest.Server
	model   string
	mode    atomic.Value // string
	healthy atomic.Bool
	cached  atomic.Int64 // cached_tokens reported in usage
	// noCached leaves prompt_tokens_details out of usage: an engine that
	// does not report its cache (the router then never corrects its
	// mirror from a report).
	noCached atomic.Bool
	served   atomic.Int64 // completion requests received
	metrics  string       // body of /metrics

	mu       sync.Mutex // guards held, release, canceled
	held     chan struct{}
	release  chan struct{}
	canceled chan struct{}
}

func newFakeReplica(t testing.TB, name string) *fakeReplica {
	t.Helper()
	f := &fakeReplica{name: name, model: "m-" + name}
	f.mode.Store(modeOK)
	f.healthy.Store(true)
	f.resetHold()
	f.metrics = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 2\n" +
		"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 1\n" +
		"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		if !f.healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		io.WriteString(w, f.metrics)
	})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"},{"id":"shared","object":"model"}]}`, f.model)
	})
	mux.HandleFunc("/v1/completions", f.complete)
	mux.HandleFunc("/v1/chat/completions", f.complete)
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	return f
}

// resetHold arms the hold channels for the next modeHold request.
func (f *fakeReplica) resetHold() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.held, f.release, f.canceled = make(chan struct{}), make(chan struct{}), make(chan struct{})
}

func (f *fakeReplica) holdChans() (held, release, canceled chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held, f.release, f.canceled
}

func (f *fakeReplica) backend() Backend { return Backend{Name: f.name, URL: f.srv.URL} }

// fakeBody is what the fake reads from a request.
type fakeBody struct {
	Prompt        json.RawMessage `json:"prompt"`
	Messages      json.RawMessage `json:"messages"`
	Stream        bool            `json:"stream"`
	MaxTokens     int             `json:"max_tokens"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

func (f *fakeReplica) complete(w http.ResponseWriter, r *http.Request) {
	f.served.Add(1)
	var b fakeBody
	if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
		http.Error(w, `{"error":{"message":"bad json","type":"BadRequestError","code":400}}`, http.StatusBadRequest)
		return
	}
	n := b.MaxTokens
	if n == 0 {
		n = 4
	}
	chat := b.Messages != nil
	mode := f.mode.Load().(string)
	if mode == modeStatus {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"error":{"message":"overloaded","type":"ServiceUnavailableError","code":503}}`)
		return
	}
	cached := int(f.cached.Load())
	usage := fmt.Sprintf(`{"prompt_tokens":100,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}`, 100+n, n, cached)
	if f.noCached.Load() {
		usage = fmt.Sprintf(`{"prompt_tokens":100,"total_tokens":%d,"completion_tokens":%d}`, 100+n, n)
	}
	if !b.Stream {
		w.Header().Set("Content-Type", "application/json")
		if mode == modeGarbage {
			io.WriteString(w, "<html>502 oops</html>")
			return
		}
		fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","created":1,"model":%q,"choices":[{"index":0,"text":"%s","finish_reason":"length"}],"usage":%s}`,
			f.model, strings.Repeat("t", n), usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	if mode == modeNoEvent {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		hijackClose(w)
		return
	}
	fl := w.(http.Flusher)
	chunk := func(i int, finish string) string {
		fin := "null"
		if finish != "" {
			fin = `"` + finish + `"`
		}
		if chat {
			return fmt.Sprintf(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"content":"t%d"},"logprobs":null,"finish_reason":%s}]}`+"\n\n", f.model, i, fin)
		}
		return fmt.Sprintf(`data: {"id":"cmpl-1","object":"text_completion","created":1,"model":%q,"choices":[{"index":0,"text":"t%d","logprobs":null,"finish_reason":%s,"stop_reason":null}]}`+"\n\n", f.model, i, fin)
	}
	if chat {
		fmt.Fprintf(w, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`+"\n\n", f.model)
	}
	io.WriteString(w, chunk(0, ""))
	fl.Flush()
	switch mode {
	case modeGarbage:
		io.WriteString(w, "data: }}this is not json\n\n")
		fl.Flush()
		return
	case modeCut:
		io.WriteString(w, "data: {\"partial")
		fl.Flush()
		hijackClose(w)
		return
	case modeHold:
		held, release, canceled := f.holdChans()
		close(held)
		select {
		case <-release:
		case <-r.Context().Done():
			close(canceled)
			return
		}
	}
	for i := 1; i < n; i++ {
		fin := ""
		if i == n-1 {
			fin = "length"
		}
		io.WriteString(w, chunk(i, fin))
		fl.Flush()
	}
	if b.StreamOptions.IncludeUsage {
		fmt.Fprintf(w, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":%q,"choices":[],"usage":%s}`+"\n\n", f.model, usage)
	}
	io.WriteString(w, "data: [DONE]\n\n")
	fl.Flush()
}

// hijackClose closes the connection under w without ending the chunked
// body: the client sees an unexpected EOF.
func hijackClose(w http.ResponseWriter) {
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	_ = buf.Flush()
	conn.Close()
}

// deadURL returns the URL of a loopback port nobody listens on.
func deadURL(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return "http://" + addr
}
