package proxy

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/llamacpp"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// TestLiveLlamaServerKVCapacity starts two real llama-servers of different
// contexts (-c 4096 and -c 8192, -np 2 each) from
// $PREFIXLB_TEST_LLAMA_SERVER (internal/llamacpp.ForTest) and checks that
// serve reads each one's KV capacity from its /props (one slot's n_ctx ×
// total_slots) with its source, in /debug/replicas and for the router. It
// is skipped when the variable is unset:
//
//	PREFIXLB_TEST_LLAMA_SERVER=/path/to/llama-server go test -run TestLiveLlamaServerKVCapacity ./internal/proxy/
func TestLiveLlamaServerKVCapacity(t *testing.T) {
	bin, model, skip := llamacpp.ForTest()
	if skip != "" {
		t.Skip(skip)
	}
	ctxs := []int{4096, 8192}
	var backends []Backend
	for i, c := range ctxs {
		o := llamacpp.Default(bin, model)
		o.Context, o.Slots = c, 2
		srv, err := llamacpp.Start(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		backends = append(backends, Backend{Name: []string{"small", "large"}[i], URL: srv.URL})
	}
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.HealthInterval, cfg.ScrapeInterval = time.Hour, 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, _ := startProxy(t, cfg)
	det := startDetected(t, p, 2)
	for i, r := range p.Replicas() {
		d := det[r.Name]
		if d.Kind != upstream.LlamaCpp || d.Slots != 2 || d.Capacity != (upstream.Capacity{Tokens: ctxs[i], Source: upstream.SourceLlamaCppProps}) {
			t.Errorf("%s: detected %+v, want llamacpp, 2 slots, %d tokens from /props", r.Name, d, ctxs[i])
		}
		if r.KVCapacityTokens != ctxs[i] || r.KVCapacitySource != upstream.SourceLlamaCppProps {
			t.Errorf("%s: /debug/replicas kv_capacity_tokens %d from %q, want %d from %s",
				r.Name, r.KVCapacityTokens, r.KVCapacitySource, ctxs[i], upstream.SourceLlamaCppProps)
		}
		p.mu.Lock()
		rp, _ := p.rt.Replica(i)
		p.mu.Unlock()
		if rp.KVCapacity != ctxs[i] {
			t.Errorf("%s: the policies see %d tokens, want %d", r.Name, rp.KVCapacity, ctxs[i])
		}
		t.Logf("%s: %d tokens from %s, %d slots", r.Name, r.KVCapacityTokens, r.KVCapacitySource, r.Slots)
	}
}
