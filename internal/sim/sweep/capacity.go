package sweep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/prefixlb/prefixlb/internal/capacity"
	"github.com/prefixlb/prefixlb/internal/report"
)

// PolicyCapacity is one policy's capacity search with the requests of its
// run at capacity (for --out).
type PolicyCapacity struct {
	capacity.Policy
	records []report.RequestRecord
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

// Capacities searches the capacity at slo of every policy of the sweep on
// l's workload: each probe a full simulation of the same requests at
// another rate. Progress goes to stderr unless c.Quiet.
func (c *Config) Capacities(ctx context.Context, su *setup, slo capacity.SLO, l *capacity.Loader, stderr io.Writer) ([]PolicyCapacity, error) {
	sc := c.SearchConfig(l.Start)
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("sim: --slo search: %w", err)
	}
	var out []PolicyCapacity
	for _, spec := range su.specs {
		pc := PolicyCapacity{Policy: capacity.Policy{Name: spec}}
		best, bestRecs := 0.0, []report.RequestRecord(nil)
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
			if v.Met && rate > best {
				best, bestRecs = rate, rn.res.Records
			}
			if !c.Quiet {
				fmt.Fprintf(stderr, "%-24s rate %-8.4g %s, goodput %.3g req/s\n", spec, rate, capacity.VerdictLine(slo, v), v.GoodputRPS)
			}
			return v.Met, nil
		}
		o, err := capacity.Search(ctx, sc, probe)
		if err != nil {
			return nil, fmt.Errorf("sim: %s: %w", spec, err)
		}
		pc.Outcome = o
		pc.Mark()
		pc.records = bestRecs
		out = append(out, pc)
	}
	return out, nil
}

// Records returns the requests of the policy's run at capacity (none when
// no rate met).
func (pc PolicyCapacity) Records() []report.RequestRecord { return pc.records }

// SearchCapacity parses c.SLO, prepares c's cluster and workload and
// searches the capacity at the SLO of every policy of c (Capacities):
// what `prefixlb sim --slo` prints and `prefixlb advise` ranks.
func SearchCapacity(ctx context.Context, c Config, stderr io.Writer) (capacity.SLO, []PolicyCapacity, error) {
	slo, err := capacity.ParseSLO(c.SLO)
	if err != nil {
		return nil, nil, fmt.Errorf("sim: --slo: %w", err)
	}
	if c.Rates != "" {
		return nil, nil, errors.New("sim: --rates and --slo: the capacity search chooses the rates (--rate sets where it starts)")
	}
	su, err := c.prepare()
	if err != nil {
		return nil, nil, err
	}
	l, err := capacity.NewLoader(c.Workload)
	if err != nil {
		return nil, nil, fmt.Errorf("sim: %w", err)
	}
	for _, le := range l.Skipped {
		fmt.Fprintln(stderr, "skipped:", le.Error())
	}
	pcs, err := c.Capacities(ctx, su, slo, l, stderr)
	if err != nil {
		return nil, nil, err
	}
	return slo, pcs, nil
}

// RunCapacity is `prefixlb sim --slo`: the capacity at c.SLO of every
// policy, each a search over rates (internal/capacity) whose every probe
// simulates the same workload at another rate (SearchCapacity). It prints
// the capacities, the goodput along each search and the table of the runs
// at capacity; the JSON holds every run, with capacity_rps and goodput_rps.
func RunCapacity(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	slo, pcs, err := SearchCapacity(ctx, c, stderr)
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
	ps := make([]capacity.Policy, len(pcs))
	for i, pc := range pcs {
		ps[i] = pc.Policy
		all = append(all, pc.Points...)
		if r, ok := pc.AtCapacity(); ok {
			atCap = append(atCap, r)
			records = append(records, pc.records...)
		}
	}
	if c.JSONPath != "-" {
		fmt.Fprintf(stdout, "capacity at %s (bisection to %g%%; %s):\n", slo, 100*c.SearchConfig(1).Tolerance, c.Workload.Describe())
		if err := capacity.WriteTable(stdout, slo, ps); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "\ngoodput along each search (req/s that met every limit):")
		if err := capacity.WriteSweep(stdout, slo, ps); err != nil {
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

// DefaultConfig is `prefixlb sim`'s defaults for everything but the
// workload, the policies and the output: 4 replicas of mistral-7b-a6000
// behind vLLM's block cache, fcfs, KV events 10 ms late, router seed 1,
// 400 Gb/s KV links of 1 ms, and a capacity search to 5%. Commands that
// simulate the same cluster (advise) start from it.
func DefaultConfig() Config {
	return Config{
		Replicas: 4, Profile: "mistral-7b-a6000", Local: "fcfs",
		KVEvents: true, EventLag: 10 * time.Millisecond, RouterSeed: 1,
		Engine: EngineVLLM, Slots: DefaultSlots,
		KVLinkGbps: 400, KVLinkLatency: time.Millisecond,
		SLOTolerance: 0.05,
	}
}
