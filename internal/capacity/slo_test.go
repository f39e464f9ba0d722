package capacity

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
)

func TestParseSLO(t *testing.T) {
	tests := []struct {
		in   string
		want SLO
		err  string // substring of the error; "" for none
	}{
		{in: "ttft_p90=2s", want: SLO{{TTFT, 90, 2 * time.Second}}},
		{in: "ttft_p90=2s,tpot_p90=100ms", want: SLO{{TTFT, 90, 2 * time.Second}, {TPOT, 90, 100 * time.Millisecond}}},
		{in: " ttft_p99=1.5s , e2e_p50=30s ", want: SLO{{TTFT, 99, 1500 * time.Millisecond}, {E2E, 50, 30 * time.Second}}},
		{in: "ttft_p99.9=3s", want: SLO{{TTFT, 99.9, 3 * time.Second}}},
		{in: "ttft_p90=2s,ttft_p99=5s", want: SLO{{TTFT, 90, 2 * time.Second}, {TTFT, 99, 5 * time.Second}}},
		{in: "ttft_p100=9s", want: SLO{{TTFT, 100, 9 * time.Second}}},
		{in: "", err: "empty"},
		{in: "  ", err: "empty"},
		{in: "ttft_p90=2s,", err: "stray comma"},
		{in: "ttft_p90", err: "want METRIC_pP=LIMIT"},
		{in: "ttft90=2s", err: "want METRIC_pP before ="},
		{in: "itl_p90=2s", err: `unknown metric "itl"`},
		{in: "TTFT_p90=2s", err: `unknown metric "TTFT"`},
		{in: "ttft_p=2s", err: "not a plain number"},
		{in: "ttft_p9e1=2s", err: "not a plain number"},
		{in: "ttft_p-5=2s", err: "not a plain number"},
		{in: "ttft_pNaN=2s", err: "not a plain number"},
		{in: "ttft_p.5=2s", err: "not a plain number"},
		{in: "ttft_p0=2s", err: "want in (0, 100]"},
		{in: "ttft_p101=2s", err: "want in (0, 100]"},
		{in: "ttft_p90=2", err: "limit"},
		{in: "ttft_p90=", err: "limit"},
		{in: "ttft_p90=0s", err: "want > 0"},
		{in: "ttft_p90=-1s", err: "want > 0"},
		{in: "ttft_p90=2s,ttft_p90=3s", err: "given twice"},
		{in: "ttft_p90=2s,ttft_p90.0=3s", err: "given twice"},
		{in: strings.Repeat("x", 2000), err: "at most"},
	}
	for _, tt := range tests {
		got, err := ParseSLO(tt.in)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) || !errors.Is(err, ErrSLO) {
				t.Errorf("ParseSLO(%q) = %v, %v; want an ErrSLO containing %q", tt.in, got, err, tt.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("ParseSLO(%q): %v", tt.in, err)
			continue
		}
		if got.String() != tt.want.String() || len(got) != len(tt.want) {
			t.Errorf("ParseSLO(%q) = %v, want %v", tt.in, got, tt.want)
		}
		for i := range got {
			if got[i] != tt.want[i] {
				t.Errorf("ParseSLO(%q)[%d] = %+v, want %+v", tt.in, i, got[i], tt.want[i])
			}
		}
		// String round-trips.
		again, err := ParseSLO(got.String())
		if err != nil || again.String() != got.String() {
			t.Errorf("ParseSLO(%q.String() = %q) = %v, %v", tt.in, got.String(), again, err)
		}
	}
}

// rec is a successful request of ttft and latency ms and out tokens.
func rec(ttft, lat float64, out int) report.RequestRecord {
	return report.RequestRecord{TTFTMs: ttft, LatencyMs: lat, OutputTokens: out, PromptTokens: 10}
}

func TestJudge(t *testing.T) {
	// Ten requests, TTFT 100..1000 ms; p90 (numpy's linear) = 910 ms.
	var recs []report.RequestRecord
	for i := 1; i <= 10; i++ {
		recs = append(recs, rec(float64(100*i), float64(100*i)+1000, 11)) // TPOT 100 ms
	}
	tests := []struct {
		name     string
		slo      string
		recs     []report.RequestRecord
		met      bool
		observed []float64
		good     int
	}{
		{name: "met", slo: "ttft_p90=1s", recs: recs, met: true, observed: []float64{910}, good: 10},
		{name: "just missed", slo: "ttft_p90=900ms", recs: recs, met: false, observed: []float64{910}, good: 9},
		{name: "tpot", slo: "ttft_p90=1s,tpot_p50=99ms", recs: recs, met: false, observed: []float64{910, 100}, good: 0},
		{name: "e2e", slo: "e2e_p50=1550ms", recs: recs, met: true, observed: []float64{1550}, good: 5},
		{name: "one token has no tpot", slo: "tpot_p90=1ms", recs: []report.RequestRecord{rec(10, 10, 1)}, met: true, observed: []float64{0}, good: 1},
		{name: "failures count as slow", slo: "ttft_p50=1s", recs: append(append([]report.RequestRecord{}, recs[:4]...),
			report.RequestRecord{Error: "x"}, report.RequestRecord{Error: "x"}, report.RequestRecord{Error: "x"}, report.RequestRecord{Error: "x"}),
			met: false, observed: []float64{math.Inf(1)}, good: 4},
		{name: "three failures in seven pass p50", slo: "ttft_p50=1s", recs: append(append([]report.RequestRecord{}, recs[:4]...),
			report.RequestRecord{Error: "x"}, report.RequestRecord{Error: "x"}, report.RequestRecord{Error: "x"}),
			met: true, observed: []float64{400}, good: 4},
		{name: "few failures pass p50", slo: "ttft_p50=1s", recs: append(append([]report.RequestRecord{}, recs...), report.RequestRecord{Error: "x"}),
			met: true, observed: []float64{600}, good: 10},
		{name: "no records", slo: "ttft_p90=1s", recs: nil, met: false, observed: []float64{0}, good: 0},
	}
	for _, tt := range tests {
		s, err := ParseSLO(tt.slo)
		if err != nil {
			t.Fatal(err)
		}
		v := s.Judge(tt.recs, 2)
		if v.Met != tt.met || v.Good != tt.good || v.Total != len(tt.recs) || v.GoodputRPS != float64(tt.good)/2 {
			t.Errorf("%s: Judge = %+v, want met %v good %d goodput %g", tt.name, v, tt.met, tt.good, float64(tt.good)/2)
		}
		for i, want := range tt.observed {
			if got := v.Observed[i]; !(math.Abs(got-want) < 1e-9 || got == want) {
				t.Errorf("%s: observed[%d] = %g, want %g", tt.name, i, got, want)
			}
		}
	}
}

// TestSustain: a run whose cluster keeps up completes, in the middle half
// of its arrivals, about as many requests as arrive there; one whose
// cluster completes half the offered rate does not, and misses an SLO its
// TTFTs meet (every request starts at once, the backlog grows in decode).
func TestSustain(t *testing.T) {
	const n = 400
	run := func(service float64) []report.RequestRecord {
		recs := make([]report.RequestRecord, n)
		for i := range recs {
			a := float64(i) * 0.1 // 10 req/s
			done := max(a+0.5, float64(i+1)*service)
			recs[i] = report.RequestRecord{ID: i, ArrivalS: a, TTFTMs: 50, LatencyMs: (done - a) * 1000, OutputTokens: 10, PromptTokens: 10}
		}
		return recs
	}
	slo, err := ParseSLO("ttft_p90=1s")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		service float64 // seconds per completion at best
		lo, hi  float64
		wantMet bool
	}{
		{"keeps up", 0.05, 0.95, 1.05, true},      // can complete 20 req/s
		{"half the rate", 0.2, 0.45, 0.55, false}, // completes 5 req/s
		{"just behind", 0.115, 0.82, 0.92, false},
	} {
		recs := run(tc.service)
		s := Sustain(recs)
		if s < tc.lo || s > tc.hi {
			t.Errorf("%s: Sustain = %.3f, want in [%g, %g]", tc.name, s, tc.lo, tc.hi)
		}
		if v := slo.Judge(recs, 40); v.Met != tc.wantMet || v.Observed[0] != 50 {
			t.Errorf("%s: Judge met %v (ttft p90 %v, sustained %.2f), want met %v", tc.name, v.Met, v.Observed[0], v.Sustained, tc.wantMet)
		}
	}
	// A failed request never completes.
	recs := run(0.05)
	for i := range recs {
		recs[i].Error = "x"
	}
	if s := Sustain(recs); s != 0 {
		t.Errorf("all failed: Sustain = %v, want 0", s)
	}
}
