package router

import (
	"math"
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
	r, prof := newE2Router(t)
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
	// P weighs the load at 1 (only this request waits for the copy) and
	// the recompute at E2's prefill weight.
	if math.Abs(pb-load) > 1e-9*load || pb >= pa/3 {
		t.Errorf("P on the CPU tier %.4g s (load %.4g s), on the idle replica %.4g s: want the load, far below a recompute", pb, load, pa)
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

// TestTierCreditModes: the policies that read the tiers price a prompt a
// replica holds only in its CPU tier as each says: e2:tier_credit=none as
// a recompute (the same P as on an idle replica), e2-fixedtier as Dynamo's
// 0.75 credit (P of the quarter of the prompt left), and dynamo with its
// prefill blocks less 0.75 per host block. Half the prompt is in a disk
// tier on a third replica: Dynamo credits it at 0.25.
func TestTierCreditModes(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	tokens := make([]uint32, 4096)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := blocks.Keys(nil, tokens, 16)
	req := policy.Request{ID: 1, Keys: keys, PromptTokens: len(tokens), OutputTokens: 8, Explain: true}
	prefills := func(spec string) []float64 {
		t.Helper()
		pol, err := policy.Parse(spec, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		r, err := New(Config{BlockTokens: 16, Profile: prof, Policy: pol, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"a", "b", "c"} {
			r.AddReplica(n, true)
		}
		if err := r.CacheStoredTier(1, costmodel.MediumCPU, keys); err != nil {
			t.Fatal(err)
		}
		if err := r.CacheStoredTier(2, costmodel.MediumDisk, keys[:len(keys)/2]); err != nil {
			t.Fatal(err)
		}
		if h, o := r.tierSplit(2, &req, 0); h != 0 || o != len(tokens)/2 {
			t.Fatalf("tierSplit on the disk replica = %d, %d", h, o)
		}
		d, err := r.Predict(req, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		out := make([]float64, 3)
		for _, c := range d.Candidates {
			out[c.Replica] = c.Prefill
		}
		return out
	}
	none := prefills("e2:tier_credit=none")
	if math.Abs(none[1]-none[0]) > 1e-12 {
		t.Errorf("e2:tier_credit=none: P %.4g on the CPU replica, %.4g on the idle one; want equal", none[1], none[0])
	}
	fixed := prefills("e2-fixedtier")
	want := 3 * prof.Prefill(len(tokens)/4, len(tokens)).Seconds()
	if math.Abs(fixed[1]-want) > 1e-9 || fixed[0] != none[0] {
		t.Errorf("e2-fixedtier: P %.4g on the CPU replica, want 3·T_prefill(a quarter) = %.4g; idle %.4g vs %.4g", fixed[1], want, fixed[0], none[0])
	}
	dyn := prefills("dynamo")
	blocks := float64(len(keys))
	if dyn[0] != blocks || dyn[1] != blocks*0.25 || dyn[2] != blocks-0.25*blocks/2 {
		t.Errorf("dynamo prefill blocks %v, want %v, %v, %v", dyn, blocks, blocks*0.25, blocks-0.25*blocks/2)
	}
}

// TestTierPendingFlight: a request routed to a replica that holds its
// prompt in a CPU tier is counted in the replica's pending prefill as
// before, and the share of it the replica loads instead of computing in
// PendingTierPrefill/Tokens, until its first token; a request the replica
// must compute adds none.
func TestTierPendingFlight(t *testing.T) {
	r, prof := newE2Router(t)
	r.AddReplica("a", true)
	tokens := make([]uint32, 4096)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := blocks.Keys(nil, tokens, 16)
	// The tier holds all but the last 64 blocks.
	if err := r.CacheStoredTier(0, costmodel.MediumCPU, keys[:len(keys)-64]); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := r.Route(policy.Request{ID: 1, Keys: keys, PromptTokens: len(tokens), OutputTokens: 8}, now); err != nil {
		t.Fatal(err)
	}
	rp := r.reps[0]
	tier := len(tokens) - 64*16
	wantTier := prof.Prefill(len(tokens), len(tokens)) - prof.Prefill(64*16, len(tokens))
	if rp.PendingPrefillTokens != len(tokens) || rp.PendingPrefill != prof.Prefill(len(tokens), len(tokens)) {
		t.Errorf("pending %d tokens, %v; want the whole prompt, as before", rp.PendingPrefillTokens, rp.PendingPrefill)
	}
	if rp.PendingTierTokens != tier || rp.PendingTierPrefill != wantTier {
		t.Errorf("pending tier %d tokens, %v; want %d, %v", rp.PendingTierTokens, rp.PendingTierPrefill, tier, wantTier)
	}
	other := make([]uint32, 512)
	for i := range other {
		other[i] = uint32(1<<20 + i)
	}
	if _, err := r.Route(policy.Request{ID: 2, Keys: blocks.Keys(nil, other, 16), PromptTokens: len(other), OutputTokens: 8}, now); err != nil {
		t.Fatal(err)
	}
	if rp := r.reps[0]; rp.PendingTierTokens != tier || rp.PendingTierPrefill != wantTier {
		t.Errorf("a computed request changed the pending tier: %d tokens, %v", rp.PendingTierTokens, rp.PendingTierPrefill)
	}
	if err := r.FirstToken(1, now.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if rp := r.reps[0]; rp.PendingTierTokens != 0 || rp.PendingTierPrefill != 0 || rp.PendingPrefillTokens != len(other) {
		t.Errorf("after the first token: pending tier %d tokens, %v, pending %d tokens", rp.PendingTierTokens, rp.PendingTierPrefill, rp.PendingPrefillTokens)
	}
}

// TestTierLLMDPrecise: llmd-precise reads the tiers as llm-d's index and
// LongestPrefixScorer do, a CPU block at 0.8 of a GPU block: a prompt held
// whole in one replica's CPU tier (0.8 per block) beats 3/4 of it on
// another's GPU (0.75), and loses to 7/8 of it there (0.875). Without
// tiers the GPU replica would win both.
func TestTierLLMDPrecise(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	tokens := make([]uint32, 4096)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := blocks.Keys(nil, tokens, 16)
	for _, tc := range []struct {
		gpuBlocks, want int
	}{
		{len(keys) * 3 / 4, 0},
		{len(keys) * 7 / 8, 1},
	} {
		pol, err := policy.Parse("llmd-precise", policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		r, err := New(Config{BlockTokens: 16, Profile: prof, Policy: pol, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		r.AddReplica("cpu", true)
		r.AddReplica("gpu", true)
		now := time.Now()
		if err := r.CacheStoredTier(0, costmodel.MediumCPU, keys); err != nil {
			t.Fatal(err)
		}
		if err := r.CacheStored(1, 0, false, keys[:tc.gpuBlocks], now); err != nil {
			t.Fatal(err)
		}
		req := policy.Request{ID: 1, Keys: keys, PromptTokens: len(tokens) + 1, OutputTokens: 8}
		d, err := r.Predict(req, now)
		if err != nil {
			t.Fatal(err)
		}
		if d.Replica != tc.want {
			t.Errorf("%d of %d blocks on r1's GPU, all in r0's CPU tier: routed to r%d, want r%d (%s)",
				tc.gpuBlocks, len(keys), d.Replica, tc.want, d.Explain())
		}
	}
}

// newE2Router is a router, and its profile, running e2 over llama3.1-8b-h100 with 16-token
// blocks and no replicas yet.
func newE2Router(t *testing.T) (*Router, costmodel.Profile) {
	t.Helper()
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
	return r, prof
}
