package capacity

import "fmt"

// Climb judges rising rates in turn — the stages of a live ramp (bench
// --slo --ramp) — and stops at the first that misses the SLO: past
// capacity a live system only builds queues. The capacity is the last rate
// that met before it, so every lower rate met too (0 when the first
// missed: BelowMin; AboveMax when none missed). probe may block until the
// rate's measurement is over.
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
