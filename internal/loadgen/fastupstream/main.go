// Command fastupstream is a trivial, fast OpenAI-compatible SSE server for
// measuring what a front door (prefixlb serve, nginx) adds to a request:
// it reads the request body, and at once streams max_tokens vLLM-shaped
// completion chunks (one flush each, as vLLM does), a usage chunk and
// "data: [DONE]". No GPU time is modelled and no prompt is looked at beyond
// counting its token ids, so nearly all of a request's latency through a
// front door is the front door's.
//
//	go build -o fastupstream ./internal/loadgen/fastupstream
//	fastupstream --listen 127.0.0.1:18000,127.0.0.1:18010
//
// Each address is one "replica" (same process, same handler). It serves
// POST /v1/completions and /v1/chat/completions (streamed or not), GET
// /v1/models, /health and /metrics (vLLM's gauge names, all zero). POST
// /tokenize answers 404, so a router checking its tokenizer against the
// replica reads "cannot verify" and keeps token keys. It is a test helper
// for scripts/frontdoor-bench.sh, not part of prefixlb.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// maxChunks bounds the chunks of one response whatever max_tokens says.
const maxChunks = 4096

var (
	listen    = flag.String("listen", "127.0.0.1:18000", "addresses to serve on, comma-separated (one replica each)")
	model     = flag.String("model", "fast", "model name in /v1/models and responses")
	flushOnce = flag.Bool("flush-once", false, "write the whole stream with one flush instead of one flush per event")
	defTokens = flag.Int("default-max-tokens", 8, "chunks of a request without max_tokens")
)

// bufPool holds request-body buffers.
var bufPool = sync.Pool{New: func() any { return bytes.NewBuffer(make([]byte, 0, 64<<10)) }}

// events[i] is the SSE event of output token i of a completion, and
// chatEvents[i] of a chat completion; the last chunk of a response is
// rendered on the fly (its finish_reason differs).
var events, chatEvents [][]byte

func chunk(chat bool, i int, last bool) string {
	fin := "null"
	if last {
		fin = `"length"`
	}
	if chat {
		return fmt.Sprintf(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"content":" tok%d"},"logprobs":null,"finish_reason":%s}]}`+"\n\n", *model, i, fin)
	}
	return fmt.Sprintf(`data: {"id":"cmpl-1","object":"text_completion","created":1,"model":%q,"choices":[{"index":0,"text":" tok%d","logprobs":null,"finish_reason":%s,"stop_reason":null}]}`+"\n\n", *model, i, fin)
}

// scanInt returns the integer after key ("max_tokens":) in body, or def.
func scanInt(body []byte, key string, def int) int {
	i := bytes.Index(body, []byte(key))
	if i < 0 {
		return def
	}
	rest := bytes.TrimLeft(body[i+len(key):], " \t\r\n:")
	n := 0
	for n < len(rest) && rest[n] >= '0' && rest[n] <= '9' {
		n++
	}
	v, err := strconv.Atoi(string(rest[:n]))
	if err != nil {
		return def
	}
	return v
}

// promptTokens counts the token ids of a "prompt":[...] list, or estimates
// a text prompt at 4 bytes a token.
func promptTokens(body []byte) int {
	i := bytes.Index(body, []byte(`"prompt"`))
	if i < 0 {
		return len(body) / 4
	}
	rest := bytes.TrimLeft(body[i+len(`"prompt"`):], " \t\r\n:")
	if len(rest) == 0 || rest[0] != '[' {
		return len(body) / 4
	}
	end := bytes.IndexByte(rest, ']')
	if end < 0 {
		return 0
	}
	list := rest[1:end]
	if len(bytes.TrimSpace(list)) == 0 {
		return 0
	}
	return bytes.Count(list, []byte{','}) + 1
}

func complete(chat bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		buf := bufPool.Get().(*bytes.Buffer)
		defer bufPool.Put(buf)
		buf.Reset()
		if _, err := io.Copy(buf, r.Body); err != nil {
			return
		}
		body := buf.Bytes()
		n := min(max(scanInt(body, `"max_tokens"`, *defTokens), 1), maxChunks)
		pt := promptTokens(body)
		stream := bytes.Contains(body, []byte(`"stream":true`)) || bytes.Contains(body, []byte(`"stream": true`))
		usage := fmt.Sprintf(`"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":0}}`, pt, pt+n, n)
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			if chat {
				fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"tok"},"finish_reason":"length"}],%s}`, *model, usage)
			} else {
				fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","created":1,"model":%q,"choices":[{"index":0,"text":"tok","finish_reason":"length"}],%s}`, *model, usage)
			}
			return
		}
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		w.Header().Set("Cache-Control", "no-cache")
		fl := w.(http.Flusher)
		ev := events
		if chat {
			ev = chatEvents
		}
		write := func(b []byte) bool {
			if _, err := w.Write(b); err != nil {
				return false
			}
			if !*flushOnce {
				fl.Flush()
			}
			return true
		}
		for i := range n {
			var b []byte
			switch {
			case i == n-1:
				b = []byte(chunk(chat, i, true))
			case i < len(ev):
				b = ev[i]
			default:
				b = []byte(chunk(chat, i, false))
			}
			if !write(b) {
				return
			}
		}
		obj := "text_completion"
		if chat {
			obj = "chat.completion.chunk"
		}
		if !write([]byte(fmt.Sprintf(`data: {"id":"cmpl-1","object":%q,"created":1,"model":%q,"choices":[],%s}`+"\n\n", obj, *model, usage))) {
			return
		}
		write([]byte("data: [DONE]\n\n"))
		fl.Flush()
	}
}

func main() {
	flag.Parse()
	for i := range 256 {
		events = append(events, []byte(chunk(false, i, false)))
		chatEvents = append(chatEvents, []byte(chunk(true, i, false)))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", complete(false))
	mux.HandleFunc("POST /v1/chat/completions", complete(true))
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","created":1,"owned_by":"vllm","max_model_len":131072}]}`, *model)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\""+*model+"\"} 0\n"+
			"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\""+*model+"\"} 0\n"+
			"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\""+*model+"\"} 0\n")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })

	var servers []*http.Server
	for _, addr := range strings.Split(*listen, ",") {
		addr = strings.TrimSpace(addr)
		if addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			log.Fatalf("fastupstream: %v", err)
		}
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 5 * time.Minute}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
				log.Fatalf("fastupstream: %v", err)
			}
		}()
		fmt.Fprintf(os.Stderr, "fastupstream: serving on http://%s\n", ln.Addr())
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	<-sig
	for _, s := range servers {
		s.Close()
	}
}
