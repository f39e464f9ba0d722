package proxy

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// chat60kBody returns the messages of a ~58k-token Qwen3 conversation
// (LooGLE documents, from internal/tokenize's benchmark text) and a ~2k-token
// new user turn, as internal/tokenize's BenchmarkPrefixCacheChat60k builds
// them.
func chat60kBody(b *testing.B, tok *tokenize.Tokenizer) (history []map[string]string, tail string) {
	f, err := os.Open("../tokenize/testdata/bench_text.json.gz")
	if err != nil {
		b.Skip("benchmark text:", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		b.Fatal(err)
	}
	var d struct {
		ShareGPT []string `json:"sharegpt"`
		Loogle   []string `json:"loogle"`
	}
	if err := json.NewDecoder(zr).Decode(&d); err != nil {
		b.Fatal(err)
	}
	docText := strings.Join(d.Loogle, "\n\n") + "\n\n"
	if ids := tok.Encode(docText); len(ids) > 57000 {
		docText = strings.ToValidUTF8(tok.Decode(ids[:57000]), "")
	}
	history = []map[string]string{
		{"role": "system", "content": "You are a careful research assistant. Answer from the documents."},
		{"role": "user", "content": "Read these documents.\n\n" + docText},
		{"role": "assistant", "content": "I have read the documents. What would you like to know?"},
	}
	var t strings.Builder
	for _, p := range d.ShareGPT {
		if t.Len() > 8000 {
			break
		}
		t.WriteString(p)
		t.WriteString("\n")
	}
	return history, t.String()
}

// BenchmarkRouteChat60k is the router's work for a ~60k-token chat whose
// first ~58k tokens were routed before (issue 6's target: ≤ 2 ms): parse the
// 263 KB body, render the Qwen3 chat template and tokenize through the
// keyer's PrefixCache, key the ids, and route with e2 (router.Route under
// the proxy's lock); no HTTP. Every iteration's last user turn is new text.
// It reports ms/route (all of it) and its parts: parse-ms (ParseRequest),
// key-ms (the keyer: template, PrefixCache, block keys) and route-ms; the
// same in CPU time of the benchmark's thread (cpu-ms/route, ...: on a busy
// machine wall time also counts the waits for a core; GC work done by
// other threads is not in it); and the router's matched tokens.
//
//	go test -run '^$' -bench RouteChat60k -cpu 1 -benchtime 200x ./internal/proxy/
func BenchmarkRouteChat60k(b *testing.B) {
	tok := testTokenizer(b)
	history, tail := chat60kBody(b, tok)
	cfg := DefaultConfig()
	for i := range 4 {
		cfg.Backends = append(cfg.Backends, Backend{Name: fmt.Sprintf("r%d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 1+i)})
	}
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.Keyer = NewTokenizerKeyer(tok, cfg.BlockTokens)
	p, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	body := func(last string) []byte {
		return chat60kJSON(b, history, last)
	}
	// Wall and CPU time (of this goroutine's thread) of each phase.
	var parse, key, route, parseCPU, keyCPU, routeCPU time.Duration
	routeOnce := func(js []byte) (policy.Decision, int) {
		t0, c0 := time.Now(), threadCPU()
		req, err := ParseRequest(KindChat, js)
		if err != nil {
			b.Fatal(err)
		}
		t1, c1 := time.Now(), threadCPU()
		keys, tokens, err := p.keyer.Keys(req)
		if err != nil {
			b.Fatal(err)
		}
		t2, c2 := time.Now(), threadCPU()
		preq := policy.Request{ID: p.nextID.Add(1), Keys: keys, PromptTokens: tokens, OutputTokens: req.MaxTokens}
		d, err := p.route(preq, nil)
		if err != nil {
			b.Fatal(err)
		}
		t3, c3 := time.Now(), threadCPU()
		parse, parseCPU = parse+t1.Sub(t0), parseCPU+c1-c0
		key, keyCPU = key+t2.Sub(t1), keyCPU+c2-c1
		route, routeCPU = route+t3.Sub(t2), routeCPU+c3-c2
		p.finish(preq.ID, 100, 0, true)
		return d, tokens
	}
	runtime.LockOSThread() // for threadCPU
	defer runtime.UnlockOSThread()
	routeOnce(body("Request 0. Summarise the documents."))
	parse, key, route, parseCPU, keyCPU, routeCPU = 0, 0, 0, 0, 0, 0
	var bodies [][]byte
	var matched, tokens int
	n := 0
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		n++
		b.StopTimer()
		if len(bodies) == 0 {
			for k := range 64 { // built ahead, outside the timer
				bodies = append(bodies, body(fmt.Sprintf("Request %d. %s", n+k, tail)))
			}
		}
		js := bodies[0]
		bodies = bodies[1:]
		b.StartTimer()
		d, t := routeOnce(js)
		matched, tokens = d.MatchedTokens, t
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(n) }
	b.ReportMetric(ms(parse+key+route), "ms/route")
	b.ReportMetric(ms(parse), "parse-ms")
	b.ReportMetric(ms(key), "key-ms")
	b.ReportMetric(ms(route), "route-ms")
	b.ReportMetric(ms(parseCPU+keyCPU+routeCPU), "cpu-ms/route")
	b.ReportMetric(ms(parseCPU), "parse-cpu-ms")
	b.ReportMetric(ms(keyCPU), "key-cpu-ms")
	b.ReportMetric(ms(routeCPU), "route-cpu-ms")
	b.ReportMetric(float64(tokens), "tokens")
	b.ReportMetric(float64(matched), "matched")
}

// chat60kJSON is the body of a chat of history and a last user turn.
func chat60kJSON(b *testing.B, history []map[string]string, last string) []byte {
	msgs := append(history[:len(history):len(history)], map[string]string{"role": "user", "content": last})
	js, err := json.Marshal(map[string]any{"model": "m", "max_tokens": 100, "stream": true, "messages": msgs})
	if err != nil {
		b.Fatal(err)
	}
	return js
}

// BenchmarkParseChat60k is ParseRequest alone on the 263 KB body of
// BenchmarkRouteChat60k, against the encoding/json reference it replaced.
//
//	go test -run '^$' -bench ParseChat60k -cpu 1 ./internal/proxy/
func BenchmarkParseChat60k(b *testing.B) {
	tok := testTokenizer(b)
	history, tail := chat60kBody(b, tok)
	js := chat60kJSON(b, history, tail)
	for _, impl := range []struct {
		name  string
		parse func(Kind, []byte) (*Request, error)
	}{{"scan", ParseRequest}, {"encoding-json", refParseRequest}} {
		b.Run(impl.name, func(b *testing.B) {
			b.SetBytes(int64(len(js)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := impl.parse(KindChat, js); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
