package router

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// matched is the number of leading blocks of keys cached on replica id.
func matched(r *Router, keys []blocks.Key, id int) int {
	n := 0
	for _, k := range keys {
		nd, _, ok := r.tree.Find(k)
		if !ok || !nd.Cached(id) {
			break
		}
		n++
	}
	return n
}

func TestSpeculativeEntries(t *testing.T) {
	tokens := toks(7, 8*bt)
	keys := blocks.Keys(nil, tokens, bt)
	route := func(t *testing.T, r *Router, id uint64, ms int) {
		t.Helper()
		d, err := r.Route(req(id, tokens), at(ms))
		if err != nil {
			t.Fatal(err)
		}
		if d.Replica != 0 {
			t.Fatalf("routed to %d, want 0", d.Replica)
		}
	}
	tests := []struct {
		name string
		// after routing at 0 ms, run this and then check at checkMS.
		events  func(t *testing.T, r *Router)
		checkMS int
		want    int // blocks cached on replica 0 at checkMS
		wantBlk int // CachedBlocks(0)
	}{
		{"visible at once", func(*testing.T, *Router) {}, 1, 8, 8},
		{"expires without an event", func(*testing.T, *Router) {}, 2000, 0, 0},
		{"kept when confirmed", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys, at(500)); err != nil {
				t.Fatal(err)
			}
		}, 5000, 8, 8},
		{"partly confirmed", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys[:3], at(500)); err != nil {
				t.Fatal(err)
			}
		}, 2000, 3, 3},
		{"removed after confirmation", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys, at(500)); err != nil {
				t.Fatal(err)
			}
			if err := r.CacheRemoved(0, keys[6:]); err != nil {
				t.Fatal(err)
			}
		}, 3000, 6, 6},
		{"removed while speculative", func(t *testing.T, r *Router) {
			if err := r.CacheRemoved(0, keys[4:]); err != nil {
				t.Fatal(err)
			}
		}, 1, 4, 4},
		{"cleared", func(t *testing.T, r *Router) {
			if err := r.CacheCleared(0); err != nil {
				t.Fatal(err)
			}
		}, 1, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true)
			route(t, r, 1, 0)
			if err := r.Finished(1, 10, -1, true, at(100)); err != nil {
				t.Fatal(err)
			}
			tt.events(t, r)
			r.ExpireSpeculative(at(tt.checkMS))
			if got := matched(r, keys, 0); got != tt.want {
				t.Errorf("matched blocks at %d ms = %d, want %d", tt.checkMS, got, tt.want)
			}
			if got := r.Tree().CachedBlocks(0); got != tt.wantBlk {
				t.Errorf("CachedBlocks = %d, want %d", got, tt.wantBlk)
			}
		})
	}
}

// TestSpeculativeRenewed: a second request for the prefix before the
// deadline extends it; the first deadline no longer unmarks it.
func TestSpeculativeRenewed(t *testing.T) {
	r := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true)
	tokens := toks(9, 4*bt)
	keys := blocks.Keys(nil, tokens, bt)
	for i, ms := range []int{0, 1500} {
		if _, err := r.Route(req(uint64(i+1), tokens), at(ms)); err != nil {
			t.Fatal(err)
		}
	}
	r.ExpireSpeculative(at(2500))
	if got := matched(r, keys, 0); got != 4 {
		t.Errorf("after the first deadline: matched %d, want 4", got)
	}
	r.ExpireSpeculative(at(3500))
	if got := matched(r, keys, 0); got != 0 {
		t.Errorf("after the second deadline: matched %d, want 0", got)
	}
	if got := r.Speculative(); got != 0 {
		t.Errorf("Speculative() = %d, want 0", got)
	}
}

// TestSpeculativeOff: a negative TTL marks nothing; mirrored replicas are
// not speculative.
func TestSpeculativeOff(t *testing.T) {
	r, err := New(Config{BlockTokens: bt, Profile: profile(t), Policy: &policy.RoundRobin{}, SpeculativeTTL: -1})
	if err != nil {
		t.Fatal(err)
	}
	r.AddReplica("a", true)
	tokens := toks(11, 4*bt)
	if _, err := r.Route(req(1, tokens), at(0)); err != nil {
		t.Fatal(err)
	}
	if got := r.Tree().CachedBlocks(0); got != 0 {
		t.Errorf("CachedBlocks = %d with speculation off, want 0", got)
	}
	m := newRouter(t, &policy.RoundRobin{}, 0, false)
	if _, err := m.Route(req(1, tokens), at(0)); err != nil {
		t.Fatal(err)
	}
	if got := m.Speculative(); got != 0 {
		t.Errorf("mirrored replica: Speculative() = %d, want 0", got)
	}
}

// TestNoSpeculationWithoutOptIn: a policy that does not implement
// policy.Speculator (round-robin; llm-d's precise scorer unless its
// speculative indexing is on) gets no speculative entries.
func TestNoSpeculationWithoutOptIn(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, true)
	a := req(1, toks(1, 64))
	if _, err := r.Route(a, at(0)); err != nil {
		t.Fatal(err)
	}
	if got := matched(r, a.Keys, 0); got != 0 {
		t.Fatalf("a policy without Speculator got %d speculative blocks, want 0", got)
	}
}
