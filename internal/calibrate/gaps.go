package calibrate

import (
	"slices"
	"time"
)

// gapsKept bounds the gaps a Gaps keeps: a long stream is thinned to every
// second, fourth, ... gap so that the sample still spans it evenly.
const gapsKept = 128

// Gaps samples the gaps between a stream's tokens for their median (the
// ITL of a Report): front doors call Token as each token arrives. The zero
// value is ready; it keeps at most 128 gaps, evenly spread over the stream
// however long. Not safe for concurrent use.
type Gaps struct {
	last   time.Time
	n      int // gaps seen
	stride int // keep every stride-th gap (a power of two; 0 means 1)
	kept   []time.Duration
}

// Token records a token that arrived at now.
func (g *Gaps) Token(now time.Time) {
	if g.last.IsZero() {
		g.last = now
		return
	}
	d := now.Sub(g.last)
	g.last = now
	if d < 0 {
		return
	}
	if g.stride == 0 {
		g.stride = 1
	}
	g.n++
	if g.n%g.stride != 0 {
		return
	}
	if len(g.kept) == gapsKept {
		// Keep every other gap and every other one from now on.
		k := 0
		for i := 1; i < len(g.kept); i += 2 {
			g.kept[k] = g.kept[i]
			k++
		}
		g.kept = g.kept[:k]
		g.stride *= 2
		if g.n%g.stride != 0 {
			return
		}
	}
	g.kept = append(g.kept, d)
}

// Median returns the median gap and the number of gaps seen (0, 0 when
// fewer than two tokens arrived).
func (g *Gaps) Median() (time.Duration, int) {
	if len(g.kept) == 0 {
		return 0, 0
	}
	s := slices.Clone(g.kept)
	slices.Sort(s)
	return s[len(s)/2], g.n
}
