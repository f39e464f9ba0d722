package workload

import (
	"math"
	"testing"
	"time"
)

func blank(n int) []Request { return make([]Request, n) }

// gaps returns the inter-arrival gaps in seconds and checks they are >= 0.
func gaps(t *testing.T, reqs []Request) []float64 {
	t.Helper()
	if reqs[0].Arrival != 0 {
		t.Fatalf("first arrival %v, want 0", reqs[0].Arrival)
	}
	g := make([]float64, len(reqs)-1)
	for i := 1; i < len(reqs); i++ {
		d := reqs[i].Arrival - reqs[i-1].Arrival
		if d < 0 {
			t.Fatalf("arrival %d before arrival %d", i, i-1)
		}
		g[i-1] = d.Seconds()
	}
	return g
}

func meanCV(x []float64) (mean, cv float64) {
	for _, v := range x {
		mean += v
	}
	mean /= float64(len(x))
	var ss float64
	for _, v := range x {
		ss += (v - mean) * (v - mean)
	}
	return mean, math.Sqrt(ss/float64(len(x))) / mean
}

func TestPoisson(t *testing.T) {
	reqs := blank(20000)
	if err := Poisson(reqs, 12, newRand(1, 9)); err != nil {
		t.Fatal(err)
	}
	mean, cv := meanCV(gaps(t, reqs))
	if rate := 1 / mean; math.Abs(rate-12)/12 > 0.03 {
		t.Errorf("rate %.3f, want 12 ± 3%%", rate)
	}
	if math.Abs(cv-1) > 0.05 {
		t.Errorf("gap cv %.3f, want 1", cv)
	}
	if err := Poisson(reqs, 0, newRand(1, 9)); err == nil {
		t.Error("Poisson rate 0: no error")
	}
}

func TestGamma(t *testing.T) {
	for _, cv := range []float64{0.5, 1, 3} {
		reqs := blank(40000)
		if err := Gamma(reqs, 5, cv, newRand(2, 9)); err != nil {
			t.Fatal(err)
		}
		mean, got := meanCV(gaps(t, reqs))
		if rate := 1 / mean; math.Abs(rate-5)/5 > 0.05 {
			t.Errorf("cv %g: rate %.3f, want 5 ± 5%%", cv, rate)
		}
		if math.Abs(got-cv)/cv > 0.1 {
			t.Errorf("cv %g: gap cv %.3f", cv, got)
		}
	}
}

func TestRamp(t *testing.T) {
	stages, err := ParseStages("3:100s, 30:100s")
	if err != nil {
		t.Fatal(err)
	}
	reqs := blank(4000)
	if err := Ramp(reqs, stages, newRand(3, 9)); err != nil {
		t.Fatal(err)
	}
	gaps(t, reqs)
	var first, second int
	for _, r := range reqs {
		switch {
		case r.Arrival <= 100*time.Second:
			first++
		case r.Arrival <= 200*time.Second:
			second++
		}
	}
	// Expect 300 and 3000 (Poisson: sd ≈ 17 and 55).
	if math.Abs(float64(first)-300) > 60 || math.Abs(float64(second)-3000) > 200 {
		t.Errorf("stage counts %d, %d; want ≈ 300, 3000", first, second)
	}
	for _, bad := range []string{"", "3", "x:1s", "3:-1s", "0:10s"} {
		if _, err := ParseStages(bad); err == nil {
			t.Errorf("ParseStages(%q): no error", bad)
		}
	}
}

func TestFromTimestamps(t *testing.T) {
	ts := []time.Duration{10 * time.Second, 11 * time.Second, 14 * time.Second}
	reqs := blank(5)
	if err := FromTimestamps(reqs, ts, 2); err != nil {
		t.Fatal(err)
	}
	// Relative 0,1,4 s; repeated after span 4 s + mean gap 2 s; halved.
	want := []time.Duration{0, 500 * time.Millisecond, 2 * time.Second, 3 * time.Second, 3500 * time.Millisecond}
	for i, r := range reqs {
		if r.Arrival != want[i] {
			t.Errorf("arrival %d = %v, want %v", i, r.Arrival, want[i])
		}
	}
	if err := FromTimestamps(reqs, []time.Duration{2, 1}, 1); err == nil {
		t.Error("unsorted timestamps: no error")
	}
}

// TestSessionOrderKept: arrival processes keep list order, so a session's
// steps arrive in order.
func TestSessionOrderKept(t *testing.T) {
	s := DefaultSpec("agent")
	s.Requests = 2000
	for _, a := range []ArrivalSpec{
		{Process: ArrivalPoisson, Rate: 50},
		{Process: ArrivalGamma, Rate: 50, CV: 4},
		{Process: ArrivalRamp, Stages: []Stage{{1, time.Second}, {100, time.Second}}},
	} {
		reqs := gen(t, s)
		if err := a.Apply(reqs, 7, false); err != nil {
			t.Fatal(err)
		}
		last := make(map[string]Request)
		for _, r := range reqs {
			if p, ok := last[r.Session]; ok && (r.Arrival < p.Arrival || len(r.Tokens) <= len(p.Tokens)) {
				t.Fatalf("%s: session %s step out of order", a.Process, r.Session)
			}
			last[r.Session] = r
		}
	}
}

func TestArrivalApplyAuto(t *testing.T) {
	reqs := []Request{{Arrival: 0}, {Arrival: 4 * time.Second}}
	a := DefaultArrival()
	a.TimeScale = 4
	if err := a.Apply(reqs, 1, true); err != nil || reqs[1].Arrival != time.Second {
		t.Fatalf("auto on a trace: arrival %v, err %v; want 1s", reqs[1].Arrival, err)
	}
	if err := a.Apply(reqs, 1, false); err != nil || reqs[1].Arrival == time.Second {
		t.Fatalf("auto on a workload: arrival %v, err %v; want Poisson", reqs[1].Arrival, err)
	}
	a.Process = "weekly"
	if err := a.Apply(reqs, 1, false); err == nil {
		t.Fatal("unknown process: no error")
	}
}
