package capacity

import (
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/workload"
)

func TestLoader(t *testing.T) {
	// A trace keeps its shape, compressed in time to offer the rate.
	f := workload.DefaultFlags()
	f.Spec.Name = ""
	f.Trace = "../workload/testdata/small.jsonl"
	l, err := NewLoader(f)
	if err != nil {
		t.Fatal(err)
	}
	base, _ := l.At(l.Start)
	for _, rate := range []float64{0.5, l.Start, 40} {
		reqs, err := l.At(rate)
		if err != nil {
			t.Fatal(err)
		}
		span := (reqs[len(reqs)-1].Arrival - reqs[0].Arrival).Seconds()
		if got := float64(len(reqs)-1) / span; math.Abs(got-rate) > 1e-6*rate {
			t.Errorf("trace at %g: offers %g", rate, got)
		}
		for i := range reqs {
			if reqs[i].ID != base[i].ID || len(reqs[i].Tokens) != len(base[i].Tokens) {
				t.Fatalf("trace at %g: request %d differs from the trace's", rate, i)
			}
		}
	}
	// A generated Poisson workload is drawn again at the rate: the same
	// requests, gaps scaled.
	g := workload.DefaultFlags()
	g.Spec.Requests = 50
	g.Arrival.Rate = 5
	l, err = NewLoader(g)
	if err != nil {
		t.Fatal(err)
	}
	if l.Start != 5 {
		t.Errorf("poisson start %g, want --rate 5", l.Start)
	}
	a, _ := l.At(5)
	b, _ := l.At(10)
	for i := range a {
		if len(a[i].Tokens) != len(b[i].Tokens) || math.Abs(a[i].Arrival.Seconds()-2*b[i].Arrival.Seconds()) > 1e-6 {
			t.Fatalf("poisson request %d: at 5/s %v (%d tokens), at 10/s %v (%d tokens)", i, a[i].Arrival, len(a[i].Tokens), b[i].Arrival, len(b[i].Tokens))
		}
	}
}
