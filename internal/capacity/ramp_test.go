package capacity

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseRamp(t *testing.T) {
	tests := []struct {
		in    string
		want  Ramp
		rates []float64
		err   string
	}{
		{in: "2:2:10", want: Ramp{2, 2, 10, 0}, rates: []float64{2, 4, 6, 8, 10}},
		{in: "1:3:8:30s", want: Ramp{1, 3, 8, 30 * time.Second}, rates: []float64{1, 4, 7}},
		{in: "0.1:0.1:0.3", want: Ramp{0.1, 0.1, 0.3, 0}, rates: []float64{0.1, 0.2, 0.30000000000000004}},
		{in: "5:1:5:1m", want: Ramp{5, 1, 5, time.Minute}, rates: []float64{5}},
		{in: "2:2", err: "want START:STEP:MAX"},
		{in: "2:2:10:1s:x", err: "want START:STEP:MAX"},
		{in: "", err: "want START:STEP:MAX"},
		{in: "a:2:10", err: `START "a" is not a plain number`},
		{in: "2:-1:10", err: `STEP "-1" is not a plain number`},
		{in: "2:1e1:10", err: "not a plain number"},
		{in: "0:1:10", err: "START 0: want > 0"},
		{in: "2:0:10", err: "STEP 0: want > 0"},
		{in: "10:1:2", err: "MAX 2 below START 10"},
		{in: "1:0.0001:100", err: "steps, want at most"},
		{in: "1:1:2:fast", err: "DURATION"},
		{in: "1:1:2:-1s", err: "DURATION -1s: want > 0"},
	}
	for _, tt := range tests {
		got, err := ParseRamp(tt.in)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) || !errors.Is(err, ErrRamp) {
				t.Errorf("ParseRamp(%q) = %+v, %v; want an ErrRamp containing %q", tt.in, got, err, tt.err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseRamp(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
			continue
		}
		if r := got.Rates(); !slices.Equal(r, tt.rates) {
			t.Errorf("ParseRamp(%q).Rates() = %v, want %v", tt.in, r, tt.rates)
		}
	}
}

func TestClimb(t *testing.T) {
	rates := []float64{2, 4, 6, 8, 10}
	for _, tt := range []struct {
		capacity float64
		want     Outcome
	}{
		{5, Outcome{Capacity: 4, Steps: []Step{{2, true}, {4, true}, {6, false}}, Converged: true}},
		{1, Outcome{Capacity: 0, Steps: []Step{{2, false}}, BelowMin: true, Converged: true}},
		{99, Outcome{Capacity: 10, Steps: []Step{{2, true}, {4, true}, {6, true}, {8, true}, {10, true}}, AboveMax: true}},
	} {
		var probed []float64
		o, err := Climb(rates, func(r float64) (bool, error) {
			probed = append(probed, r)
			return r <= tt.capacity, nil
		})
		if err != nil || o.Capacity != tt.want.Capacity || !slices.Equal(o.Steps, tt.want.Steps) ||
			o.AboveMax != tt.want.AboveMax || o.BelowMin != tt.want.BelowMin || o.Converged != tt.want.Converged {
			t.Errorf("capacity %g: %+v, %v; want %+v", tt.capacity, o, err, tt.want)
		}
		if len(probed) != len(tt.want.Steps) {
			t.Errorf("capacity %g: probed %v: want it to stop at the first miss", tt.capacity, probed)
		}
	}
	boom := errors.New("boom")
	if _, err := Climb(rates, func(float64) (bool, error) { return false, boom }); !errors.Is(err, boom) {
		t.Errorf("probe error: %v", err)
	}
}

// FuzzParseRamp: any input parses to a valid ramp or fails with ErrRamp.
func FuzzParseRamp(f *testing.F) {
	for _, s := range []string{"2:2:20:60s", "1:1:1", "0.5:0.25:3", "", "::", "1:0:5", "9:1:2", "1:1:2:0s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRamp(s)
		if err != nil {
			if !errors.Is(err, ErrRamp) {
				t.Fatalf("ParseRamp(%q): %v does not wrap ErrRamp", s, err)
			}
			return
		}
		if !(r.Start > 0 && r.Step > 0 && r.Max >= r.Start && r.Duration >= 0) {
			t.Fatalf("ParseRamp(%q) = %+v: invalid", s, r)
		}
		rates := r.Rates()
		if len(rates) == 0 || len(rates) > MaxRampSteps || rates[0] != r.Start {
			t.Fatalf("ParseRamp(%q).Rates() = %d rates from %v", s, len(rates), rates[:min(len(rates), 3)])
		}
	})
}
