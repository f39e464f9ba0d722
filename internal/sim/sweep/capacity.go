package sweep

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prefixlb/prefixlb/internal/capacity"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// PolicyCapacity is one policy's capacity search: its outcome and the
// result of every rate it simulated, in the order simulated.
type PolicyCapacity struct {
	Policy  string
	Outcome capacity.Outcome
	Points  []report.Result
	// records are the requests of the run at capacity (for --out).
	records []report.RequestRecord
}

// AtCapacity returns the run at the policy's capacity, false when no rate
// met the SLO.
func (p PolicyCapacity) AtCapacity() (report.Result, bool) {
	for _, r := range p.Points {
		if r.AtCapacity {
			return r, true
		}
	}
	return report.Result{}, false
}

// Loader returns the workload at any offered rate. Poisson and gamma
// arrivals are drawn again at the rate, from the same seed (the same
// requests, their gaps scaled); traces, ramps and replayed timestamps keep
// their shape and are compressed or stretched in time so that they offer
// the rate, (n−1)/span. Start is the rate the flags give: --rate, or a
// trace's own.
type Loader struct {
	f      workload.Flags
	base   []workload.Request
	native float64 // base's offered rate; 0: redraw at each rate
	// Start is the rate the workload is given at.
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
		return nil, fmt.Errorf("sim: the workload has %d requests; a capacity search needs at least 2", len(reqs))
	}
	l := &Loader{f: f, base: reqs, Start: f.Arrival.Rate, Skipped: skipped}
	p := f.Arrival.Process
	if p != workload.ArrivalPoisson && p != workload.ArrivalGamma && (p != workload.ArrivalAuto || f.Trace != "") {
		span := (reqs[len(reqs)-1].Arrival - reqs[0].Arrival).Seconds()
		if span <= 0 {
			return nil, errors.New("sim: every request of the workload arrives at once; a capacity search needs arrivals spread in time")
		}
		l.native = float64(len(reqs)-1) / span
		l.Start = l.native
	}
	return l, nil
}

// At returns the workload offered at rate requests per second.
func (l *Loader) At(rate float64) ([]workload.Request, error) {
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

// SearchConfig is the capacity search a sweep runs from its flags:
// starting at start, within SLOTolerance, up to SLOMaxRate (0: 1,024 ×
// start), down to start / 1,024.
func (c *Config) SearchConfig(start float64) capacity.Config {
	sc := capacity.DefaultConfig()
	sc.Start = start
	if c.SLOTolerance > 0 {
		sc.Tolerance = c.SLOTolerance
	}
	sc.MaxRate = 1024 * start
	if c.SLOMaxRate > 0 {
		sc.MaxRate = c.SLOMaxRate
	}
	sc.MinRate = start / 1024
	return sc
}

// Capacities searches the capacity at slo of every policy of c on l's
// workload: each probe a full simulation of the same requests at another
// rate. Progress goes to stderr unless c.Quiet.
func (c *Config) Capacities(ctx context.Context, su *setup, slo capacity.SLO, l *Loader, stderr io.Writer) ([]PolicyCapacity, error) {
	sc := c.SearchConfig(l.Start)
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("sim: --slo search: %w", err)
	}
	var out []PolicyCapacity
	for _, spec := range su.specs {
		pc := PolicyCapacity{Policy: spec}
		recs := map[float64][]report.RequestRecord{}
		probe := func(ctx context.Context, rate float64) (bool, error) {
			reqs, err := l.At(rate)
			if err != nil {
				return false, err
			}
			rn, err := c.simulate(ctx, su, spec, rate, reqs, stderr)
			if err != nil {
				return false, err
			}
			r := Result(rn.name, rate, rn.res, c.labels(su, rn.local), OracleTTFT(reqs, su.sp.Fastest(), su.rc.BlockSize))
			v := slo.Judge(rn.res.Records, r.DurationS)
			slo.Annotate(&r, v)
			pc.Points = append(pc.Points, r)
			if v.Met {
				recs[rate] = rn.res.Records
			}
			if !c.Quiet {
				fmt.Fprintf(stderr, "%-24s rate %-8.4g %s, goodput %.3g req/s\n", spec, rate, VerdictLine(slo, v), v.GoodputRPS)
			}
			return v.Met, nil
		}
		o, err := capacity.Search(ctx, sc, probe)
		if err != nil {
			return nil, fmt.Errorf("sim: %s: %w", spec, err)
		}
		pc.Outcome = o
		for i := range pc.Points {
			capRPS := o.Capacity
			pc.Points[i].CapacityRPS = &capRPS
			pc.Points[i].CapacityAboveMax = o.AboveMax
			pc.Points[i].AtCapacity = o.Capacity > 0 && pc.Points[i].Rate == o.Capacity
		}
		pc.records = recs[o.Capacity]
		slices.SortStableFunc(pc.Points, func(a, b report.Result) int { return cmp.Compare(a.Rate, b.Rate) })
		out = append(out, pc)
	}
	return out, nil
}

// VerdictLine renders each target's percentile against its limit and
// whether the SLO held: "ttft_p90 1834 ms ≤ 2s: met".
func VerdictLine(slo capacity.SLO, v capacity.Verdict) string {
	var b strings.Builder
	for i, t := range slo {
		if i > 0 {
			b.WriteString(", ")
		}
		op := "≤"
		if !(v.Observed[i] <= float64(t.Limit)/float64(time.Millisecond)) {
			op = ">"
		}
		fmt.Fprintf(&b, "%s_p%g %s ms %s %v", t.Metric, t.Percentile, fmtObserved(v.Observed[i]), op, t.Limit)
	}
	if v.Met {
		b.WriteString(": met")
	} else {
		b.WriteString(": missed")
	}
	return b.String()
}

func fmtObserved(x float64) string {
	if math.IsInf(x, 1) {
		return "∞"
	}
	return fmt.Sprintf("%.0f", x)
}

// RunCapacity is `prefixlb sim --slo`: the capacity at c.SLO of every
// policy, each a search over rates (internal/capacity) whose every probe
// simulates the same workload at another rate. It prints the capacities,
// the goodput along each search and the table of the runs at capacity;
// the JSON holds every run, with capacity_rps and goodput_rps.
func RunCapacity(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	slo, err := capacity.ParseSLO(c.SLO)
	if err != nil {
		return fmt.Errorf("sim: --slo: %w", err)
	}
	if c.Rates != "" {
		return errors.New("sim: --rates and --slo: the capacity search chooses the rates (--rate sets where it starts)")
	}
	su, err := c.prepare()
	if err != nil {
		return err
	}
	l, err := NewLoader(c.Workload)
	if err != nil {
		return err
	}
	for _, le := range l.Skipped {
		fmt.Fprintln(stderr, "skipped:", le.Error())
	}
	pcs, err := c.Capacities(ctx, su, slo, l, stderr)
	if err != nil {
		return err
	}
	return WriteCapacity(stdout, stderr, c, slo, pcs)
}

// WriteCapacity prints the capacity table, the goodput along each search
// and the runs at capacity, and writes the JSON (every run) and --out
// files (the runs at capacity and their requests).
func WriteCapacity(stdout, stderr io.Writer, c Config, slo capacity.SLO, pcs []PolicyCapacity) error {
	var all, atCap []report.Result
	var records []report.RequestRecord
	for _, pc := range pcs {
		all = append(all, pc.Points...)
		if r, ok := pc.AtCapacity(); ok {
			atCap = append(atCap, r)
			records = append(records, pc.records...)
		}
	}
	if c.JSONPath != "-" {
		tol := c.SearchConfig(1).Tolerance
		fmt.Fprintf(stdout, "capacity at %s (bisection to %g%%; %s):\n", slo, 100*tol, c.Workload.Describe())
		if err := WriteCapacityTable(stdout, slo, pcs); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "\ngoodput along each search (req/s that met every limit):")
		if err := WriteSweepTable(stdout, slo, pcs); err != nil {
			return err
		}
		if len(atCap) > 0 {
			fmt.Fprintln(stdout, "\nat capacity:")
			if err := report.WriteTable(stdout, atCap); err != nil {
				return err
			}
		}
	}
	if c.JSONPath == "-" {
		return WriteJSON(stdout, c.Engine, all)
	}
	if c.JSONPath != "" {
		if err := WriteJSONFile(c.JSONPath, c.Engine, all); err != nil {
			return err
		}
	}
	if c.OutDir != "" {
		if err := WriteJSONFile(filepath.Join(c.OutDir, "results.json"), c.Engine, all); err != nil {
			return err
		}
		if err := report.WriteCSVFile(filepath.Join(c.OutDir, "requests.csv"), records); err != nil {
			return err
		}
		if err := report.WriteChartFile(filepath.Join(c.OutDir, "chart.svg"), all); err != nil {
			return err
		}
		if err := report.WriteHTMLFile(filepath.Join(c.OutDir, "report.html"), atCap, records); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote %s/{results.json,requests.csv,chart.svg,report.html}\n", c.OutDir)
	}
	return nil
}

// WriteCapacityTable prints one line per policy: its capacity, the SLO's
// percentiles and the goodput at it, its hit ratio there, and how many
// rates the search simulated.
func WriteCapacityTable(w io.Writer, slo capacity.SLO, pcs []PolicyCapacity) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "  policy\tcapacity_rps\t")
	for _, t := range slo {
		fmt.Fprintf(tw, "%s_p%g ms\t", t.Metric, t.Percentile)
	}
	fmt.Fprint(tw, "goodput_rps\thit\tprobes\t\n")
	for _, pc := range pcs {
		r, ok := pc.AtCapacity()
		capStr := fmt.Sprintf("%.3g", pc.Outcome.Capacity)
		if pc.Outcome.AboveMax {
			capStr = "≥ " + capStr
		}
		fmt.Fprintf(tw, "  %s\t%s\t", pc.Policy, capStr)
		for i := range slo {
			if !ok {
				fmt.Fprint(tw, "-\t")
				continue
			}
			fmt.Fprintf(tw, "%s\t", observedMs(r.SLOObserved[i]))
		}
		if ok {
			fmt.Fprintf(tw, "%.3g\t%.3f\t%d\t\n", *r.GoodputRPS, r.PrefixHitRatio, len(pc.Outcome.Steps))
		} else {
			fmt.Fprintf(tw, "-\t-\t%d\t\n", len(pc.Outcome.Steps))
		}
	}
	return tw.Flush()
}

// WriteSweepTable prints every simulated rate of every policy, in rising
// rate: whether the SLO held, its percentiles and the goodput.
func WriteSweepTable(w io.Writer, slo capacity.SLO, pcs []PolicyCapacity) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "  policy\trate\tslo\t")
	for _, t := range slo {
		fmt.Fprintf(tw, "%s_p%g ms\t", t.Metric, t.Percentile)
	}
	fmt.Fprint(tw, "goodput_rps\tthroughput_rps\t\n")
	for _, pc := range pcs {
		for _, r := range pc.Points {
			met := "missed"
			if r.SLOMet != nil && *r.SLOMet {
				met = "met"
			}
			if r.AtCapacity {
				met = "met *"
			}
			fmt.Fprintf(tw, "  %s\t%.4g\t%s\t", pc.Policy, r.Rate, met)
			for i := range slo {
				fmt.Fprintf(tw, "%s\t", observedMs(r.SLOObserved[i]))
			}
			fmt.Fprintf(tw, "%.3g\t%.3g\t\n", *r.GoodputRPS, r.ThroughputRPS)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "  (* at capacity)")
	return err
}

func observedMs(o report.SLOObservation) string {
	if o.ObservedMs == nil {
		return "∞"
	}
	return fmt.Sprintf("%.0f", *o.ObservedMs)
}
