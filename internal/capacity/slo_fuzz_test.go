package capacity

import (
	"errors"
	"testing"
)

// FuzzParseSLO: any input parses or fails with ErrSLO, never panics, and
// what parses renders to a string that parses to the same objective.
func FuzzParseSLO(f *testing.F) {
	for _, s := range []string{"ttft_p90=2s", "ttft_p90=2s,tpot_p90=100ms", "e2e_p99.9=1m", "", ",", "ttft_p=1s", "tpot_p50=-1s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		slo, err := ParseSLO(s)
		if err != nil {
			if !errors.Is(err, ErrSLO) {
				t.Fatalf("ParseSLO(%q): error %v does not wrap ErrSLO", s, err)
			}
			return
		}
		if len(slo) == 0 {
			t.Fatalf("ParseSLO(%q) = empty objective, no error", s)
		}
		for _, tg := range slo {
			if !(tg.Percentile > 0 && tg.Percentile <= 100) || tg.Limit <= 0 {
				t.Fatalf("ParseSLO(%q) = %+v: out of range", s, tg)
			}
		}
		again, err := ParseSLO(slo.String())
		if err != nil || again.String() != slo.String() {
			t.Fatalf("ParseSLO(%q): %q does not round-trip: %v, %v", s, slo.String(), again, err)
		}
	})
}
