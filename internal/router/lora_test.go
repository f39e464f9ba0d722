package router

import (
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// adapterSpy records the adapter of each request and the replicas'
// adapter residency it was shown, and picks replica 0.
type adapterSpy struct {
	adapters []string
	shown    [][]string
	max      []int
}

func (s *adapterSpy) Name() string { return "adapter-spy" }
func (s *adapterSpy) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	s.adapters = append(s.adapters, req.Adapter)
	for _, rp := range v.Replicas {
		s.shown = append(s.shown, rp.Adapters)
		s.max = append(s.max, rp.MaxAdapters)
	}
	return policy.Decision{Replica: 0}, nil
}

// TestAdapters: Route passes the request's adapter through, and the
// residency SetAdapters records (a copy) is what the policy sees.
func TestAdapters(t *testing.T) {
	spy := &adapterSpy{}
	r := newRouter(t, spy, 0, false, false)
	loaded := []string{"a", "b"}
	if err := r.SetAdapters(1, loaded, 4); err != nil {
		t.Fatal(err)
	}
	loaded[0] = "changed"
	if err := r.SetAdapters(7, nil, 1); err == nil {
		t.Error("SetAdapters(unknown replica): no error")
	}
	if err := r.SetAdapters(0, nil, -1); err == nil {
		t.Error("SetAdapters(max -1): no error")
	}
	if err := r.SetAdapterBytes(1, 84e6); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Route(policy.Request{ID: 1, PromptTokens: 10, Adapter: "a"}, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(spy.adapters, []string{"a"}) {
		t.Errorf("policy saw adapters %q, want [a]", spy.adapters)
	}
	if len(spy.shown) != 2 || spy.shown[0] != nil || !slices.Equal(spy.shown[1], []string{"a", "b"}) || spy.max[1] != 4 {
		t.Errorf("policy saw residency %q (max %v), want [] and [a b] (max 4)", spy.shown, spy.max)
	}
	if rp, _ := r.Replica(1); rp.AdapterBytes != 84e6 {
		t.Errorf("AdapterBytes = %d, want 84e6", rp.AdapterBytes)
	}
}

// TestAdapterFlights: the router counts its in-flight requests per replica
// and adapter (not the base model's) from routing to finish, the running
// and waiting adapters SetRunningAdapters records (copies) reach the
// policy, and a snapshot does not change under later routing.
func TestAdapterFlights(t *testing.T) {
	spy := &adapterSpy{}
	r := newRouter(t, spy, 0, false, false)
	running, waiting := []string{"a"}, []string{"b"}
	if err := r.SetRunningAdapters(0, running, waiting); err != nil {
		t.Fatal(err)
	}
	running[0], waiting[0] = "changed", "changed"
	if err := r.SetRunningAdapters(2, nil, nil); err == nil {
		t.Error("SetRunningAdapters(unknown replica): no error")
	}
	now := time.Unix(0, 0)
	for i, a := range []string{"a", "a", "b", ""} {
		if _, err := r.Route(policy.Request{ID: uint64(i + 1), PromptTokens: 10, OutputTokens: 100 * (i + 1), Adapter: a}, now); err != nil {
			t.Fatal(err)
		}
	}
	snap, _ := r.Replica(0)
	want := []policy.AdapterFlight{{Adapter: "a", InFlight: 2, DecodeTokens: 300}, {Adapter: "b", InFlight: 1, DecodeTokens: 300}}
	if !slices.Equal(snap.AdapterFlights, want) {
		t.Errorf("AdapterFlights = %+v, want %+v", snap.AdapterFlights, want)
	}
	if !slices.Equal(snap.RunningAdapters, []string{"a"}) || !slices.Equal(snap.WaitingAdapters, []string{"b"}) {
		t.Errorf("running %q waiting %q, want [a] [b]", snap.RunningAdapters, snap.WaitingAdapters)
	}
	for _, id := range []uint64{1, 3, 4} {
		if err := r.Finished(id, 10, -1, true, now); err != nil {
			t.Fatal(err)
		}
	}
	got, _ := r.Replica(0)
	if want := []policy.AdapterFlight{{Adapter: "a", InFlight: 1, DecodeTokens: 200}}; !slices.Equal(got.AdapterFlights, want) {
		t.Errorf("after finishes: AdapterFlights = %+v, want %+v", got.AdapterFlights, want)
	}
	if len(snap.AdapterFlights) != 2 || snap.AdapterFlights[0].InFlight != 2 {
		t.Errorf("the earlier snapshot changed: %+v", snap.AdapterFlights)
	}
	if err := r.Finished(2, 10, -1, false, now); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.Replica(0); len(got.AdapterFlights) != 0 {
		t.Errorf("nothing in flight: AdapterFlights = %+v", got.AdapterFlights)
	}
}
