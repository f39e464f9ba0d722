package policy_test

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestE2RouteAllocs: pricing a replica allocates nothing, whatever its load
// (decoding requests, a queue, a slot cache): a decision allocates only the
// Candidates it returns, and their terms when asked (Request.Explain).
func TestE2RouteAllocs(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []string{"e2", "e2-preble", "e2:decode_weight=1:history_weight=1"} {
		p, err := policy.Parse(spec, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		c := newCluster(t, 4, bigKV)
		c.prof = prof
		for r := range c.reps {
			rp := &c.reps[r]
			rp.InFlight, rp.Decoding, rp.Prefilling = 6, 4, 2
			rp.DecodeTokens, rp.DecodeContextTokens = 400, 4*3000
			rp.PendingPrefill = time.Duration(r+1) * 20 * time.Millisecond
		}
		c.reps[3].Slots = 2
		c.route(p, toks(1, 512), at(0))
		req, v := c.request(toks(1, 512), at(1))
		for _, explain := range []bool{false, true} {
			req.Explain = explain
			want := 1.0
			if explain {
				want = 2
			}
			n := testing.AllocsPerRun(100, func() {
				if _, err := p.Route(req, v, at(1)); err != nil {
					t.Fatal(err)
				}
			})
			if n > want {
				t.Errorf("%s (explain %v): Route allocates %v times, want %v", spec, explain, n, want)
			}
		}
	}
}
