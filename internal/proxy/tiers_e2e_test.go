package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/engine"
)

// kvOffloadTokens is each engine's CPU offload tier in the tier test: 96
// blocks, beside 64 on the GPU, so the load evicts from both.
const kvOffloadTokens = 1536

// TestCacheTiersEndToEnd: engines with a CPU offload tier (engine
// --cpu-offload-tokens) publish their CPU blocks over loopback ZeroMQ as
// vLLM's OffloadingConnector does (medium CPU, no token ids, no parent);
// serve's subscriber maps them through the GPU blocks' keys into the
// router's tier sets, which then hold exactly each engine's CPU tier: the
// number of blocks, and the offloaded prefix of every prompt sent —
// including prompts the GPU has evicted, which only the tier still holds.
func TestCacheTiersEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("real sockets and engines")
	}
	engines := startKVEngines(t, 2, func(c *engine.Config) { c.Replica.CPUOffloadTokens = kvOffloadTokens })
	p, srv, _ := startKVProxy(t, engines)
	samples := kvLoad(t, srv.URL, 120, 0)
	waitAgree(t, p, engines, samples, 20*time.Second)
	waitTiersAgree(t, p, engines, samples, 20*time.Second)

	tierOnly, stored, removed := 0, 0, 0
	for i, k := range engines {
		st := k.eng.Stats()
		if st.OffloadBlocks == 0 {
			t.Errorf("%s: no blocks offloaded", k.name)
		}
		stored += int(st.OffloadStoredBlocks)
		removed += int(st.OffloadEvictedBlocks)
		for _, pr := range samples {
			keys := blocks.Keys(nil, pr, 16)
			gpu, err := k.eng.CachedPrefix(context.Background(), keys)
			if err != nil {
				t.Fatal(err)
			}
			p.mu.Lock()
			cpu := p.rt.TierPrefix(i, keys)
			p.mu.Unlock()
			if cpu > gpu {
				tierOnly++
			}
		}
	}
	if tierOnly == 0 {
		t.Error("no prompt is held further in a CPU tier than on its GPU; the load should leave some")
	}
	if removed == 0 {
		t.Errorf("the CPU tiers evicted nothing (%d blocks stored); the load should evict", stored)
	}
	for _, r := range p.CacheView().Replicas {
		if r.Router == nil || r.Router.TierStored == 0 || r.Router.TierRemoved == 0 || r.RouterTierBlocks == 0 {
			t.Errorf("%s: CPU-tier events not applied (stored and removed): %+v", r.Replica, r.Router)
		}
	}
	t.Logf("%d (engine, prompt) pairs held further in the CPU tier than on the GPU; %d blocks stored, %d evicted", tierOnly, stored, removed)
}

// tiersAgree reports whether p's router tier sets hold exactly each
// engine's CPU tier: its block count and every sample prompt's offloaded
// prefix.
func tiersAgree(ctx context.Context, p *Proxy, engines []*kvEngine, samples [][]uint32) (bool, string) {
	for i, k := range engines {
		want := k.eng.Stats().OffloadBlocks
		p.mu.Lock()
		got := p.rt.TierBlocks(i)
		p.mu.Unlock()
		if got != want {
			return false, fmt.Sprintf("%s: router tier holds %d blocks, engine's CPU tier %d", k.name, got, want)
		}
		for _, pr := range samples {
			keys := blocks.Keys(nil, pr, 16)
			want, err := k.eng.OffloadedPrefix(ctx, keys)
			if err != nil {
				return false, err.Error()
			}
			p.mu.Lock()
			got := p.rt.TierPrefix(i, keys)
			p.mu.Unlock()
			if got != want {
				return false, fmt.Sprintf("%s: router tier holds %d blocks of a prompt, engine's CPU tier %d", k.name, got, want)
			}
		}
	}
	return true, ""
}

// waitTiersAgree polls tiersAgree until it holds or within passes.
func waitTiersAgree(t *testing.T, p *Proxy, engines []*kvEngine, samples [][]uint32, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, why := tiersAgree(ctx, p, engines, samples)
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("router tiers and engines' CPU tiers disagree after %v: %s", within, why)
		case <-tick.C:
		}
	}
}
