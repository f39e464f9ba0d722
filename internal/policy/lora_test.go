package policy_test

import (
	"math"
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

// TestGIELoRA: GIE's lora-affinity, case by case as its scorer orders
// them (running → 1, room |running|+|waiting| < max → 0.8, waiting → 0.6,
// else 0), added at weight 1 to equal prefix/KV/queue scores (3·0 + 2·1 +
// 2·1); an adapter held idle in a slot is not active, the base model is
// never active, a replica without max_lora has no room.
func TestGIELoRA(t *testing.T) {
	for _, tt := range []struct {
		name             string
		adapter          string
		held             []string
		running, waiting []string
		max              int
		want             float64
	}{
		{"running", "a", []string{"a", "b"}, []string{"a", "b"}, nil, 2, 1},
		{"room", "a", []string{"b"}, []string{"b"}, nil, 2, 0.8},
		{"waiting, room", "a", []string{"b"}, []string{"b"}, []string{"a"}, 3, 0.8},
		{"waiting, no room", "a", []string{"b"}, []string{"b"}, []string{"a"}, 2, 0.6},
		{"full", "a", []string{"b", "c"}, []string{"b", "c"}, nil, 2, 0},
		{"held idle, full with waiting", "a", []string{"a", "b"}, []string{"b"}, []string{"c"}, 2, 0},
		{"held idle, room", "a", []string{"a", "b"}, []string{"b"}, nil, 2, 0.8},
		{"base model, room", "", []string{"b"}, []string{"b"}, nil, 2, 0.8},
		{"base model, full", "", []string{"b", "c"}, []string{"b", "c"}, nil, 2, 0},
		{"no gauge", "a", nil, nil, nil, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := loraCluster(t, tt.held)
			c.reps[0].RunningAdapters, c.reps[0].WaitingAdapters, c.reps[0].MaxAdapters = tt.running, tt.waiting, tt.max
			req, v := c.request(toks(2, 300), t0)
			req.Adapter = tt.adapter
			d, err := policy.NewGIELoRA(1).Route(req, v, t0)
			if err != nil {
				t.Fatal(err)
			}
			if got := d.Candidates[0].Score; math.Abs(got-(4+tt.want)) > 1e-12 {
				t.Errorf("score %v, want %v", got, 4+tt.want)
			}
		})
	}
	// The adapter's running replica wins over one with room, which wins
	// over one where it only waits.
	c := loraCluster(t, []string{"b", "c"}, []string{"b"}, []string{"a", "b"})
	c.reps[0].RunningAdapters, c.reps[0].WaitingAdapters = []string{"b"}, []string{"a"}
	c.reps[1].RunningAdapters = []string{"b"}
	c.reps[2].RunningAdapters = []string{"a"}
	c.reps[1].MaxAdapters = 3
	req, v := c.request(toks(2, 300), t0)
	req.Adapter = "a"
	p := policy.NewGIELoRA(1)
	if d, _ := p.Route(req, v, t0); d.Replica != 2 {
		t.Errorf("chose r%d, want r2 (running)", d.Replica)
	}
	v.Replicas[2].Up = false
	if d, _ := p.Route(req, v, t0); d.Replica != 1 {
		t.Errorf("chose r%d, want r1 (room)", d.Replica)
	}
	if got, err := policy.New("gie-lora", policy.DefaultOptions()); err != nil || got.Name() != "gie-lora" {
		t.Errorf(`New("gie-lora") = %v, %v`, got, err)
	}
}

// TestE2AdapterWait: a request whose adapter is not among those a
// replica's running requests use, when they already use all its slots,
// waits for the soonest of them to drain (vLLM skips it until then); the
// wait is a cost (r0, cheaper otherwise, loses), 0 where the adapter runs,
// a slot is free, or for the base model. The linear profile's decode step
// of r0's 4 requests in flight is 9 ms, so an adapter with n requests owing
// D tokens drains in D/(n+1)·9 ms.
func TestE2AdapterWait(t *testing.T) {
	flights := []policy.AdapterFlight{{Adapter: "b", InFlight: 1, DecodeTokens: 100}, {Adapter: "c", InFlight: 3, DecodeTokens: 600}}
	for _, tt := range []struct {
		name             string
		adapter          string
		running, waiting []string
		flights          []policy.AdapterFlight
		want             float64 // r0's adapter_wait, seconds
	}{
		{"slots full: the soonest drain", "a", []string{"b", "c"}, nil, flights, 0.450},
		{"a waiting adapter takes the first freed slot", "a", []string{"b", "c"}, []string{"d", "b"}, flights, 1.350},
		{"its own adapter waiting is not ahead of it", "a", []string{"b", "c"}, []string{"a"}, flights, 0.450},
		{"more ahead than running: the last drain", "a", []string{"b", "c"}, []string{"d", "e", "f"}, flights, 1.350},
		{"an adapter without the router's requests: r's mean output", "a", []string{"b", "x"},
			nil, []policy.AdapterFlight{{Adapter: "b", InFlight: 1, DecodeTokens: 400}}, 0.7875},
		{"running already", "a", []string{"a", "b"}, nil, flights, 0},
		{"a free slot", "a", []string{"b"}, nil, flights, 0},
		{"a free slot a waiting adapter takes", "a", []string{"b"}, []string{"d"}, flights, 0.450},
		{"base model", "", []string{"b", "c"}, nil, flights, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := loraCluster(t, tt.running, []string{"e"})
			for i := range c.reps {
				c.reps[i].InFlight, c.reps[i].DecodeTokens = 4, 700
			}
			c.reps[0].RunningAdapters, c.reps[0].WaitingAdapters, c.reps[0].AdapterFlights = tt.running, tt.waiting, tt.flights
			c.reps[1].RunningAdapters = []string{"e"}
			c.reps[1].AdapterFlights = []policy.AdapterFlight{{Adapter: "e", InFlight: 4, DecodeTokens: 700}}
			// r1 owes 200 ms more prefill: without the wait r0 wins.
			c.reps[1].PendingPrefill, c.reps[1].Prefilling = 200*time.Millisecond, 1
			d := explainE2(t, c, tt.adapter)
			got := [2]float64{}
			for _, cd := range d.Candidates {
				got[cd.Replica] = cd.Terms[policy.E2AdapterWait]
				if cd.Terms[policy.E2AdapterWait] != 0 && cd.Load < cd.Terms[policy.E2AdapterWait] {
					t.Errorf("r%d: L=%v does not include adapter_wait %v", cd.Replica, cd.Load, cd.Terms[policy.E2AdapterWait])
				}
			}
			if diff := got[0] - tt.want; diff > 1e-9 || diff < -1e-9 || got[1] != 0 {
				t.Errorf("adapter_wait = %v, want [%v 0] (%s)", got, tt.want, d.Explain())
			}
			if want := map[bool]int{true: 1, false: 0}[tt.want > 0]; d.Replica != want {
				t.Errorf("chose r%d, want r%d (%s)", d.Replica, want, d.Explain())
			}
		})
	}
}

// TestE2AdapterWaitWeight: adapter_wait_weight scales the term and 0 turns
// it off (the choice then goes back to the replica that runs out of slots).
func TestE2AdapterWaitWeight(t *testing.T) {
	for _, w := range []float64{0, 2} {
		c := loraCluster(t, []string{"b", "c"}, nil)
		c.reps[0].RunningAdapters = []string{"b", "c"}
		c.reps[0].InFlight, c.reps[0].DecodeTokens = 4, 700
		c.reps[0].AdapterFlights = []policy.AdapterFlight{{Adapter: "b", InFlight: 1, DecodeTokens: 100}, {Adapter: "c", InFlight: 3, DecodeTokens: 600}}
		cfg := policy.DefaultE2Config()
		cfg.AdapterWaitWeight = w
		p := mustE2(t, cfg)
		req, v := c.request(toks(1, 300), t0)
		req.Adapter, req.Explain = "a", true
		d, err := p.Route(req, v, t0)
		if err != nil {
			t.Fatal(err)
		}
		for _, cd := range d.Candidates {
			want := 0.0
			if cd.Replica == 0 {
				want = w * 0.450
			}
			if got := cd.Terms[policy.E2AdapterWait]; got-want > 1e-9 || want-got > 1e-9 {
				t.Errorf("weight %v: r%d adapter_wait = %v, want %v", w, cd.Replica, got, want)
			}
		}
	}
}

// TestE2AdapterInterference: on a replica that must load the adapter, the
// load joins the P that interference charges to each running decode
// (0.3 · T_load · 4 decoding more than for the base model's request); on
// one that holds it, nothing changes.
func TestE2AdapterInterference(t *testing.T) {
	c := loraCluster(t, nil, []string{"a"})
	for i := range c.reps {
		c.reps[i].Decoding, c.reps[i].DecodeContextTokens, c.reps[i].InFlight = 4, 4000, 4
	}
	terms := func(adapter string) [2]float64 {
		var out [2]float64
		for _, cd := range explainE2(t, c, adapter).Candidates {
			out[cd.Replica] = cd.Terms[policy.E2Interference]
		}
		return out
	}
	base, lora := terms(""), terms("a")
	want := 0.3 * loadSecs * 4
	if d := lora[0] - base[0]; d-want > 1e-12 || want-d > 1e-12 {
		t.Errorf("r0 (lacks a): interference %v for a, %v for the base model: +%v, want +%v", lora[0], base[0], d, want)
	}
	if lora[1] != base[1] {
		t.Errorf("r1 (holds a): interference %v for a, %v for the base model: want equal", lora[1], base[1])
	}
}
