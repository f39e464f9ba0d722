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
