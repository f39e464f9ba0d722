package policy_test

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// loadSecs is the default adapter load of 84 MB: 84e6/25e9 s + 20 ms.
var loadSecs = costmodel.DefaultAdapterLoad.Time(84e6).Seconds()

func loraCluster(t *testing.T, adapters ...[]string) *cluster {
	c := newCluster(t, len(adapters), 100_000)
	for i, a := range adapters {
		c.reps[i].Adapters, c.reps[i].MaxAdapters, c.reps[i].AdapterBytes = a, 2, 84e6
	}
	return c
}

func explainE2(t *testing.T, c *cluster, adapter string) policy.Decision {
	t.Helper()
	p := mustE2(t, policy.DefaultE2Config())
	req, v := c.request(toks(1, 300), t0)
	req.Adapter, req.Explain = adapter, true
	d, err := p.Route(req, v, t0)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestE2AdapterTerms: with equal loads and caches, e2 prefers the replica
// that holds the adapter; P adds the load time where it is missing, and M
// one reload more where the slots are full; the base model prices neither.
func TestE2AdapterTerms(t *testing.T) {
	for _, tt := range []struct {
		name     string
		adapters [][]string
		adapter  string
		want     int
		load     []float64 // adapter_load per replica, seconds
		evict    []float64 // adapter_eviction per replica, seconds
	}{
		{"holder wins the tie", [][]string{nil, {"a"}}, "a", 1, []float64{loadSecs, 0}, []float64{0, 0}},
		{"full slots cost an eviction", [][]string{{"b", "c"}, {"d"}}, "a", 1, []float64{loadSecs, loadSecs}, []float64{loadSecs, 0}},
		{"base model", [][]string{{"b", "c"}, nil}, "", 0, []float64{0, 0}, []float64{0, 0}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := explainE2(t, loraCluster(t, tt.adapters...), tt.adapter)
			if d.Replica != tt.want {
				t.Errorf("chose r%d, want r%d (%s)", d.Replica, tt.want, d.Explain())
			}
			for _, cd := range d.Candidates {
				got := [2]float64{cd.Terms[policy.E2AdapterLoad], cd.Terms[policy.E2AdapterEviction]}
				want := [2]float64{tt.load[cd.Replica], tt.evict[cd.Replica]}
				if got != want {
					t.Errorf("r%d: adapter_load, adapter_eviction = %v, want %v", cd.Replica, got, want)
				}
				if cd.Prefill != cd.Terms[policy.E2Prefill]+got[0] || cd.Eviction != cd.Terms[policy.E2Eviction]+got[1] {
					t.Errorf("r%d: P=%v M=%v do not include the adapter terms %v", cd.Replica, cd.Prefill, cd.Eviction, got)
				}
			}
		})
	}
}

// TestE2AdapterLoadOutweighed: a replica holding the adapter but with more
// queued prefill than the load takes loses to one that must load it.
func TestE2AdapterLoadOutweighed(t *testing.T) {
	c := loraCluster(t, nil, []string{"a"})
	c.reps[1].PendingPrefill = time.Second
	c.reps[1].Prefilling = 5
	if d := explainE2(t, c, "a"); d.Replica != 0 {
		t.Errorf("chose r%d, want r0 (%s)", d.Replica, d.Explain())
	}
}

// TestGIELoRA: GIE's lora-affinity scores 1 for a holder, 0.8 with a free
// slot, 0 when full; other scorers equal, the holder wins, then the replica
// with a free slot.
func TestGIELoRA(t *testing.T) {
	c := loraCluster(t, []string{"b", "c"}, []string{"b"}, []string{"a", "b"})
	p := policy.NewGIELoRA(1)
	req, v := c.request(toks(2, 300), t0)
	req.Adapter = "a"
	d, err := p.Route(req, v, t0)
	if err != nil {
		t.Fatal(err)
	}
	want := []float64{4, 4.8, 5} // 3·0 + 2·1 + 2·1 + lora
	for _, cd := range d.Candidates {
		if cd.Score != want[cd.Replica] {
			t.Errorf("r%d: score %v, want %v", cd.Replica, cd.Score, want[cd.Replica])
		}
	}
	if d.Replica != 2 {
		t.Errorf("chose r%d, want r2", d.Replica)
	}
	if got, err := policy.New("gie-lora", policy.DefaultOptions()); err != nil || got.Name() != "gie-lora" {
		t.Errorf(`New("gie-lora") = %v, %v`, got, err)
	}
}
