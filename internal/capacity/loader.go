package capacity

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/workload"
)

// Loader returns one workload at any offered rate, so that every probe of
// a search runs the same requests. Poisson and gamma arrivals are drawn
// again at the rate from the same seed (the same requests, their gaps
// scaled); traces, ramps and replayed timestamps keep their shape and are
// compressed or stretched in time so that they offer the rate, (n−1)/span.
type Loader struct {
	f      workload.Flags
	base   []workload.Request
	native float64 // base's offered rate; 0: redraw at each rate
	// Start is the rate the flags give the workload at: --rate, or a
	// trace's own.
	Start float64
	// Skipped are the malformed trace lines skipped.
	Skipped []workload.LineError
}

// NewLoader loads f once and prepares to offer it at any rate.
func NewLoader(f workload.Flags) (*Loader, error) {
	reqs, skipped, err := f.Load()
	if err != nil {
		return nil, err
	}
	if len(reqs) < 2 {
		return nil, fmt.Errorf("capacity: the workload has %d requests; a search over rates needs at least 2", len(reqs))
	}
	l := &Loader{f: f, base: reqs, Start: f.Arrival.Rate, Skipped: skipped}
	p := f.Arrival.Process
	if p != workload.ArrivalPoisson && p != workload.ArrivalGamma && (p != workload.ArrivalAuto || f.Trace != "") {
		span := (reqs[len(reqs)-1].Arrival - reqs[0].Arrival).Seconds()
		if span <= 0 {
			return nil, errors.New("capacity: every request of the workload arrives at once; a search over rates needs arrivals spread in time")
		}
		l.native = float64(len(reqs)-1) / span
		l.Start = l.native
	}
	return l, nil
}

// At returns the workload offered at rate requests per second.
func (l *Loader) At(rate float64) ([]workload.Request, error) {
	if !(rate > 0) || math.IsInf(rate, 0) {
		return nil, fmt.Errorf("capacity: rate %g: want > 0", rate)
	}
	if l.native == 0 {
		f := l.f
		f.Arrival.Rate = rate
		reqs, _, err := f.Load()
		return reqs, err
	}
	out := slices.Clone(l.base)
	k := l.native / rate
	t0 := out[0].Arrival
	for i := range out {
		out[i].Arrival = t0 + time.Duration(math.Round(float64(out[i].Arrival-t0)*k))
	}
	return out, nil
}
