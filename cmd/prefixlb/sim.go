package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/sim"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// simOptions are the flags of `prefixlb sim`.
type simOptions struct {
	wl         workload.Flags
	replicas   int
	profile    string
	policies   string
	rates      string
	local      string
	chunk      int
	kvEvents   bool
	eventLag   time.Duration
	hostCores  int
	specTTL    time.Duration
	routerSeed uint64
	jsonPath   string
	outDir     string
	quiet      bool
	engine     string // simEngineVLLM or simEngineLlamaCpp
	slots      int    // llama.cpp slots per replica (-np); 0 with vllm
}

// The replica engines `sim --engine` models.
const (
	// simEngineVLLM: vLLM's block prefix cache, evicted LRU (the default).
	simEngineVLLM = "vllm"
	// simEngineLlamaCpp: llama.cpp llama-server's slot cache
	// (replica.Config.Slots).
	simEngineLlamaCpp = "llamacpp"
	// simDefaultSlots is --slots' default with --engine llamacpp, the -np
	// of docs/real-engines.md's llama-server runs.
	simDefaultSlots = 2
)

// applyEngine checks --engine and --slots and, for llamacpp, changes the
// defaults of the flags the user did not give (changed reports whether the
// user gave one) to llama-server's: n_batch 2048 as the chunk budget, no KV
// events (llama.cpp publishes none: the router models the slots from its
// own decisions and the cached tokens each response reports) and the
// llamacpp-tiny-cpu profile. --slots with vllm is an error rather than
// ignored: vLLM has no slots, and a silently ignored flag would make two
// different experiments look alike.
func (o *simOptions) applyEngine(changed func(name string) bool) error {
	switch o.engine {
	case simEngineVLLM:
		if changed("slots") {
			return fmt.Errorf("--slots is for --engine %s (vLLM keeps a block cache, not slots)", simEngineLlamaCpp)
		}
		o.slots = 0
	case simEngineLlamaCpp:
		if !changed("slots") {
			o.slots = simDefaultSlots
		}
		if o.slots < 1 {
			return fmt.Errorf("--slots must be ≥ 1, got %d", o.slots)
		}
		if !changed("chunk-budget") {
			o.chunk = replica.LlamaCppBatch
		}
		if !changed("kv-events") {
			o.kvEvents = false
		}
		if !changed("profile") {
			o.profile = costmodel.LlamaCppTinyCPU
		}
	default:
		return fmt.Errorf("--engine must be %s or %s, got %q", simEngineVLLM, simEngineLlamaCpp, o.engine)
	}
	return nil
}

func newSimCmd() *cobra.Command {
	o := &simOptions{wl: workload.DefaultFlags()}
	o.wl.Spec.Requests = 2000
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Simulate a cluster of replicas behind each policy on a workload or trace",
		Long: `sim runs a discrete-event simulation of N modelled GPU replicas behind the
routing core, once per policy (and per rate in a sweep), on a built-in workload
or a trace, and prints TTFT, latency and hit-ratio figures next to the oracle
bound (every request alone on a replica that holds every earlier prefix).

Policies may carry E2 settings and a local scheduler of their own:
  --policies 'round-robin@lpm,e2@priority,e2-preble:mixing=false'.

--engine llamacpp models llama.cpp's llama-server instead of vLLM: each
replica has --slots slots (-np, default 2) splitting the profile's KV capacity
(-c), each keeping the last prompt it served; a request takes the idle slot it
shares most of (above llama.cpp's --slot-prompt-similarity, 0.5) or the least recently used
one, reuses only the common prefix with it and waits while every slot is busy.
The router is told each replica's slots. Unless given, --chunk-budget becomes
2048 (n_batch), --kv-events false (llama.cpp publishes none) and --profile
llamacpp-tiny-cpu (the tiny test model on one CPU thread, docs/profiles.md).
The local scheduler must be fcfs.`,
		Example: `  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --policies round-robin,e2 --rates 4,8,12
  prefixlb sim --trace trace.jsonl --trace-format mooncake --replicas 8 --profile llama3-70b-h100x2 --json out.json
  prefixlb sim --engine llamacpp --slots 2 --workload toolbench --replicas 3 --rate 1 --requests 300 --policies round-robin,e2`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("workload-replicas") {
				o.wl.Spec.Replicas = o.replicas
			}
			if err := o.applyEngine(cmd.Flags().Changed); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			return runSim(ctx, o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	o.wl.AddFlags(fs)
	fs.IntVar(&o.replicas, "replicas", 4, "number of replicas")
	fs.StringVar(&o.profile, "profile", "mistral-7b-a6000", "cost profile name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file")
	fs.StringVar(&o.policies, "policies", "round-robin,llmd-precise,e2", "comma-separated policies: "+strings.Join(policy.Names(), ", "))
	fs.StringVar(&o.rates, "rates", "", "comma-separated request rates to sweep (overrides --rate)")
	fs.StringVar(&o.local, "local", "fcfs", "replicas' local scheduler: fcfs, lpm, priority")
	fs.IntVar(&o.chunk, "chunk-budget", 512, "prefill token budget per iteration (-1: no chunked prefill)")
	fs.BoolVar(&o.kvEvents, "kv-events", true, "feed the router the replicas' KV events (else it mirrors caches from its own decisions)")
	fs.DurationVar(&o.eventLag, "event-lag", 10*time.Millisecond, "delay of KV events on their way to the router")
	fs.IntVar(&o.hostCores, "host-cores", 0, "put every replica on one host of this many CPU cores (CPU engines such as llama.cpp sharing a machine): an iteration that starts while k > N replicas compute takes k/N as long; 0: each replica has its own hardware")
	fs.DurationVar(&o.specTTL, "speculative-ttl", 0, "with --kv-events: how long a routed prompt counts as cached on its replica before an event confirms it (0: 2s; negative: off)")
	fs.Uint64Var(&o.routerSeed, "router-seed", 1, "seed of the router's random choices")
	fs.StringVar(&o.jsonPath, "json", "", "write results as JSON to this file (- for stdout)")
	fs.StringVar(&o.outDir, "out", "", "write results.json, requests.csv, chart.svg and report.html into this directory")
	fs.BoolVarP(&o.quiet, "quiet", "q", false, "no progress output")
	fs.StringVar(&o.engine, "engine", simEngineVLLM, "replica engine to model: vllm (block prefix cache) or llamacpp (llama-server's slot cache; changes the defaults of --chunk-budget, --kv-events and --profile, see above)")
	fs.IntVar(&o.slots, "slots", simDefaultSlots, "--engine llamacpp: slots per replica (llama-server -np), splitting the profile's KV capacity")
	return cmd
}

func init() { rootCmd.AddCommand(newSimCmd()) }

// loadProfile resolves a profile name or YAML path.
func loadProfile(name string) (costmodel.Profile, error) {
	if strings.HasSuffix(name, ".yaml") || strings.HasSuffix(name, ".yml") || strings.Contains(name, "/") {
		return costmodel.Load(name)
	}
	return costmodel.Lookup(name)
}

func parseRates(s string, def float64) ([]float64, error) {
	if strings.TrimSpace(s) == "" {
		return []float64{def}, nil
	}
	var out []float64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("--rates: %q is not a positive number", f)
		}
		out = append(out, v)
	}
	return out, nil
}

func runSim(ctx context.Context, o *simOptions, stdout, stderr io.Writer) error {
	prof, err := loadProfile(o.profile)
	if err != nil {
		return err
	}
	rates, err := parseRates(o.rates, o.wl.Arrival.Rate)
	if err != nil {
		return err
	}
	specs := strings.Split(o.policies, ",")
	opts := policy.DefaultOptions()
	for _, s := range specs {
		name, local, hasLocal := strings.Cut(s, "@")
		if _, err := policy.Parse(name, opts); err != nil {
			return err
		}
		if hasLocal {
			c := replica.DefaultConfig()
			c.Local = local
			c.Slots = o.slots
			c.Profile = prof
			if err := c.Validate(); err != nil {
				return fmt.Errorf("--policies %q: %w", s, err)
			}
		}
	}
	rc := replica.DefaultConfig()
	rc.Local = o.local
	rc.ChunkBudget = o.chunk
	rc.Slots = o.slots
	rc.Profile = prof
	rc.Default()
	if err := rc.Validate(); err != nil {
		return err
	}
	if o.outDir != "" {
		if err := os.MkdirAll(o.outDir, 0o755); err != nil {
			return err
		}
	}
	var results []report.Result
	var records []report.RequestRecord
	for _, rate := range rates {
		o.wl.Arrival.Rate = rate
		reqs, skipped, err := o.wl.Load()
		if err != nil {
			return err
		}
		for _, le := range skipped {
			fmt.Fprintln(stderr, "skipped:", le.Error())
		}
		if len(reqs) == 0 {
			return fmt.Errorf("sim: the workload has no requests")
		}
		label := rate
		if len(rates) == 1 && o.rates == "" && o.wl.Arrival.Process != "poisson" && o.wl.Arrival.Process != "gamma" &&
			(o.wl.Arrival.Process != "auto" || o.wl.Trace != "") {
			// Ramps and traces set their own times: report the offered rate.
			if span := reqs[len(reqs)-1].Arrival.Seconds(); span > 0 {
				label = float64(len(reqs)-1) / span
			}
		}
		oracle := sim.Oracle(reqs, prof, rc.BlockSize)
		var orc report.Samples
		for _, d := range oracle {
			orc.Add(float64(d) / float64(time.Millisecond))
		}
		oSum := orc.Summary()
		for _, spec := range specs {
			name := spec
			prc := rc
			if name, local, ok := strings.Cut(spec, "@"); ok {
				spec, prc.Local = name, local
			}
			pol, err := policy.Parse(spec, opts)
			if err != nil {
				return err
			}
			start := time.Now()
			cfg := sim.Config{Replicas: o.replicas, Replica: prc, Profile: prof, Policy: pol,
				KVEvents: o.kvEvents, EventLag: o.eventLag, SpeculativeTTL: o.specTTL, Seed: o.routerSeed, Rate: label,
				HostCores: o.hostCores}
			if !o.quiet {
				cfg.Progress = func(done, total int) {
					fmt.Fprintf(stderr, "\r%-24s rate %-6.3g %6d/%d requests", name, label, done, total)
				}
			}
			res, err := sim.Run(ctx, cfg, reqs)
			if err != nil {
				return err
			}
			if !o.quiet {
				fmt.Fprintf(stderr, "\r%-24s rate %-6.3g %6d requests simulated in %v\n", name, label, len(reqs), time.Since(start).Round(time.Millisecond))
			}
			for i := range res.Records {
				res.Records[i].Policy, res.Records[i].Rate = name, label
			}
			r := report.Build(name, label, res.Records, 0)
			r.Workload = o.wl.Describe()
			r.Replicas = o.replicas
			r.Profile = prof.Name()
			r.Local = prc.Local
			if st := res.Router; st.PredictionsChecked > 0 {
				r.CachePredictionExact = float64(st.PredictionsExact) / float64(st.PredictionsChecked)
				r.CachePredictedTokens, r.CacheReportedTokens = st.PredictedTokens, st.ReportedTokens
			}
			os := oSum
			r.OracleTTFT = &os
			if oSum.Mean > 0 {
				r.TTFTVsOracle = r.TTFT.Mean / oSum.Mean
			}
			results = append(results, r)
			if o.outDir != "" {
				records = append(records, res.Records...)
			}
		}
	}
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	if o.jsonPath == "-" {
		if err := writeSimJSON(stdout, o.engine, results); err != nil {
			return err
		}
	} else if o.jsonPath != "" {
		if err := writeSimJSONFile(o.jsonPath, o.engine, results); err != nil {
			return err
		}
	}
	if o.outDir != "" {
		if err := writeSimJSONFile(filepath.Join(o.outDir, "results.json"), o.engine, results); err != nil {
			return err
		}
		if err := report.WriteCSVFile(filepath.Join(o.outDir, "requests.csv"), records); err != nil {
			return err
		}
		if err := report.WriteChartFile(filepath.Join(o.outDir, "chart.svg"), results); err != nil {
			return err
		}
		if err := report.WriteHTMLFile(filepath.Join(o.outDir, "report.html"), results, records); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote %s/{results.json,requests.csv,chart.svg,report.html}\n", o.outDir)
	}
	return nil
}

// simEngineResult is a result with the engine it modelled. report.Result has
// no engine field; until it has, sim adds one for engines other than vLLM
// (whose output stays byte for byte what it was).
type simEngineResult struct {
	report.Result
	Engine string `json:"engine"`
}

// writeSimJSON writes results as report.WriteJSON does, each result naming
// engine unless it is vllm.
func writeSimJSON(w io.Writer, engine string, results []report.Result) error {
	if engine == simEngineVLLM {
		return report.WriteJSON(w, results)
	}
	out := make([]simEngineResult, len(results))
	for i, r := range results {
		out[i] = simEngineResult{Result: r, Engine: engine}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(struct {
		Results []simEngineResult `json:"results"`
	}{out}); err != nil {
		return fmt.Errorf("sim: write json: %w", err)
	}
	return nil
}

// writeSimJSONFile writes writeSimJSON's output to path.
func writeSimJSONFile(path, engine string, results []report.Result) error {
	if engine == simEngineVLLM {
		return report.WriteJSONFile(path, results)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	if err := writeSimJSON(f, engine, results); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}
