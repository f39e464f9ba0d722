package capacity

import (
	"context"
	"errors"
	"fmt"
	"math"
)

// Config bounds a capacity search.
type Config struct {
	// Start is the first rate probed, in requests per second.
	Start float64
	// Tolerance is the relative precision the bisection stops at: the
	// search ends when the lowest rate known to miss is within
	// (1 + Tolerance) × the highest known to meet.
	Tolerance float64
	// MaxRate caps the doubling: when it meets the SLO, the capacity is
	// reported as at least MaxRate (Outcome.AboveMax).
	MaxRate float64
	// MinRate floors the halving: when it misses, the capacity is 0
	// (Outcome.BelowMin).
	MinRate float64
	// MaxProbes bounds the runs of one search (each a full simulation or
	// a live step); the bisection stops early when it is reached.
	MaxProbes int
}

// DefaultConfig starts at 10 requests/s, stops within 5%, probes at most 24
// rates between 0.01 and 100,000 requests/s.
func DefaultConfig() Config {
	return Config{Start: 10, Tolerance: 0.05, MaxRate: 1e5, MinRate: 0.01, MaxProbes: 24}
}

// Validate reports the first invalid setting.
func (c Config) Validate() error {
	switch {
	case !(c.Start > 0) || math.IsInf(c.Start, 0):
		return fmt.Errorf("capacity: start rate %g: want > 0", c.Start)
	case !(c.Tolerance > 0) || c.Tolerance >= 1:
		return fmt.Errorf("capacity: tolerance %g: want in (0, 1)", c.Tolerance)
	case !(c.MinRate > 0) || c.MinRate > c.Start:
		return fmt.Errorf("capacity: min rate %g: want in (0, start %g]", c.MinRate, c.Start)
	case !(c.MaxRate >= c.Start) || math.IsInf(c.MaxRate, 0):
		return fmt.Errorf("capacity: max rate %g: want finite and ≥ start %g", c.MaxRate, c.Start)
	case c.MaxProbes < 2:
		return fmt.Errorf("capacity: max probes %d: want ≥ 2", c.MaxProbes)
	}
	return nil
}

// Probe runs the system at rate requests per second and says whether it met
// the SLO. A search assumes it is monotone: met at r, met at every rate
// below r.
type Probe func(ctx context.Context, rate float64) (met bool, err error)

// Step is one probed rate.
type Step struct {
	Rate float64
	Met  bool
}

// Outcome is a search's answer.
type Outcome struct {
	// Capacity is the highest rate probed that met the SLO; 0 when none
	// did.
	Capacity float64
	// Steps are the rates probed, in the order probed.
	Steps []Step
	// AboveMax: MaxRate met, so Capacity is a lower bound. BelowMin: not
	// even MinRate met.
	AboveMax, BelowMin bool
	// Converged: the bisection reached Tolerance (false when MaxProbes
	// stopped it, or the search ended at a bound).
	Converged bool
}

// ErrProbes is returned when MaxProbes ends a search before it found any
// rate that meets and any that misses.
var ErrProbes = errors.New("capacity: out of probes before bracketing the capacity")

// Search finds the highest rate at which probe meets the SLO: it probes
// Start, doubles while met (up to MaxRate) or halves while missed (down to
// MinRate) until it holds a rate that meets and one that misses, then
// bisects between them until they are within Tolerance. With a monotone
// probe the capacity C it returns met, and the true boundary lies in
// [C, C·(1+Tolerance)]. Errors of probe end the search and are returned
// with the steps so far.
func Search(ctx context.Context, c Config, probe Probe) (Outcome, error) {
	var o Outcome
	if err := c.Validate(); err != nil {
		return o, err
	}
	try := func(r float64) (bool, error) {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if len(o.Steps) >= c.MaxProbes {
			return false, ErrProbes
		}
		met, err := probe(ctx, r)
		if err != nil {
			return false, fmt.Errorf("capacity: rate %g: %w", r, err)
		}
		o.Steps = append(o.Steps, Step{Rate: r, Met: met})
		return met, nil
	}
	lo, hi := 0.0, 0.0 // highest known to meet, lowest known to miss
	met, err := try(c.Start)
	if err != nil {
		return o, err
	}
	if met {
		lo = c.Start
		for hi == 0 {
			if lo >= c.MaxRate {
				o.Capacity, o.AboveMax = lo, true
				return o, nil
			}
			r := min(2*lo, c.MaxRate)
			if met, err = try(r); err != nil {
				return o, err
			}
			if met {
				lo = r
			} else {
				hi = r
			}
		}
	} else {
		hi = c.Start
		for lo == 0 {
			if hi <= c.MinRate {
				o.BelowMin = true
				return o, nil
			}
			r := max(hi/2, c.MinRate)
			if met, err = try(r); err != nil {
				return o, err
			}
			if met {
				lo = r
			} else {
				hi = r
			}
		}
	}
	o.Capacity = lo
	for hi-lo > c.Tolerance*lo {
		if len(o.Steps) >= c.MaxProbes {
			return o, nil
		}
		mid := (lo + hi) / 2
		if met, err = try(mid); err != nil {
			return o, err
		}
		if met {
			lo = mid
		} else {
			hi = mid
		}
		o.Capacity = lo
	}
	o.Converged = true
	return o, nil
}
