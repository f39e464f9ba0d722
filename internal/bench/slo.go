package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/prefixlb/prefixlb/internal/capacity"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// SplitStages cuts ramp arrivals into the stages of stages: stage k holds
// the requests scheduled in [start_k, start_k + Duration_k), in order.
// Requests scheduled after the last stage are dropped.
func SplitStages(reqs []workload.Request, stages []workload.Stage) [][]workload.Request {
	out := make([][]workload.Request, len(stages))
	ends := make([]time.Duration, len(stages))
	var t time.Duration
	for k, s := range stages {
		t += s.Duration
		ends[k] = t
	}
	for _, r := range reqs {
		for k, end := range ends {
			if r.Arrival < end {
				out[k] = append(out[k], r)
				break
			}
		}
	}
	return out
}

// stageRun is what one stage's load generator returned.
type stageRun struct {
	out loadgen.Output
	err error
}

// RunSLO is `prefixlb bench --slo ... --ramp ...`: a live capacity
// measurement. Each stage of the ramp ("rate:duration,...", rising rates)
// is one step at its rate. The stages follow each other without a pause,
// as one Poisson ramp (workload.Ramp), and a request belongs to the stage
// it is sent in (its scheduled time; send_lag_ms says how late the client
// was): each stage's requests go out through a load generator of their own
// (loadgen.Run, MaxInFlight per stage), so a stage's TTFTs include the
// load of the previous stage's requests still in flight, as on the server.
//
// Once every request of a stage has finished, its records are judged
// (capacity.SLO.Judge: the SLO's percentiles and goodput, vLLM's
// benchmark_serving --goodput definition) and a line goes to stderr. The
// first stage that misses ends the run (the later stages are cancelled:
// past capacity a live system only builds queues) unless c.SLOKeepGoing.
// The capacity (capacity.Climb) is the highest stage rate that met the SLO
// with every lower stage meeting it too.
func RunSLO(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	slo, err := capacity.ParseSLO(c.SLO)
	if err != nil {
		return fmt.Errorf("bench: --slo: %w", err)
	}
	f, cfg := c.Workload, c.Load
	if (f.Trace == "") == (f.Spec.Name == "") {
		return errors.New("bench: give exactly one of --workload NAME or --trace FILE")
	}
	if f.Ramp == "" {
		return errors.New(`bench: --slo needs --ramp "rate:duration,...": each stage is one step of the measurement, e.g. --ramp 2:60s,4:60s,8:60s`)
	}
	if c.Duration != 0 {
		return errors.New("bench: --duration and --slo: the --ramp stages set how long each step runs")
	}
	switch f.Arrival.Process {
	case "", workload.ArrivalAuto:
		f.Arrival.Process = workload.ArrivalRamp
	case workload.ArrivalRamp:
	default:
		return fmt.Errorf("bench: --arrival %s and --slo: each --ramp stage is one step, so arrivals follow the ramp (--arrival ramp, implied)", f.Arrival.Process)
	}
	stages, err := workload.ParseStages(f.Ramp)
	if err != nil {
		return fmt.Errorf("bench: --ramp: %w", err)
	}
	var total time.Duration
	rates := make([]float64, len(stages))
	for k, s := range stages {
		if k > 0 && !(s.Rate > stages[k-1].Rate) {
			return fmt.Errorf("bench: --ramp %q with --slo: stage rates must rise (stage %d: %g after %g)", f.Ramp, k+1, s.Rate, stages[k-1].Rate)
		}
		total += s.Duration
		rates[k] = s.Rate
	}
	if f.Trace == "" && !c.RequestsGiven {
		f.Spec.Requests = Requests(&f, total)
	}
	cfg.Mode = loadgen.Mode(c.Mode)
	if cfg.Header, err = ParseHeaders(c.Headers); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	reqs, skipped, err := f.Load()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	for _, le := range skipped {
		fmt.Fprintf(stderr, "skipped: %v\n", &le)
	}
	split := SplitStages(reqs, stages)
	for k, s := range split {
		if len(s) == 0 {
			return fmt.Errorf("bench: --ramp stage %d (%g req/s for %v) has no requests: the workload has %d; give more (--requests) or shorter stages", k+1, stages[k].Rate, stages[k].Duration, len(reqs))
		}
	}
	cfg.Workload = f.Spec.Name
	if f.Trace != "" {
		cfg.Workload = filepath.Base(f.Trace)
	}
	if c.OutDir != "" {
		if err := os.MkdirAll(c.OutDir, 0o755); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	}
	fmt.Fprintf(stderr, "bench --slo %s: %s, %d stages over %v → %s (%s)\n",
		slo, f.Describe(), len(stages), total, cfg.Target, cfg.Mode)
	text, err := c.text(ctx, cfg, false, stderr)
	if err != nil {
		return err
	}
	cfg = text.apply(cfg)

	// Every stage's load generator starts now and sends its requests at
	// their ramp times: stage k's first leaves as stage k−1 ends.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make([]chan stageRun, len(stages))
	for k := range stages {
		done[k] = make(chan stageRun, 1)
		sc := cfg
		sc.Rate, sc.Progress = stages[k].Rate, nil
		go func() {
			out, err := loadgen.Run(sctx, sc, split[k])
			done[k] <- stageRun{out, err}
		}()
	}
	var points []report.Result
	var records []report.RequestRecord
	judge := func(rate float64) (bool, error) {
		k := len(points)
		sr := <-done[k]
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if sr.err != nil {
			return false, sr.err
		}
		r := stageResult(cfg.Policy, rate, sr.out)
		text.annotate(&r)
		v := slo.Judge(sr.out.Records, r.DurationS)
		slo.Annotate(&r, v)
		points = append(points, r)
		records = append(records, sr.out.Records...)
		fmt.Fprintf(stderr, "stage %d/%d  rate %-6.4g %4d requests, %d failed, throughput %.3g req/s, %s, goodput %.3g req/s\n",
			k+1, len(stages), rate, r.Requests, r.Errors, r.ThroughputRPS, capacity.VerdictLine(slo, v), v.GoodputRPS)
		return v.Met, nil
	}
	o, runErr := capacity.Climb(rates, judge)
	if runErr == nil && c.SLOKeepGoing {
		for _, r := range rates[len(points):] {
			met, err := judge(r)
			if err != nil {
				runErr = fmt.Errorf("capacity: rate %g: %w", r, err)
				break
			}
			o.Steps = append(o.Steps, capacity.Step{Rate: r, Met: met})
		}
	}
	// Stop what is left: the stages after a miss (or all, when
	// interrupted), and say what was cancelled.
	cancel()
	var stopped []string
	for k := len(points); k < len(stages); k++ {
		sr := <-done[k]
		if runErr == nil && len(sr.out.Records) > 0 {
			stopped = append(stopped, fmt.Sprintf("stage %d/%d  rate %-6.4g not judged: stopped after a stage missed (%d requests sent were cancelled)",
				k+1, len(stages), stages[k].Rate, len(sr.out.Records)))
		}
	}
	for _, s := range stopped {
		fmt.Fprintln(stderr, s)
	}
	p := capacity.Policy{Name: cfg.Policy, Outcome: o, Points: points}
	p.Mark()
	if err := writeSLO(stdout, slo, f.Ramp, p, stopped, records, c.JSONPath, c.OutDir); err != nil {
		return err
	}
	if runErr != nil {
		return fmt.Errorf("bench: %w", runErr)
	}
	return nil
}

// stageResult summarises one stage's records over their own span (first
// send to last finish, as sim's runs), keeping the load generator's labels
// send lag, prompt sizes and error classes.
func stageResult(policy string, rate float64, out loadgen.Output) report.Result {
	r := report.Build(policy, rate, out.Records, 0)
	r.Workload, r.Target = out.Result.Workload, out.Result.Target
	r.Delayed, r.SendLag = out.Result.Delayed, out.Result.SendLag
	r.PromptTokensMean, r.WorkloadPromptTokensMean = out.Result.PromptTokensMean, out.Result.WorkloadPromptTokensMean
	r.ErrorClasses = out.Result.ErrorClasses
	return r
}

// CapacityLine says what a live ramp's capacity means: the highest stage
// rate meeting the SLO with every lower stage meeting it too.
func CapacityLine(slo capacity.SLO, p capacity.Policy) string {
	o := p.Outcome
	switch {
	case len(o.Steps) == 0:
		return "capacity_rps unknown: no stage was judged"
	case o.BelowMin:
		return fmt.Sprintf("capacity_rps 0: the first stage (%g req/s) already missed %s", o.Steps[0].Rate, slo)
	case o.AboveMax:
		return fmt.Sprintf("capacity_rps ≥ %g: every stage met %s; the ramp did not reach the capacity", o.Capacity, slo)
	}
	return fmt.Sprintf("capacity_rps %g: the highest stage rate that met %s, every lower stage meeting it too", o.Capacity, slo)
}

// writeSLO prints the stages (capacity.WriteSweep) and the capacity, or
// the JSON for jsonPath "-", and writes the files asked for: jsonPath, and
// outDir's results.json, requests.csv, chart.svg and report.html. Every
// stage is one result, with slo, slo_met, slo_observed, goodput_rps and
// capacity_rps (the same on each) as sim --slo writes them.
func writeSLO(stdout io.Writer, slo capacity.SLO, ramp string, p capacity.Policy, stopped []string, records []report.RequestRecord, jsonPath, outDir string) error {
	if jsonPath == "-" {
		if err := report.WriteJSON(stdout, p.Points); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	} else {
		fmt.Fprintf(stdout, "%s at %s, one step per --ramp stage (%s):\n", p.Name, slo, ramp)
		if err := capacity.WriteSweep(stdout, slo, []capacity.Policy{p}); err != nil {
			return err
		}
		for _, s := range stopped {
			fmt.Fprintln(stdout, "  "+s)
		}
		fmt.Fprintln(stdout, CapacityLine(slo, p))
		if jsonPath != "" {
			if err := report.WriteJSONFile(jsonPath, p.Points); err != nil {
				return fmt.Errorf("bench: %w", err)
			}
		}
	}
	if outDir == "" {
		return nil
	}
	for _, w := range []error{
		report.WriteJSONFile(filepath.Join(outDir, "results.json"), p.Points),
		report.WriteCSVFile(filepath.Join(outDir, "requests.csv"), records),
		report.WriteChartFile(filepath.Join(outDir, "chart.svg"), p.Points),
		report.WriteHTMLFile(filepath.Join(outDir, "report.html"), p.Points, records, "bench --slo "+slo.String()+" --ramp "+ramp, CapacityLine(slo, p)),
	} {
		if w != nil {
			return fmt.Errorf("bench: %w", w)
		}
	}
	return nil
}
