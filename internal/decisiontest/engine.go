package decisiontest

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"sync"
)

// Engine is a fake inference replica for replays: it answers OpenAI
// completions and chats at once and deterministically, in vLLM's shapes
// (Kind "vllm": usage.prompt_tokens_details.cached_tokens) or llama.cpp's
// ("llamacpp": the timings object, /props with two slots, the Server
// header), and keeps a prefix cache with no bound, so the cached tokens it
// reports are what it saw before: token-id prompts in blocks of 16 tokens,
// text (a chat's messages joined) in chunks of 64 bytes of 16 tokens each,
// as the router's chunk keys count them. Its /metrics page gives a fixed
// load (Waiting, Running, KVUsage). With NoCache it reports no cached
// tokens at all.
type Engine struct {
	Kind             string // "vllm" (default) or "llamacpp"
	Waiting, Running int
	KVUsage          float64
	NoCache          bool
	mu               sync.Mutex
	seen             map[uint64]bool
	requests         int
}

// Requests returns the number of completions the engine answered.
func (e *Engine) Requests() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.requests
}

const (
	blockTokens = 16
	chunkBytes  = 4 * blockTokens
)

func (e *Engine) llama() bool { return e.Kind == "llamacpp" }

// ServeHTTP implements http.Handler.
func (e *Engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if e.llama() {
		w.Header().Set("Server", "llama.cpp")
	}
	switch {
	case r.URL.Path == "/health":
		io.WriteString(w, `{"status":"ok"}`)
	case r.URL.Path == "/metrics":
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		io.WriteString(w, e.metrics())
	case r.URL.Path == "/props" && e.llama():
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"total_slots":2,"model_path":"m.gguf","default_generation_settings":{"n_ctx":8192}}`)
	case r.URL.Path == "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		owner := "vllm"
		if e.llama() {
			owner = "llamacpp"
		}
		fmt.Fprintf(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":%q}]}`, owner)
	case r.Method == http.MethodPost && (r.URL.Path == "/v1/completions" || r.URL.Path == "/v1/chat/completions"):
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		status, h, out := e.Complete(r.URL.Path, body)
		for k, v := range h {
			w.Header()[k] = v
		}
		w.WriteHeader(status)
		_, _ = w.Write(out)
	default:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}`)
	}
}

func (e *Engine) metrics() string {
	if e.llama() {
		return fmt.Sprintf("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing %d\n"+
			"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred %d\n"+
			"# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio %g\n"+
			"# TYPE llamacpp:kv_cache_tokens gauge\nllamacpp:kv_cache_tokens %d\n",
			e.Running, e.Waiting, e.KVUsage, int(e.KVUsage*8192))
	}
	return fmt.Sprintf("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} %d\n"+
		"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} %d\n"+
		"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} %g\n",
		e.Running, e.Waiting, e.KVUsage)
}

// body is what the engine reads of a request.
type body struct {
	Prompt        json.RawMessage `json:"prompt"`
	Messages      []struct{ Role, Content string }
	Stream        bool `json:"stream"`
	MaxTokens     int  `json:"max_tokens"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// units are the prompt's cacheable blocks, hashed as a chain, and its
// length in tokens.
func units(b *body) (chain []uint64, tokens int) {
	h := fnv.New64a()
	var ids []uint32
	if len(b.Prompt) > 0 && json.Unmarshal(b.Prompt, &ids) == nil {
		var buf [4]byte
		for i := 0; i+blockTokens <= len(ids); i += blockTokens {
			for _, t := range ids[i : i+blockTokens] {
				binary.LittleEndian.PutUint32(buf[:], t)
				h.Write(buf[:])
			}
			chain = append(chain, h.Sum64())
		}
		return chain, len(ids)
	}
	var text string
	if len(b.Prompt) > 0 {
		_ = json.Unmarshal(b.Prompt, &text)
	}
	for _, m := range b.Messages {
		text += m.Role + "\x00" + m.Content + "\x00"
	}
	for i := 0; i+chunkBytes <= len(text); i += chunkBytes {
		h.Write([]byte(text[i : i+chunkBytes]))
		chain = append(chain, h.Sum64())
	}
	return chain, (len(text) + 3) / 4
}

// Complete answers one completion or chat request: status, headers, body.
func (e *Engine) Complete(path string, raw []byte) (int, http.Header, []byte) {
	h := http.Header{}
	if e.llama() {
		h.Set("Server", "llama.cpp")
	}
	var b body
	if err := json.Unmarshal(raw, &b); err != nil {
		h.Set("Content-Type", "application/json")
		return http.StatusBadRequest, h, []byte(`{"error":{"message":"bad json","type":"BadRequestError","code":400}}`)
	}
	chain, prompt := units(&b)
	e.mu.Lock()
	if e.seen == nil {
		e.seen = map[uint64]bool{}
	}
	hit := 0
	for hit < len(chain) && e.seen[chain[hit]] {
		hit++
	}
	for _, k := range chain {
		e.seen[k] = true
	}
	e.requests++
	e.mu.Unlock()
	cached := min(hit*blockTokens, prompt)
	n := max(b.MaxTokens, 1)
	chat := strings.HasSuffix(path, "/chat/completions")
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}`,
		prompt, prompt+n, n, cached)
	if e.NoCache || e.llama() {
		usage = fmt.Sprintf(`{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}`, prompt, prompt+n, n)
	}
	timings := ""
	if e.llama() && !e.NoCache {
		timings = fmt.Sprintf(`,"timings":{"prompt_n":%d,"prompt_ms":%d,"predicted_n":%d,"predicted_ms":%d}`,
			prompt-cached, 1+(prompt-cached)/100, n, 10*n)
	}
	if !b.Stream {
		h.Set("Content-Type", "application/json")
		var out string
		if chat {
			out = fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"length"}],"usage":%s%s}`,
				strings.Repeat("t", n), usage, timings)
		} else {
			out = fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":%q,"finish_reason":"length"}],"usage":%s%s}`,
				strings.Repeat("t", n), usage, timings)
		}
		return http.StatusOK, h, []byte(out)
	}
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	var w bytes.Buffer
	for i := range n {
		fin, tm := "null", ""
		if i == n-1 {
			fin = `"length"`
			if !b.StreamOptions.IncludeUsage {
				tm = timings
			}
		}
		if chat {
			fmt.Fprintf(&w, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":%s}]%s}`+"\n\n", i, fin, tm)
		} else {
			fmt.Fprintf(&w, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"t%d","finish_reason":%s}]%s}`+"\n\n", i, fin, tm)
		}
	}
	if b.StreamOptions.IncludeUsage {
		object := "text_completion"
		if chat {
			object = "chat.completion.chunk"
		}
		fmt.Fprintf(&w, `data: {"id":"cmpl-1","object":%q,"created":1,"model":"m","choices":[],"usage":%s%s}`+"\n\n", object, usage, timings)
	}
	w.WriteString("data: [DONE]\n\n")
	return http.StatusOK, h, w.Bytes()
}
