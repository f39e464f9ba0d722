package router

import (
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestRolesHidePrefillReplicas: a policy that does not disaggregate never
// sees, and so never chooses, a prefill replica.
func TestRolesHidePrefillReplicas(t *testing.T) {
	for _, name := range []string{"round-robin", "least-load", "e2", "llmd-precise"} {
		pol, err := policy.New(name, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		r := newRouter(t, pol, 0, true, true, true)
		if err := r.SetRole(0, policy.RolePrefill); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 12; i++ {
			d, err := r.Route(req(uint64(i), toks(uint64(i%3), 200)), at(i))
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica == 0 {
				t.Fatalf("%s: request %d went to the prefill replica", name, i)
			}
		}
		if _, err := r.Predict(req(99, toks(1, 200)), at(20)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPDFlight follows a disaggregated request's load: its prefill on the
// prefill replica until PrefillDone, its transfer on both replicas' links
// until its first token, its decode on the decode replica until it ends.
func TestPDFlight(t *testing.T) {
	r := newRouter(t, &policy.RoundRobinPD{}, 0, false, false, false)
	for _, id := range []int{0, 1} {
		if err := r.SetRole(id, policy.RolePrefill); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.SetRole(2, policy.RoleDecode); err != nil {
		t.Fatal(err)
	}
	d, err := r.Route(req(1, toks(1, 320)), at(0))
	if err != nil {
		t.Fatal(err)
	}
	if !d.Disaggregated || d.PrefillReplica != 0 || d.Replica != 2 {
		t.Fatalf("decision %+v, want prefill 0, decode 2", d)
	}
	if !strings.Contains(d.Explain(), "prefill=r0") {
		t.Errorf("Explain %q names no prefill replica", d.Explain())
	}
	p, dec := r.reps[0], r.reps[2]
	if p.Prefilling != 1 || p.PendingPrefillTokens != 320 || p.PendingPrefill <= 0 || p.Transfers != 1 || p.DecodeTokens != 0 {
		t.Errorf("prefill replica %+v: want its prefill of 320 tokens and a transfer", p)
	}
	if dec.InFlight != 1 || dec.PendingPrefillTokens != 0 || dec.DecodeTokens != 10 || dec.Transfers != 1 {
		t.Errorf("decode replica %+v: want the decode, no prefill, a transfer", dec)
	}
	if got := r.tree.CachedBlocks(0); got != 20 {
		t.Errorf("the prefill replica's mirror holds %d blocks, want the prompt's 20", got)
	}
	if err := r.PrefillDone(1, at(100)); err != nil {
		t.Fatal(err)
	}
	if p := r.reps[0]; p.InFlight != 0 || p.Prefilling != 0 || p.PendingPrefill != 0 || p.PendingPrefillTokens != 0 || p.Transfers != 1 {
		t.Errorf("after PrefillDone, prefill replica %+v: want idle but for the transfer", p)
	}
	if err := r.FirstToken(1, at(150)); err != nil {
		t.Fatal(err)
	}
	if r.reps[0].Transfers != 0 || r.reps[2].Transfers != 0 || r.reps[2].Decoding != 1 {
		t.Errorf("after the first token: transfers %d and %d, decoding %d; want 0, 0, 1", r.reps[0].Transfers, r.reps[2].Transfers, r.reps[2].Decoding)
	}
	if err := r.Finished(1, 10, 0, true, at(300)); err != nil {
		t.Fatal(err)
	}
	for i, rp := range r.reps {
		if rp.InFlight != 0 || rp.Prefilling != 0 || rp.Decoding != 0 || rp.Transfers != 0 || rp.DecodeTokens != 0 {
			t.Errorf("replica %d after the finish: %+v", i, rp)
		}
	}
	// A failure before the prefill ends releases both legs.
	if _, err := r.Route(req(2, toks(2, 320)), at(400)); err != nil {
		t.Fatal(err)
	}
	if err := r.Finished(2, 0, -1, false, at(450)); err != nil {
		t.Fatal(err)
	}
	for i, rp := range r.reps {
		if rp.InFlight != 0 || rp.Prefilling != 0 || rp.Transfers != 0 || rp.PendingPrefill != 0 {
			t.Errorf("replica %d after a failure: %+v", i, rp)
		}
	}
}

// badPD disaggregates onto whatever it is told.
type badPD struct{ p, d int }

func (b badPD) Name() string        { return "bad-pd" }
func (b badPD) Disaggregates() bool { return true }
func (b badPD) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	return policy.Decision{Replica: b.d, Disaggregated: true, PrefillReplica: b.p}, nil
}

// TestPDRolesEnforced: the router refuses a decision that decodes on a
// prefill replica or prefills elsewhere than on one.
func TestPDRolesEnforced(t *testing.T) {
	for _, tc := range []struct{ p, d int }{{1, 0}, {2, 1}, {0, 0}, {5, 1}} {
		r := newRouter(t, badPD{tc.p, tc.d}, 0, true, true, true)
		if err := r.SetRole(0, policy.RolePrefill); err != nil {
			t.Fatal(err)
		}
		if _, err := r.Route(req(1, toks(1, 64)), at(0)); err == nil {
			t.Errorf("prefill %d decode %d: routed, want an error", tc.p, tc.d)
		}
		if r.InFlight() != 0 {
			t.Errorf("prefill %d decode %d: %d in flight after a refused decision", tc.p, tc.d, r.InFlight())
		}
	}
	r := newRouter(t, badPD{0, 1}, 0, true, true)
	if err := r.SetRole(0, policy.RolePrefill); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Route(req(1, toks(1, 64)), at(0)); err != nil {
		t.Errorf("a valid disaggregated decision: %v", err)
	}
}
