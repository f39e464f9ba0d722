package proxy

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/llamacpp"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// TestLiveLlamaServer runs the llama.cpp support against a real
// llama-server: the one at $PREFIXLB_TEST_LLAMA_URL (a model carrying
// Qwen3's tokenizer, --metrics --slots, -np 2 or more), else one it starts
// itself from $PREFIXLB_TEST_LLAMA_SERVER (internal/llamacpp.ForTest):
//
//	PREFIXLB_TEST_LLAMA_URL=http://127.0.0.1:8081 go test -run TestLiveLlamaServer ./internal/proxy/
//
// It checks the detection, the tokenizer probe in llama.cpp's shape, and
// that the cached tokens the router is told (from timings) match its
// prediction within one block on a repeated prompt, streamed and not. It
// is skipped when neither variable is set.
func TestLiveLlamaServer(t *testing.T) {
	base := os.Getenv("PREFIXLB_TEST_LLAMA_URL")
	if base == "" {
		bin, model, skip := llamacpp.ForTest()
		if skip != "" {
			t.Skip("PREFIXLB_TEST_LLAMA_URL unset, and " + skip)
		}
		o := llamacpp.Default(bin, model)
		o.Context = 8192
		srv, err := llamacpp.Start(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		base = srv.URL
	}
	ctx := context.Background()
	client := &http.Client{Timeout: 30 * time.Second}
	d, err := upstream.Detect(ctx, client, base, base+"/metrics", upstream.Auto)
	if err != nil || d.Kind != upstream.LlamaCpp || d.Slots < 1 {
		t.Fatalf("DetectBackend = %+v, %v; want llamacpp with its slots", d, err)
	}
	t.Logf("detected %+v", d)
	tok := testTokenizer(t)
	if state, err := keying.NewTokenizerCheck(tok).CompareKind(ctx, client, base, upstream.LlamaCpp); state != keying.TokenizerMatch {
		t.Errorf("tokenizer check: %v, %v (the model must carry Qwen3's tokenizer)", state, err)
	}
	if state, _ := keying.NewTokenizerCheck(tok).Compare(ctx, client, base); state != keying.TokenizerUnknown {
		t.Errorf("vLLM-shaped check against llama.cpp: %v, want unknown", state)
	}

	cfg := DefaultConfig()
	cfg.Backends = []Backend{{Name: "llama", URL: base}}
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	cfg.HealthInterval, cfg.ScrapeInterval = time.Hour, 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, srv := startProxy(t, cfg)
	startDetected(t, p, 1)
	ids := make([]string, 600)
	for i := range ids {
		ids[i] = strconv.Itoa(1000 + i*7)
	}
	prompt := "[" + strings.Join(ids, ",") + "]"
	for i, stream := range []bool{false, false, true} {
		body := fmt.Sprintf(`{"model":"m","prompt":%s,"max_tokens":2,"stream":%v}`, prompt, stream)
		resp := post(t, srv.URL, "/v1/completions", body)
		got := readAll(t, resp)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, got)
		}
		p.mu.Lock()
		v, _ := p.rt.CacheView(0)
		p.mu.Unlock()
		t.Logf("request %d (stream %v): %s; view %+v", i, stream, resp.Header.Get(HeaderRoute), v)
		if v.Checked != i+1 {
			t.Fatalf("request %d: %d checked, want %d", i, v.Checked, i+1)
		}
		if i > 0 && (v.LastErrorTokens > cfg.BlockTokens || v.LastErrorTokens < -cfg.BlockTokens) {
			t.Errorf("request %d: prediction off by %d tokens, want within a block", i, v.LastErrorTokens)
		}
	}
}
