package demo

import (
	"fmt"
	"io"

	"github.com/prefixlb/prefixlb/internal/report"
)

// label labels the result of one modelled run, in the modelled GPU's time.
func label(c Config, profile string, res report.Result) report.Result {
	// Report times in the modelled GPU's time, so figures compare with sim.
	scaleResult(&res, c.Speedup)
	res.Rate = c.Workload.Arrival.Rate
	res.Workload = c.Workload.Describe()
	res.Replicas = c.Replicas
	res.Profile = profile
	return res
}

// compare prints the comparison of the modelled runs (and writes --json).
func compare(c Config, results []report.Result, stdout io.Writer) error {
	fmt.Fprintln(stdout)
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n  ttft_ms: time to first token, latency_ms: to the last token, in ms of the modelled GPU's time;\n"+
		"  hit: share of prompt tokens the replicas served from their prefix cache (cached tokens reported / prompt tokens);\n"+
		"  req/s, tok/s: requests completed and tokens generated per second%s\n", scaleNote(c.Speedup))
	if len(results) >= 2 {
		a, b := results[0], results[len(results)-1]
		if b.TTFT.Mean > 0 && b.TTFT.P99 > 0 {
			fmt.Fprintf(stdout, "\n%s vs %s: mean TTFT %.2fx lower, p99 TTFT %.2fx lower, mean latency %.2fx lower\n",
				b.Policy, a.Policy, a.TTFT.Mean/b.TTFT.Mean, a.TTFT.P99/b.TTFT.P99, a.Latency.Mean/max(b.Latency.Mean, 1e-9))
		}
	}
	return writeJSON(c.JSONPath, stdout, results)
}

// speedNote says how fast the modelled GPUs run against real time
// (--speedup), to three significant figures.
func speedNote(x float64) string {
	if x == 1 {
		return "modelled GPUs at real speed (--speedup 1)"
	}
	return fmt.Sprintf("modelled GPUs run %.3g× as fast as real time (--speedup %.3g)", x, x)
}

// scaleNote is the legend's remark on a time-scaled run.
func scaleNote(x float64) string {
	if x == 1 {
		return ""
	}
	return fmt.Sprintf(";\n  the run went %.3g× as fast as real time (--speedup): every figure is converted back to the modelled GPU's time", x)
}

// scaleResult converts wall-clock figures of a run x times faster than the
// modelled GPU back into the modelled GPU's time.
func scaleResult(r *report.Result, x float64) {
	if x == 1 {
		return
	}
	sums := []*report.Summary{&r.TTFT, &r.Latency, &r.TPOT}
	if r.PD != nil {
		sums = append(sums, &r.PD.TTFTDisaggregated, &r.PD.TTFTLocal)
	}
	for _, s := range sums {
		s.Mean, s.P50, s.P90, s.P99 = s.Mean*x, s.P50*x, s.P90*x, s.P99*x
	}
	if r.ITL != nil {
		r.ITL.Mean, r.ITL.P50, r.ITL.P90, r.ITL.P99 = r.ITL.Mean*x, r.ITL.P50*x, r.ITL.P90*x, r.ITL.P99*x
	}
	r.ThroughputRPS /= x
	r.OutputTokensPerS /= x
	r.DurationS *= x
}
