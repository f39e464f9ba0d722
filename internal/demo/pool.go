package demo

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
)

// llamaRun is one llama.cpp run of one policy.
type llamaRun struct {
	out     loadgen.Output
	prefill map[string]float64 // replica → llamacpp:prompt_seconds_total
	prompt  map[string]float64 // replica → llamacpp:prompt_tokens_total
	cal     []report.CalibrationFit
}

// poolLabels are what a pooled result says of the runs.
type poolLabels struct {
	Rate     float64
	Workload string
	Replicas int
	Profile  string
}

// poolRuns summarises a policy's runs as one result: the requests of every
// round pooled, their elapsed times added, prefill seconds and tokens per
// replica summed (a replica that served no request still gets its row),
// rows sorted by replica, and what the router learnt in the last round.
func poolRuns(pol string, runs []llamaRun, l poolLabels) report.Result {
	var recs []report.RequestRecord
	var dur time.Duration
	prefill := map[string]float64{}
	prompt := map[string]float64{}
	for _, r := range runs {
		recs = append(recs, r.out.Records...)
		dur += r.out.Elapsed
		for k, v := range r.prefill {
			prefill[k] += v
		}
		for k, v := range r.prompt {
			prompt[k] += v
		}
	}
	res := report.Build(pol, l.Rate, recs, dur)
	res.Workload = l.Workload
	res.Replicas = l.Replicas
	res.Profile = l.Profile
	if n := len(runs); n > 0 && len(runs[n-1].cal) > 0 {
		// What the router learnt in the last round (each round starts
		// fresh servers and a fresh router).
		res.Calibrated, res.Calibration = true, runs[n-1].cal
	}
	names := make([]string, 0, len(prefill))
	for k := range prefill {
		names = append(names, k)
	}
	sort.Strings(names)
	byName := map[string]int{}
	for i, pr := range res.PerReplica {
		byName[pr.Replica] = i
	}
	for _, n := range names {
		i, ok := byName[n]
		if !ok {
			res.PerReplica = append(res.PerReplica, report.ReplicaResult{Replica: n})
			i = len(res.PerReplica) - 1
		}
		res.PerReplica[i].PrefillSeconds = prefill[n]
		res.PerReplica[i].PrefillTokens = int(prompt[n])
	}
	sort.Slice(res.PerReplica, func(a, b int) bool { return res.PerReplica[a].Replica < res.PerReplica[b].Replica })
	return res
}

// writePrefillTable prints each policy's prefill seconds per replica (from
// llamacpp:prompt_seconds_total) and the busiest replica's share.
func writePrefillTable(w io.Writer, results []report.Result) {
	fmt.Fprintln(w, "prefill seconds per replica (llamacpp:prompt_seconds_total), and max/min over replicas:")
	for _, r := range results {
		var parts []string
		lo, hi, total := -1.0, 0.0, 0.0
		for _, pr := range r.PerReplica {
			parts = append(parts, fmt.Sprintf("%s %.1f", pr.Replica, pr.PrefillSeconds))
			if lo < 0 || pr.PrefillSeconds < lo {
				lo = pr.PrefillSeconds
			}
			hi = max(hi, pr.PrefillSeconds)
			total += pr.PrefillSeconds
		}
		ratio := "inf"
		if lo > 0 {
			ratio = fmt.Sprintf("%.2f", hi/lo)
		}
		fmt.Fprintf(w, "  %-14s total %6.1f s: %s; max/min %s\n", r.Policy, total, strings.Join(parts, ", "), ratio)
	}
}

// llamaRecord is one line of --records: a request's record, the round it
// ran in, and llama.cpp's timings of it (nil: none).
type llamaRecord struct {
	report.RequestRecord
	Round   int              `json:"round"`
	Timings *loadgen.Timings `json:"timings"`
}

// writeRecords writes every run's requests to path as JSON lines, policy by
// policy in pols' order, round by round.
func writeRecords(path string, pols []string, runs map[string][]llamaRun) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("demo: --records: %w", err)
	}
	enc := json.NewEncoder(f)
	for _, pol := range pols {
		for round, r := range runs[pol] {
			for i, rec := range r.out.Records {
				lr := llamaRecord{RequestRecord: rec, Round: round}
				if i < len(r.out.Timings) {
					lr.Timings = r.out.Timings[i]
				}
				if err := enc.Encode(lr); err != nil {
					f.Close()
					return fmt.Errorf("demo: --records: %w", err)
				}
			}
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("demo: --records: %w", err)
	}
	return nil
}
