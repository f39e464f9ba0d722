package capacity

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// ErrRamp is wrapped by every error of ParseRamp.
var ErrRamp = errors.New("ramp")

// Ramp is the steps of a live capacity measurement (bench --slo-ramp):
// offered rates Start, Start+Step, ... up to Max, each held for Duration.
type Ramp struct {
	Start, Step, Max float64
	// Duration is how long each step sends; 0: the caller's default.
	Duration time.Duration
}

// MaxRampSteps bounds a ramp's steps: each is a live run.
const MaxRampSteps = 1000

// ParseRamp reads START:STEP:MAX[:DURATION], rates in requests per second
// (START > 0, STEP > 0, MAX ≥ START) and DURATION a positive Go duration,
// e.g. "2:2:20:60s" for 2, 4, ..., 20 req/s, a minute each.
func ParseRamp(s string) (Ramp, error) {
	parts := strings.Split(s, ":")
	if len(parts) < 3 || len(parts) > 4 {
		return Ramp{}, fmt.Errorf("%w %q: want START:STEP:MAX[:DURATION], e.g. 2:2:20:60s", ErrRamp, s)
	}
	var v [3]float64
	for i, name := range []string{"START", "STEP", "MAX"} {
		x, err := strconv.ParseFloat(parts[i], 64)
		if err != nil || !plainNumber(parts[i]) {
			return Ramp{}, fmt.Errorf("%w %q: %s %q is not a plain number of requests per second", ErrRamp, s, name, parts[i])
		}
		if !(x > 0) || math.IsInf(x, 0) {
			return Ramp{}, fmt.Errorf("%w %q: %s %g: want > 0", ErrRamp, s, name, x)
		}
		v[i] = x
	}
	r := Ramp{Start: v[0], Step: v[1], Max: v[2]}
	if r.Max < r.Start {
		return Ramp{}, fmt.Errorf("%w %q: MAX %g below START %g", ErrRamp, s, r.Max, r.Start)
	}
	if n := (r.Max-r.Start)/r.Step + 1; n > MaxRampSteps {
		return Ramp{}, fmt.Errorf("%w %q: %.0f steps, want at most %d", ErrRamp, s, n, MaxRampSteps)
	}
	if len(parts) == 4 {
		d, err := time.ParseDuration(parts[3])
		if err != nil {
			return Ramp{}, fmt.Errorf("%w %q: DURATION: %v", ErrRamp, s, err)
		}
		if d <= 0 {
			return Ramp{}, fmt.Errorf("%w %q: DURATION %v: want > 0", ErrRamp, s, d)
		}
		r.Duration = d
	}
	return r, nil
}

// Rates returns the ramp's rates, rising: Start + i·Step while ≤ Max
// (within a part in 10⁹, so 0.1 steps reach their Max).
func (r Ramp) Rates() []float64 {
	var out []float64
	for i := 0; i < MaxRampSteps; i++ {
		x := r.Start + float64(i)*r.Step
		if x > r.Max*(1+1e-9) {
			break
		}
		out = append(out, x)
	}
	return out
}

// Climb probes the ramp's rates in turn and stops at the first that misses
// the SLO: past capacity a live system only builds queues. The capacity is
// the last rate that met before it (0 when the first missed; AboveMax when
// none missed).
func Climb(rates []float64, probe func(rate float64) (bool, error)) (Outcome, error) {
	var o Outcome
	for _, r := range rates {
		met, err := probe(r)
		if err != nil {
			return o, fmt.Errorf("capacity: rate %g: %w", r, err)
		}
		o.Steps = append(o.Steps, Step{Rate: r, Met: met})
		if !met {
			o.BelowMin = o.Capacity == 0
			o.Converged = true
			return o, nil
		}
		o.Capacity = r
	}
	o.AboveMax = o.Capacity > 0
	return o, nil
}
