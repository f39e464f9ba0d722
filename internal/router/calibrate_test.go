package router

import (
	"fmt"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestProfilePoolsByValue: replicas told the same profile share its
// calibration pool even when each was given its own load of it (as serve
// does for backends that each name a profile in YAML), so what one replica
// teaches reaches a sibling that has served nothing; a replica told another
// profile learns nothing from it.
func TestProfilePoolsByValue(t *testing.T) {
	load := func(name string) costmodel.Profile {
		p, err := costmodel.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	c := calibrate.DefaultConfig()
	c.MaxRate = 0
	r, err := New(Config{BlockTokens: bt, Profile: load(costmodel.Llama31_8BH100), Policy: &policy.RoundRobin{}, Seed: 1, Calibrate: &c})
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range []string{costmodel.Llama31_8BA100, costmodel.Llama31_8BA100, costmodel.Llama31_8BH100} {
		r.AddReplica(fmt.Sprint("replica-", i), false)
		if err := r.SetProfile(i, load(name)); err != nil {
			t.Fatal(err)
		}
	}
	before := []time.Duration{r.PricedProfile(1).Prefill(1000, 1000), r.PricedProfile(2).Prefill(1000, 1000)}
	// Replica 0 alone serves, 3× slower than its profile says.
	for _, id := range []int{1, 2} {
		if err := r.SetUp(id, false, t0); err != nil {
			t.Fatal(err)
		}
	}
	truth := load(costmodel.Llama31_8BA100)
	now := t0
	for i := range 40 {
		q := req(uint64(i+1), toks(uint64(i+1), 512+16*i))
		d, err := r.Route(q, now)
		if err != nil || d.Replica != 0 {
			t.Fatalf("request %d: replica %d, %v; want replica 0", i, d.Replica, err)
		}
		now = now.Add(3 * truth.Prefill(q.PromptTokens, q.PromptTokens))
		if err := r.FirstToken(q.ID, now); err != nil {
			t.Fatal(err)
		}
		now = now.Add(time.Second)
		if err := r.Finished(q.ID, q.OutputTokens, 0, true, now); err != nil {
			t.Fatal(err)
		}
	}
	if fit, _, _ := r.Calibration(0); fit.PrefillSamples == 0 {
		t.Fatalf("replica 0 learnt nothing: %+v", fit)
	}
	sib := float64(r.PricedProfile(1).Prefill(1000, 1000)) / float64(before[0])
	other := float64(r.PricedProfile(2).Prefill(1000, 1000)) / float64(before[1])
	if sib < 2 {
		t.Errorf("replica 1 (its own load of replica 0's profile) prices a cold prefill at %.2f× its profile after replica 0 served 3× slower, want ≥ 2× (the pool's)", sib)
	}
	if other != 1 {
		t.Errorf("replica 2 (another profile) prices a cold prefill at %.2f× its profile, want 1 (not in replica 0's pool)", other)
	}
}

// TestFlightLoad: what Router.FlightLoad says a request adds to its
// replica is what the router itself counts for it, priced by the replica's
// calibrated model when calibrating; after its first token it owes no
// prefill; once finished it is unknown.
func TestFlightLoad(t *testing.T) {
	for _, cal := range []bool{false, true} {
		cfg := Config{BlockTokens: bt, Profile: profile(t), Policy: &policy.RoundRobin{}, Seed: 1}
		if cal {
			c := calibrate.DefaultConfig()
			cfg.Calibrate = &c
		}
		r, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		r.AddReplica("replica-0", false)
		q := req(1, toks(1, 800))
		if _, err := r.Route(q, t0); err != nil {
			t.Fatal(err)
		}
		rp, _ := r.Replica(0)
		got, ok := r.FlightLoad(1)
		want := ExternalLoad{InFlight: rp.InFlight, Prefilling: rp.Prefilling, PendingPrefill: rp.PendingPrefill,
			PendingPrefillTokens: rp.PendingPrefillTokens, DecodeTokens: rp.DecodeTokens}
		if !ok || got != want || got.PendingPrefill != r.PricedProfile(0).Prefill(800, 800) {
			t.Errorf("calibrate=%v: FlightLoad = %+v, %v; want the replica's counts %+v, prefill priced by %s", cal, got, ok, want, r.PricedProfile(0).Name())
		}
		if err := r.FirstToken(1, at(100)); err != nil {
			t.Fatal(err)
		}
		if got, _ := r.FlightLoad(1); got != (ExternalLoad{InFlight: 1, DecodeTokens: q.OutputTokens}) {
			t.Errorf("calibrate=%v: after the first token FlightLoad = %+v, want in flight with %d tokens to decode only", cal, got, q.OutputTokens)
		}
		if err := r.Finished(1, 10, -1, true, at(200)); err != nil {
			t.Fatal(err)
		}
		if _, ok := r.FlightLoad(1); ok {
			t.Errorf("calibrate=%v: FlightLoad of a finished request is ok", cal)
		}
	}
}
