package proxy

import (
	"fmt"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tokenize/benchtext"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// chat60kBody returns the messages of a ~58k-token Qwen3 conversation and
// a ~2k-token new user turn (benchtext.Chat60k).
func chat60kBody(b *testing.B, tok *tokenize.Tokenizer) (history []map[string]string, tail string) {
	history, tail, err := benchtext.Chat60k(tok)
	if err != nil {
		b.Skip("benchmark text:", err)
	}
	return history, tail
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
	cfg.Keyer = keying.NewTokenizerKeyer(tok, cfg.BlockTokens)
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
		req, err := openai.ParseRequest(openai.KindChat, js)
		if err != nil {
			b.Fatal(err)
		}
		t1, c1 := time.Now(), threadCPU()
		keys, tokens, err := p.pool.Keyer.Keys(req)
		if err != nil {
			b.Fatal(err)
		}
		t2, c2 := time.Now(), threadCPU()
		preq := policy.Request{ID: p.nextID.Add(1), Keys: keys, PromptTokens: tokens, OutputTokens: req.MaxTokens}
		d, _, _, err := p.route(preq, nil)
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
	js, err := benchtext.ChatJSON(history, last)
	if err != nil {
		b.Fatal(err)
	}
	return js
}
