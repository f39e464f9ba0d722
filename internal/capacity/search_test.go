package capacity

import (
	"context"
	"errors"
	"math"
	"testing"
)

// threshold is a synthetic monotone system: it meets the SLO at every rate
// up to capacity and counts its probes.
type threshold struct {
	capacity float64
	probes   int
}

func (m *threshold) probe(_ context.Context, r float64) (bool, error) {
	m.probes++
	return r <= m.capacity, nil
}

func TestSearchFindsTheBoundary(t *testing.T) {
	c := DefaultConfig()
	c.Start = 10
	for _, capRate := range []float64{0.37, 1, 4.9, 9.99, 10, 10.01, 12.5, 19.9, 20, 33.3, 77, 160, 999.5, 4321} {
		m := &threshold{capacity: capRate}
		o, err := Search(context.Background(), c, m.probe)
		if err != nil {
			t.Fatalf("capacity %g: %v", capRate, err)
		}
		// The answer met, and the true boundary lies within tolerance.
		if !(o.Capacity <= capRate && capRate <= o.Capacity*(1+c.Tolerance)) {
			t.Errorf("capacity %g: found %g (steps %v), want within [C, C·%g]", capRate, o.Capacity, o.Steps, 1+c.Tolerance)
		}
		if !o.Converged || o.AboveMax || o.BelowMin {
			t.Errorf("capacity %g: outcome %+v, want converged within bounds", capRate, o)
		}
		// The answer is the highest probed rate that met.
		best := 0.0
		for _, s := range o.Steps {
			if s.Met != (s.Rate <= capRate) {
				t.Errorf("capacity %g: step %+v recorded wrongly", capRate, s)
			}
			if s.Met {
				best = math.Max(best, s.Rate)
			}
		}
		if best != o.Capacity {
			t.Errorf("capacity %g: found %g, highest met step %g", capRate, o.Capacity, best)
		}
		// Doubling or halving, then bisection: about log2(range) + log2(1/tol) probes.
		bound := int(math.Ceil(math.Abs(math.Log2(capRate/c.Start)))) + int(math.Ceil(math.Log2(1/c.Tolerance))) + 3
		if m.probes != len(o.Steps) || m.probes > bound {
			t.Errorf("capacity %g: %d probes (%d steps), want ≤ %d", capRate, m.probes, len(o.Steps), bound)
		}
	}
}

func TestSearchBounds(t *testing.T) {
	c := Config{Start: 10, Tolerance: 0.1, MaxRate: 50, MinRate: 1, MaxProbes: 30}
	// Every rate meets: capacity is MaxRate, a lower bound.
	o, err := Search(context.Background(), c, (&threshold{capacity: 1e9}).probe)
	if err != nil || o.Capacity != 50 || !o.AboveMax || o.Converged {
		t.Errorf("all met: %+v, %v; want capacity 50 above max", o, err)
	}
	wantRates := []float64{10, 20, 40, 50}
	if len(o.Steps) != len(wantRates) {
		t.Fatalf("all met: steps %v, want rates %v", o.Steps, wantRates)
	}
	for i, s := range o.Steps {
		if s.Rate != wantRates[i] {
			t.Errorf("all met: step %d rate %g, want %g", i, s.Rate, wantRates[i])
		}
	}
	// Nothing meets: capacity 0 below min.
	o, err = Search(context.Background(), c, (&threshold{capacity: 0.5}).probe)
	if err != nil || o.Capacity != 0 || !o.BelowMin {
		t.Errorf("none met: %+v, %v; want capacity 0 below min", o, err)
	}
	if last := o.Steps[len(o.Steps)-1]; last.Rate != 1 {
		t.Errorf("none met: last probe %g, want the min rate 1", last.Rate)
	}
}

func TestSearchStopsAtMaxProbes(t *testing.T) {
	c := Config{Start: 10, Tolerance: 1e-6, MaxRate: 1e6, MinRate: 1, MaxProbes: 6}
	o, err := Search(context.Background(), c, (&threshold{capacity: 13}).probe)
	if err != nil || len(o.Steps) != 6 || o.Converged || !(o.Capacity >= 10 && o.Capacity <= 13) {
		t.Errorf("max probes: %+v, %v; want 6 steps, not converged, capacity in [10, 13]", o, err)
	}
	// Out of probes before bracketing: an error.
	c.MaxProbes = 2
	if _, err := Search(context.Background(), c, (&threshold{capacity: 1000}).probe); !errors.Is(err, ErrProbes) {
		t.Errorf("unbracketed: err %v, want ErrProbes", err)
	}
}

func TestSearchErrors(t *testing.T) {
	boom := errors.New("boom")
	calls := 0
	_, err := Search(context.Background(), DefaultConfig(), func(context.Context, float64) (bool, error) {
		calls++
		if calls == 3 {
			return false, boom
		}
		return true, nil
	})
	if !errors.Is(err, boom) {
		t.Errorf("probe error: %v, want boom", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Search(ctx, DefaultConfig(), (&threshold{capacity: 5}).probe); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v, want context.Canceled", err)
	}
	for _, bad := range []Config{
		{Start: 0, Tolerance: 0.05, MaxRate: 10, MinRate: 1, MaxProbes: 5},
		{Start: 5, Tolerance: 0, MaxRate: 10, MinRate: 1, MaxProbes: 5},
		{Start: 5, Tolerance: 1, MaxRate: 10, MinRate: 1, MaxProbes: 5},
		{Start: 5, Tolerance: 0.05, MaxRate: 4, MinRate: 1, MaxProbes: 5},
		{Start: 5, Tolerance: 0.05, MaxRate: 10, MinRate: 6, MaxProbes: 5},
		{Start: 5, Tolerance: 0.05, MaxRate: 10, MinRate: 1, MaxProbes: 1},
		{Start: math.NaN(), Tolerance: 0.05, MaxRate: 10, MinRate: 1, MaxProbes: 5},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil, want an error", bad)
		}
	}
}

// BenchmarkSearch measures the search's own overhead over a free probe.
func BenchmarkSearch(b *testing.B) {
	b.ReportAllocs()
	c := DefaultConfig()
	steps := 0
	for b.Loop() {
		o, _ := Search(context.Background(), c, (&threshold{capacity: 123.4}).probe)
		steps += len(o.Steps)
	}
	b.ReportMetric(float64(steps)/float64(b.N), "probes/search")
}
