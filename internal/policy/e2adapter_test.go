package policy_test

import (
	"math"
	"slices"
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// routeAdapter routes a request for adapter a through p (Route, Routed),
// mirrors its prompt into the chosen replica's cache and returns the
// decision.
func routeAdapter(t *testing.T, c *cluster, p *policy.E2, a string, tokens []uint32, s float64) policy.Decision {
	t.Helper()
	req, v := c.request(tokens, at(s))
	req.Adapter, req.Explain = a, true
	d, err := p.Route(req, v, at(s))
	if err != nil {
		t.Fatal(err)
	}
	p.Routed(req, &d, v, at(s))
	c.tree.SetPathCached(c.m.Path, d.Replica, at(s))
	return d
}

// TestE2AdapterPlacement: adapter b is placed on r1 (20 requests there),
// a on r0. A request for a whose prompt r1 caches would go to r1 on its
// cheaper prefill, loading a there and evicting b (r1's LRU idle slot);
// with placement that load is priced at b's 20 reloads (adapter_cascade =
// n_b·T_load, n_b decayed over the 3-minute window) and the request stays
// on r0, a's set. Without the term (weight 0) it goes to r1. The term is 0
// inside a's set and where the victim is not placed.
func TestE2AdapterPlacement(t *testing.T) {
	for _, tt := range []struct {
		name    string
		weight  float64
		want    int
		cascade bool
	}{
		{"placement", 1, 0, true},
		{"adapter_cascade_weight=0", 0, 1, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := loraCluster(t, []string{"a", "x"}, []string{"c", "b"})
			cfg := policy.DefaultE2Config()
			cfg.AdapterCascadeWeight = tt.weight
			p := mustE2(t, cfg)
			// Base-model work (counted from the first adapter's request
			// on): b and a need one replica each.
			routeAdapter(t, c, p, "c", toks(6, 64), -2)
			for i := range 40 {
				routeAdapter(t, c, p, "", toks(uint64(100+i), 64), -1+0.01*float64(i))
			}
			n := 0.0
			for i := range 20 {
				s := 0.1 * float64(i)
				if d := routeAdapter(t, c, p, "b", toks(7, 64), s); d.Replica != 1 {
					t.Fatalf("setup: b went to r%d, want its holder r1 (%s)", d.Replica, d.Explain())
				}
				n += math.Exp(-(3 - s) / policy.DefaultE2Config().Window.Seconds())
			}
			for i := range 5 {
				if d := routeAdapter(t, c, p, "a", toks(8, 64), 2+0.1*float64(i)); d.Replica != 0 {
					t.Fatalf("setup: a went to r%d, want its holder r0 (%s)", d.Replica, d.Explain())
				}
			}
			if got := p.AdapterSet("b"); !slices.Equal(got, []int{1}) {
				t.Fatalf("b's set %v, want [1]", got)
			}
			if got := p.AdapterSet("a"); !slices.Equal(got, []int{0}) {
				t.Fatalf("a's set %v, want [0]", got)
			}
			prompt := toks(9, 64)
			c.cache(prompt[:48], 1, at(2.9))
			d := routeAdapter(t, c, p, "a", prompt, 3)
			if d.Replica != tt.want {
				t.Errorf("chose r%d, want r%d (%s)", d.Replica, tt.want, d.Explain())
			}
			for _, cd := range d.Candidates {
				want := 0.0
				if tt.cascade && cd.Replica == 1 {
					want = n * loadSecs
				}
				if got := cd.Terms[policy.E2AdapterCascade]; math.Abs(got-want) > 1e-9 {
					t.Errorf("r%d: adapter_cascade %v, want %v", cd.Replica, got, want)
				}
				if got := cd.Terms[policy.E2AdapterCascade]; got != 0 && cd.Eviction < got {
					t.Errorf("r%d: M=%v does not include adapter_cascade %v", cd.Replica, cd.Eviction, got)
				}
			}
		})
	}
}

// TestE2AdapterCascadeVictim: the cascade is priced only when the evicted
// adapter is placed on the replica — not for a stray copy (its set is
// elsewhere), not where a slot is free, and not for the base model.
func TestE2AdapterCascadeVictim(t *testing.T) {
	c := loraCluster(t, []string{"b", "x"}, []string{"c", "y"}, []string{"d"})
	p := mustE2(t, policy.DefaultE2Config())
	routeAdapter(t, c, p, "c", toks(6, 64), -2)
	for i := range 40 {
		routeAdapter(t, c, p, "", toks(uint64(100+i), 64), -1+0.01*float64(i))
	}
	for i := range 10 {
		s := 0.1 * float64(i)
		routeAdapter(t, c, p, "x", toks(7, 64), s) // placed on r0, its holder
		routeAdapter(t, c, p, "y", toks(8, 64), s) // placed on r1
	}
	// r0 now holds x last-used and b idle: b is r0's LRU, never placed.
	c.reps[0].Adapters = []string{"x", "b"}
	c.reps[1].Adapters = []string{"c", "y"} // y, placed on r1, is its LRU
	for _, a := range []string{"a", ""} {
		req, v := c.request(toks(9, 64), at(2))
		req.Adapter, req.Explain = a, true
		d, err := p.Route(req, v, at(2))
		if err != nil {
			t.Fatal(err)
		}
		for _, cd := range d.Candidates {
			got := cd.Terms[policy.E2AdapterCascade]
			switch {
			case a == "" || cd.Replica != 1:
				if got != 0 {
					t.Errorf("adapter %q r%d: adapter_cascade %v, want 0", a, cd.Replica, got)
				}
			case got <= 9*loadSecs || got > 10*loadSecs:
				t.Errorf("r1: adapter_cascade %v, want ≈ 10 reloads of y (%v)", got, 10*loadSecs)
			}
		}
	}
}

// TestE2AdapterSetSize: an adapter that is all of the cluster's work is
// assigned every replica; once base-model work dwarfs it, its set shrinks
// to the replica its request went to.
func TestE2AdapterSetSize(t *testing.T) {
	c := loraCluster(t, nil, nil, nil, nil)
	p := mustE2(t, policy.DefaultE2Config())
	routeAdapter(t, c, p, "hot", toks(1, 64), 0)
	if got := p.AdapterSet("hot"); len(got) != 4 {
		t.Fatalf("hot's set %v after its only request, want all 4 replicas", got)
	}
	for i := range 100 {
		routeAdapter(t, c, p, "", toks(uint64(100+i), 64), 1+0.01*float64(i))
	}
	d := routeAdapter(t, c, p, "hot", toks(1, 64), 3)
	if got := p.AdapterSet("hot"); !slices.Equal(got, []int{d.Replica}) {
		t.Errorf("hot's set %v with ~1%% of the work, want [%d]", got, d.Replica)
	}
	if got := p.AdapterSet("never"); got != nil {
		t.Errorf("a never-routed adapter's set %v, want nil", got)
	}
}

// TestE2AdapterRouteAllocs: pricing adapter_cascade allocates nothing: a
// decision for an adapter's request on full slots allocates only its
// Candidates, as a base-model decision does.
func TestE2AdapterRouteAllocs(t *testing.T) {
	c := loraCluster(t, []string{"a", "x"}, []string{"c", "b"})
	p := mustE2(t, policy.DefaultE2Config())
	for i := range 10 {
		routeAdapter(t, c, p, "b", toks(7, 64), 0.1*float64(i))
	}
	req, v := c.request(toks(9, 64), at(2))
	req.Adapter = "y"
	if n := testing.AllocsPerRun(100, func() {
		if _, err := p.Route(req, v, at(2)); err != nil {
			t.Fatal(err)
		}
	}); n > 1 {
		t.Errorf("Route allocates %v times, want 1", n)
	}
}

// BenchmarkE2AdapterRouted: one decision and its Routed (placement
// included) for requests of 32 adapters on 8 replicas with 4 slots each.
func BenchmarkE2AdapterRouted(b *testing.B) {
	t := &testing.T{} // loraCluster fails only on a bad tree config, which this one is not
	held := make([][]string, 8)
	names := make([]string, 32)
	for i := range names {
		names[i] = "adapter-" + string(rune('A'+i))
	}
	for r := range held {
		held[r] = names[4*r : 4*r+4]
	}
	c := loraCluster(t, held...)
	for r := range c.reps {
		c.reps[r].MaxAdapters = 4
	}
	p, err := policy.NewE2(policy.DefaultE2Config())
	if err != nil {
		b.Fatal(err)
	}
	prompts := make([][]uint32, 32)
	for i := range prompts {
		prompts[i] = toks(uint64(i+1), 256)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		a := i % 32
		now := at(float64(i) * 0.01)
		req, v := c.request(prompts[a], now)
		req.Adapter = names[a]
		d, err := p.Route(req, v, now)
		if err != nil {
			b.Fatal(err)
		}
		p.Routed(req, &d, v, now)
		p.Finished(req.ID, d.Replica, 100, true, now)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "µs/decision")
}
