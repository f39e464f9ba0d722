// Package report turns the per-request measurements of a run (from the
// simulator or from the load generator) into the results prefixlb prints and
// writes: percentile summaries, the --json results file, a per-request CSV, a
// text table and an SVG chart in the style of Preble's figures.
package report

import (
	"math"
	"slices"
)

// Summary is the mean and the 50th, 90th and 99th percentiles of one measure.
// Where it appears under a *_ms JSON name its values are milliseconds.
type Summary struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

// Samples collects the values of one measure and computes exact statistics
// over them. The zero value is empty and ready to use. Samples keeps every
// value (8 bytes each), which is fine for the ≤1e6 requests of a run.
//
// Samples is not safe for concurrent use.
type Samples struct {
	v      []float64
	sorted bool
}

// Add records one value. NaN values are ignored.
func (s *Samples) Add(v float64) {
	if math.IsNaN(v) {
		return
	}
	s.v = append(s.v, v)
	s.sorted = false
}

// Len returns the number of values recorded.
func (s *Samples) Len() int { return len(s.v) }

// Mean returns the arithmetic mean of the values, or 0 when there are none.
func (s *Samples) Mean() float64 {
	if len(s.v) == 0 {
		return 0
	}
	var sum float64
	for _, x := range s.v {
		sum += x
	}
	return sum / float64(len(s.v))
}

// Percentile returns the p-th percentile (p in [0, 100], clamped) of the
// values, or 0 when there are none. See [Percentile] for the method.
func (s *Samples) Percentile(p float64) float64 {
	if !s.sorted {
		slices.Sort(s.v)
		s.sorted = true
	}
	return Percentile(s.v, p)
}

// Summary returns the mean, p50, p90 and p99 of the values (all 0 when there
// are none).
func (s *Samples) Summary() Summary {
	return Summary{
		Mean: s.Mean(),
		P50:  s.Percentile(50),
		P90:  s.Percentile(90),
		P99:  s.Percentile(99),
	}
}

// Summarize returns the Summary of values without modifying the slice.
func Summarize(values []float64) Summary {
	s := Samples{v: slices.Clone(values)}
	return s.Summary()
}

// Percentile returns the p-th percentile (p in [0, 100], clamped) of sorted,
// which must be in ascending order; 0 for an empty slice.
//
// It interpolates linearly between the two closest ranks: with n values the
// percentile sits at rank h = (n−1)·p/100 and is
// sorted[⌊h⌋] + (h−⌊h⌋)·(sorted[⌊h⌋+1] − sorted[⌊h⌋]). This is numpy's default
// ("linear", Hyndman & Fan type 7), the method vLLM's benchmark_serving.py
// reports with np.percentile, so prefixlb bench and vLLM's own benchmark agree
// on the same samples.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	p = min(max(p, 0), 100)
	h := float64(n-1) * p / 100
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	frac := h - float64(lo)
	return sorted[lo] + frac*(sorted[lo+1]-sorted[lo])
}
