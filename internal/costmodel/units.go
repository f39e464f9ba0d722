package costmodel

import (
	"math"
	"time"
)

// maxDurationNS is the largest Duration as a float64; longer times saturate.
const maxDurationNS = float64(math.MaxInt64)

// nonNeg converts a count to float64, clamping negatives to 0: a negative
// token or sequence count is a caller bug, and a cost model must not panic
// or return a negative time because of one.
func nonNeg(n int) float64 {
	if n < 0 {
		return 0
	}
	return float64(n)
}

// fromMS turns a non-empty batch's cost in milliseconds into a Duration,
// rounded to the nanosecond, at least 1 ns (so that Iteration is > 0 for every
// non-empty batch, as the Profile contract requires), and saturating at the
// largest Duration for absurd inputs instead of overflowing.
func fromMS(ms float64) time.Duration {
	return fromSeconds(ms / 1e3)
}

// fromSeconds is fromMS for a time in seconds.
func fromSeconds(s float64) time.Duration {
	ns := s * 1e9
	switch {
	case math.IsNaN(ns) || ns >= maxDurationNS:
		return time.Duration(math.MaxInt64)
	case ns < 1:
		return 1
	}
	return time.Duration(math.Round(ns))
}

// satAdd and satMul are int addition and multiplication of non-negative
// numbers that saturate at math.MaxInt instead of wrapping.
func satAdd(a, b int) int {
	if a > math.MaxInt-b {
		return math.MaxInt
	}
	return a + b
}

func satMul(a, b int) int {
	if a != 0 && b > math.MaxInt/a {
		return math.MaxInt
	}
	return a * b
}
