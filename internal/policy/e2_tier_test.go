package policy_test

import (
	"math"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestE2PendingTierCredit: the prefill queued on a replica whose requests
// load their prompts from a CPU tier is mostly not GPU time (the copies run
// beside the batches). Tier-aware e2 takes it out of the pending term and
// routes a cold prompt to that replica, whose GPU queue is 0.2 s, over one
// with 0.5 s of real prefill queued; e2-fixedtier and tier_credit=none keep
// pricing the whole queue (as they did) and pick the other.
func TestE2PendingTierCredit(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want int
		// wantPending is replica 0's pending term.
		wantPending float64
	}{
		{"e2", 0, 1.5 * 0.2},
		{"e2-fixedtier", 1, 1.5 * 2.0},
		{"e2:tier_credit=none", 1, 1.5 * 2.0},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			p, err := policy.Parse(tc.spec, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			c := newCluster(t, 2, 1_000_000)
			// Replica 0: 2 s of prefill routed, 1.8 s of it the recompute
			// of tokens it loads from its CPU tier; replica 1: 0.5 s.
			c.reps[0].InFlight, c.reps[0].Prefilling = 2, 2
			c.reps[0].PendingPrefill, c.reps[0].PendingPrefillTokens = 2*time.Second, 2000
			c.reps[0].PendingTierPrefill, c.reps[0].PendingTierTokens = 1800*time.Millisecond, 1800
			c.reps[1].InFlight, c.reps[1].Prefilling = 1, 1
			c.reps[1].PendingPrefill, c.reps[1].PendingPrefillTokens = 500*time.Millisecond, 500
			req, v := c.request(toks(1, 1000), at(0))
			req.Explain = true
			d, err := p.Route(req, v, at(0))
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica != tc.want {
				t.Errorf("routed to r%d, want r%d: %s", d.Replica, tc.want, d.Explain())
			}
			for _, cd := range d.Candidates {
				if cd.Replica == 0 && math.Abs(cd.Terms[policy.E2Pending]-tc.wantPending) > 1e-9 {
					t.Errorf("r0's pending term %.4g, want %.4g", cd.Terms[policy.E2Pending], tc.wantPending)
				}
			}
		})
	}
}

// TestE2HistoryTierLoad: a request routed to a replica that loads its
// prompt from a CPU tier adds to that replica's windowed prefill (H, and
// the prefill rate ρ built on it) only the prefill of the tokens it
// computes, under tier-aware e2; e2-fixedtier counts the whole miss, as it
// did. H is read through the history term of a second request.
func TestE2HistoryTierLoad(t *testing.T) {
	prompt := toks(2, 4096)
	for _, tc := range []struct {
		spec string
		want float64 // r0's history term for the second request
	}{
		// 16 tokens are left to compute: the last block (the hit's cap is
		// the tier walk's, here the prompt's whole 256 blocks less one).
		{"e2:history_weight=1", 16e-3},
		{"e2:tier_credit=fixed:history_weight=1", 4096e-3},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			p, err := policy.Parse(tc.spec, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			c := newCluster(t, 2, 1_000_000)
			req, v := c.request(prompt, at(0))
			// Replica 0 holds all but the prompt's last block in its CPU tier.
			tier := func(r int, q *policy.Request, gpu int) (int, float64) {
				if r != 0 || q.ID != req.ID {
					return 0, 0
				}
				n := q.PromptTokens - gpu - bt
				return n, float64(n) * 1e-6
			}
			split := func(r int, q *policy.Request, gpu int) (int, int) {
				n, _ := tier(r, q, gpu)
				return n, 0
			}
			v.TierHit, v.TierSplit = tier, split
			d, err := p.Route(req, v, at(0))
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica != 0 {
				t.Fatalf("routed to r%d, want r0, which holds the prompt in its CPU tier: %s", d.Replica, d.Explain())
			}
			p.(policy.Observer).Routed(req, &d, v, at(0))
			req2, v2 := c.request(toks(3, 100), at(0.001))
			req2.Explain = true
			d2, err := p.Route(req2, v2, at(0.001))
			if err != nil {
				t.Fatal(err)
			}
			for _, cd := range d2.Candidates {
				if cd.Replica == 0 && math.Abs(cd.Terms[policy.E2History]-tc.want) > 1e-9 {
					t.Errorf("r0's history term %.6g s, want %.6g s", cd.Terms[policy.E2History], tc.want)
				}
			}
		})
	}
}
