package router

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestTierPricing: a prompt a replica holds in its CPU tier costs its load,
// not a recompute: E2 routes it there over an idle replica that holds
// nothing, its P is the load (far below the other's recompute), and the
// blocks removed from the tier are a recompute again.
func TestTierPricing(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	pol, err := policy.Parse("e2", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{BlockTokens: 16, Profile: prof, Policy: pol, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	r.AddReplica("a", true)
	r.AddReplica("b", true)
	tokens := make([]uint32, 8192)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := blocks.Keys(nil, tokens, 16)
	if err := r.CacheStoredTier(1, costmodel.MediumCPU, keys); err != nil {
		t.Fatal(err)
	}
	req := policy.Request{ID: 1, Keys: keys, PromptTokens: len(tokens), OutputTokens: 8, Explain: true}
	d, err := r.Predict(req, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if d.Replica != 1 {
		t.Fatalf("routed to r%d, want r1, which holds the prompt in its CPU tier: %s", d.Replica, d.Explain())
	}
	var pa, pb float64
	for _, c := range d.Candidates {
		if c.Replica == 0 {
			pa = c.Prefill
		} else {
			pb = c.Prefill
		}
	}
	load := float64(len(tokens)) * costmodel.KVBytesOf(prof) / costmodel.DefaultCPUBandwidth
	// P weighs both at E2's prefill weight: their ratio is the load's to
	// the recompute's.
	if pb < load || pb >= pa/3 {
		t.Errorf("P on the CPU tier %.4g s (load %.4g s), on the idle replica %.4g s: want the weighted load, far below a recompute", pb, load, pa)
	}
	if err := r.CacheRemovedTier(1, costmodel.MediumCPU, keys[len(keys)/2:]); err != nil {
		t.Fatal(err)
	}
	if n, _ := r.tierHit(1, &req, 0); n != len(tokens)/2 {
		t.Errorf("after removing half: %d tier tokens, want %d", n, len(tokens)/2)
	}
	if err := r.CacheCleared(1); err != nil {
		t.Fatal(err)
	}
	if r.TierBlocks(1) != 0 {
		t.Error("AllBlocksCleared left tier blocks")
	}
}
