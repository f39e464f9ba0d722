package proxy

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
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
// 240 KB body, render the Qwen3 chat template and tokenize through the
// keyer's PrefixCache, key the ids, and route with e2 (router.Route under
// the proxy's lock); no HTTP. Every iteration's last user turn is new text.
// It reports ms/op (all of it), key+route-ms/op (without parsing the JSON
// body) and the router's matched tokens.
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
		msgs := append(history[:len(history):len(history)], map[string]string{"role": "user", "content": last})
		js, err := json.Marshal(map[string]any{"model": "m", "max_tokens": 100, "stream": true, "messages": msgs})
		if err != nil {
			b.Fatal(err)
		}
		return js
	}
	var parse time.Duration
	routeOnce := func(js []byte) (policy.Decision, int) {
		start := time.Now()
		req, err := ParseRequest(KindChat, js)
		if err != nil {
			b.Fatal(err)
		}
		parse += time.Since(start)
		keys, tokens, err := p.keyer.Keys(req)
		if err != nil {
			b.Fatal(err)
		}
		preq := policy.Request{ID: p.nextID.Add(1), Keys: keys, PromptTokens: tokens, OutputTokens: req.MaxTokens}
		d, err := p.route(preq, nil)
		if err != nil {
			b.Fatal(err)
		}
		p.finish(preq.ID, 100, 0, true)
		return d, tokens
	}
	routeOnce(body("Request 0. Summarise the documents."))
	parse = 0
	var bodies [][]byte
	var matched, tokens int
	var elapsed time.Duration
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
		start := time.Now()
		d, t := routeOnce(js)
		elapsed += time.Since(start)
		matched, tokens = d.MatchedTokens, t
	}
	b.ReportMetric(float64(elapsed.Microseconds())/1000/float64(n), "ms/op")
	b.ReportMetric(float64((elapsed-parse).Microseconds())/1000/float64(n), "key+route-ms/op")
	b.ReportMetric(float64(tokens), "tokens")
	b.ReportMetric(float64(matched), "matched")
}
