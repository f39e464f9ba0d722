package capacity

import (
	"errors"
	"slices"
	"testing"
)

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
