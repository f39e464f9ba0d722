package policy_test

import (
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestE2EvictionPerReplicaCapacity: E2's M prices eviction on each
// replica's own KV capacity (the engine's figure, Replica.KVCapacity) and
// falls back on the profile's; what the engine says its running requests
// hold (KVUsage) is a floor on what it caches. The setting is
// TestE2ExploreArgminCost's: the victim (150 blocks, hot) is on replica 3,
// and the 1600-token request misses 100 blocks there.
func TestE2EvictionPerReplicaCapacity(t *testing.T) {
	prompt := toks(10, 1600)
	victim := toks(11, 2400)
	for _, tt := range []struct {
		name     string
		capacity int     // replica 3's engine figure (0: unknown)
		usage    float64 // replica 3's KV usage (-1: unknown)
		wantM    float64
	}{
		{"profile fallback: the cache never fills", 0, -1, 0},
		{"engine says 200 blocks: the victim goes", 3200, -1, 4.8},
		{"engine says 250 blocks: room for the miss", 4000, -1, 0},
		{"250 blocks, 90% held by running requests", 4000, 0.9, 4.8},
		{"250 blocks, 50% held: the tree's 150 blocks are more", 4000, 0.5, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 4, bigKV)
			p := mustE2(t, isolated(paperCost()))
			c.cache(victim, 3, at(0))
			for i := 0; i < 2; i++ {
				req, v := c.request(victim, at(0))
				p.Routed(req, &policy.Decision{Replica: 3}, v, at(0))
			}
			c.reps[3].KVCapacity, c.reps[3].KVUsage = tt.capacity, tt.usage
			req, v := c.request(prompt, at(1))
			if got := v.KVCapacityOf(3); tt.capacity > 0 && got != tt.capacity {
				t.Errorf("KVCapacityOf(3) = %d, want %d", got, tt.capacity)
			}
			if got := v.KVCapacityOf(0); got != bigKV {
				t.Errorf("KVCapacityOf(0) = %d, want the profile's %d", got, bigKV)
			}
			d, err := p.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			for _, cd := range d.Candidates {
				want := 0.0
				if cd.Replica == 3 {
					want = tt.wantM
				}
				if math.Abs(cd.Eviction-want) > 1e-9 {
					t.Errorf("replica %d: M = %.6f, want %.6f (%s)", cd.Replica, cd.Eviction, want, d.Explain())
				}
			}
		})
	}
}

// TestLLMDApproxCapacityFromEngine: llm-d's approximate index sizes each
// replica's LRU at the engine's capacity when it is known (GIE reads
// vllm:cache_config_info's num_gpu_blocks), in a pool of two cache sizes.
func TestLLMDApproxCapacityFromEngine(t *testing.T) {
	a, b := toks(1, 4*bt), toks(2, 4*bt) // 4 blocks each
	c := newCluster(t, 2, 100*bt)        // the profile: 100 blocks
	c.reps[0].KVCapacity = 6 * bt        // the engine: 6 blocks
	p := approx(t, 0)
	for _, prompt := range [][]uint32{a, b} {
		recordAt(t, p, c, prompt, 0, nil)
		recordAt(t, p, c, prompt, 1, nil)
	}
	// 8 blocks into replica 0's 6: a's first two went out; replica 1 (the
	// profile's 100 blocks) holds all of a.
	if got := approxMatched(t, p, c, a, nil); got[0] != 2 || got[1] != 4 {
		t.Errorf("a credited %v blocks, want [2 4]", got)
	}
}
