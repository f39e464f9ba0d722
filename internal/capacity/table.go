package capacity

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/prefixlb/prefixlb/internal/report"
)

// Policy is one policy's (or one live target's) measured capacity: the
// search's outcome and the result of every rate it ran, each annotated
// with the SLO's verdict (SLO.Annotate).
type Policy struct {
	Name    string
	Outcome Outcome
	// Points are the runs, rising in rate once Mark has run.
	Points []report.Result
}

// Mark writes the outcome into every point (capacity_rps, at_capacity,
// capacity_above_max) and sorts the points by rate.
func (p *Policy) Mark() {
	for i := range p.Points {
		c := p.Outcome.Capacity
		p.Points[i].CapacityRPS = &c
		p.Points[i].CapacityAboveMax = p.Outcome.AboveMax
		p.Points[i].AtCapacity = c > 0 && p.Points[i].Rate == c
	}
	slices.SortStableFunc(p.Points, func(a, b report.Result) int { return cmp.Compare(a.Rate, b.Rate) })
}

// AtCapacity returns the run at the capacity, false when no rate met.
func (p Policy) AtCapacity() (report.Result, bool) {
	for _, r := range p.Points {
		if r.AtCapacity {
			return r, true
		}
	}
	return report.Result{}, false
}

// VerdictLine renders each target's percentile against its limit and
// whether the SLO held: "ttft_p90 1834 ms ≤ 2s: met".
func VerdictLine(slo SLO, v Verdict) string {
	var b strings.Builder
	for i, t := range slo {
		if i > 0 {
			b.WriteString(", ")
		}
		op := "≤"
		if !(v.Observed[i] <= ms(t.Limit)) {
			op = ">"
		}
		fmt.Fprintf(&b, "%s_p%g %s ms %s %v", t.Metric, t.Percentile, fmtMs(v.Observed[i]), op, t.Limit)
	}
	op := "≥"
	if v.Sustained < MinSustained {
		op = "<"
	}
	fmt.Fprintf(&b, ", sustained %.2f %s %g", v.Sustained, op, MinSustained)
	if v.Met {
		b.WriteString(": met")
	} else {
		b.WriteString(": missed")
	}
	return b.String()
}

func fmtMs(x float64) string {
	if math.IsInf(x, 1) {
		return "∞"
	}
	return fmt.Sprintf("%.0f", x)
}

func observedMs(o report.SLOObservation) string {
	if o.ObservedMs == nil {
		return "∞"
	}
	return fmtMs(*o.ObservedMs)
}

// CapacityString renders a capacity: "≥ 120" when the search's highest
// rate still met, "0" when not even its lowest did.
func (p Policy) CapacityString() string {
	s := fmt.Sprintf("%.3g", p.Outcome.Capacity)
	if p.Outcome.AboveMax {
		s = "≥ " + s
	}
	return s
}

// WriteTable prints one line per policy: its capacity, the SLO's
// percentiles and the goodput at it, its hit ratio there, and how many
// rates were run.
func WriteTable(w io.Writer, slo SLO, ps []Policy) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "  policy\tcapacity_rps\t")
	for _, t := range slo {
		fmt.Fprintf(tw, "%s_p%g ms\t", t.Metric, t.Percentile)
	}
	fmt.Fprint(tw, "goodput_rps\thit\truns\t\n")
	for _, p := range ps {
		r, ok := p.AtCapacity()
		fmt.Fprintf(tw, "  %s\t%s\t", p.Name, p.CapacityString())
		for i := range slo {
			if !ok {
				fmt.Fprint(tw, "-\t")
				continue
			}
			fmt.Fprintf(tw, "%s\t", observedMs(r.SLOObserved[i]))
		}
		if ok {
			fmt.Fprintf(tw, "%.3g\t%.3f\t%d\t\n", *r.GoodputRPS, r.PrefixHitRatio, len(p.Outcome.Steps))
		} else {
			fmt.Fprintf(tw, "-\t-\t%d\t\n", len(p.Outcome.Steps))
		}
	}
	return tw.Flush()
}

// WriteSweep prints every rate run of every policy, rising: whether the SLO
// held, its percentiles, the goodput and the throughput.
func WriteSweep(w io.Writer, slo SLO, ps []Policy) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "  policy\trate\tslo\t")
	for _, t := range slo {
		fmt.Fprintf(tw, "%s_p%g ms\t", t.Metric, t.Percentile)
	}
	fmt.Fprint(tw, "goodput_rps\tthroughput_rps\tsustained\t\n")
	for _, p := range ps {
		for _, r := range p.Points {
			met := "missed"
			if r.SLOMet != nil && *r.SLOMet {
				met = "met"
			}
			if r.AtCapacity {
				met = "met *"
			}
			fmt.Fprintf(tw, "  %s\t%.4g\t%s\t", p.Name, r.Rate, met)
			for i := range slo {
				if i < len(r.SLOObserved) {
					fmt.Fprintf(tw, "%s\t", observedMs(r.SLOObserved[i]))
				} else {
					fmt.Fprint(tw, "-\t")
				}
			}
			good := 0.0
			if r.GoodputRPS != nil {
				good = *r.GoodputRPS
			}
			sus := "-"
			if r.SLOSustained != nil {
				sus = fmt.Sprintf("%.2f", *r.SLOSustained)
			}
			fmt.Fprintf(tw, "%.3g\t%.3g\t%s\t\n", good, r.ThroughputRPS, sus)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "  (* at capacity)")
	return err
}
