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

	"github.com/prefixlb/prefixlb/internal/calibrate"
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
	chunk      int // 0: each replica's profile's engine default
	maxSeqs    int // 0: each replica's profile's engine default
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
	// replicaProfiles gives each replica its own true profile
	// (SPEC[*N],...); routerProfile the profile the router is told for
	// every replica; calibrate makes the router learn each one's speed.
	replicaProfiles string
	routerProfile   string
	calibrate       bool
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
The local scheduler must be fcfs.

Each replica batches as its profile's engine does unless --chunk-budget and
--max-seqs say otherwise: vLLM's defaults for the OpenAI server by GPU
(max_num_batched_tokens 8192 and max_num_seqs 1024 on GPUs of 70 GiB or
more other than the A100; 2048 and 256 elsewhere), and Preble's 512-token
chunks on mistral-7b-a6000 (docs/profiles.md).

A profile is a built-in name or a YAML file, optionally with scaled times:
'llama3.1-8b-h100:time_scale=0.5' is twice as fast. --replica-profiles
gives each replica its own (a mixed cluster; NAME*N repeats one), and
--router-profile tells the router another than the replicas' true ones.
--calibrate makes the router learn each replica's real prefill and decode
speed from first tokens and finishes (and llama.cpp's timings), starting
from the profile it was told (internal/calibrate; docs/calibration.md).`,
		Example: `  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --policies round-robin,e2 --rates 4,8,12
  prefixlb sim --trace trace.jsonl --trace-format mooncake --replicas 8 --profile llama3-70b-h100x2 --json out.json
  prefixlb sim --engine llamacpp --slots 2 --workload toolbench --replicas 3 --rate 1 --requests 300 --policies round-robin,e2
  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --rate 60 \
      --replica-profiles 'llama3.1-8b-h100*2,llama3.1-8b-a100*2' --router-profile llama3.1-8b-h100 --calibrate`,
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
	fs.StringVar(&o.profile, "profile", "mistral-7b-a6000", "cost profile: a name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file, optionally :time_scale=X, :prefill_scale=X, :decode_scale=X")
	fs.StringVar(&o.replicaProfiles, "replica-profiles", "", "each replica's own true profile, comma-separated, SPEC*N repeating one (a mixed cluster; replaces --profile for the replicas)")
	fs.StringVar(&o.routerProfile, "router-profile", "", "the profile the router's cost model is told for every replica (default: each replica's own true one)")
	fs.BoolVar(&o.calibrate, "calibrate", false, "the router learns each replica's real prefill and decode speed online, starting from the profile it was told")
	fs.StringVar(&o.policies, "policies", "round-robin,llmd-precise,e2", "comma-separated policies: "+strings.Join(policy.Names(), ", "))
	fs.StringVar(&o.rates, "rates", "", "comma-separated request rates to sweep (overrides --rate)")
	fs.StringVar(&o.local, "local", "fcfs", "replicas' local scheduler: fcfs, lpm, priority")
	fs.IntVar(&o.chunk, "chunk-budget", 0, "prefill token budget per iteration, decodes included: vLLM's max_num_batched_tokens (0: each profile's engine default; -1: no chunked prefill)")
	fs.IntVar(&o.maxSeqs, "max-seqs", 0, "most requests running at once per replica: vLLM's max_num_seqs (0: each profile's engine default)")
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

// parseReplicaProfiles resolves --replica-profiles for n replicas: specs
// separated by commas, SPEC*N standing for N of one.
func parseReplicaProfiles(list string, n int) ([]costmodel.Profile, error) {
	var out []costmodel.Profile
	for _, item := range strings.Split(list, ",") {
		item = strings.TrimSpace(item)
		count := 1
		if i := strings.LastIndex(item, "*"); i >= 0 {
			c, err := strconv.Atoi(item[i+1:])
			if err != nil || c < 1 {
				return nil, fmt.Errorf("--replica-profiles: %q: the count after * must be a positive integer", item)
			}
			item, count = item[:i], c
		}
		if item == "" {
			return nil, fmt.Errorf("--replica-profiles: an empty profile in %q", list)
		}
		p, err := costmodel.Resolve(item)
		if err != nil {
			return nil, fmt.Errorf("--replica-profiles: %w", err)
		}
		for ; count > 0; count-- {
			out = append(out, p)
		}
	}
	if len(out) != n {
		return nil, fmt.Errorf("--replica-profiles names %d replicas, --replicas is %d", len(out), n)
	}
	return out, nil
}

// simProfiles are the profiles of one simulated cluster.
type simProfiles struct {
	base     costmodel.Profile   // --profile
	replicas []costmodel.Profile // --replica-profiles (nil: base for all)
	router   []costmodel.Profile // --router-profile (nil: each replica's own)
}

// distinct lists each different true profile once, in replica order.
func (sp *simProfiles) distinct() []costmodel.Profile {
	if len(sp.replicas) == 0 {
		return []costmodel.Profile{sp.base}
	}
	var out []costmodel.Profile
	for _, p := range sp.replicas {
		seen := false
		for _, q := range out {
			seen = seen || q == p
		}
		if !seen {
			out = append(out, p)
		}
	}
	return out
}

// fastest is the true profile with the shortest 1,000-token prefill: the
// oracle's replica (no router beats a request alone on the fastest one).
func (sp *simProfiles) fastest() costmodel.Profile {
	best := sp.base
	for i, p := range sp.distinct() {
		if i == 0 || p.Prefill(1000, 1000) < best.Prefill(1000, 1000) {
			best = p
		}
	}
	return best
}

func resolveSimProfiles(o *simOptions) (*simProfiles, error) {
	base, err := costmodel.Resolve(o.profile)
	if err != nil {
		return nil, err
	}
	sp := &simProfiles{base: base}
	if o.replicaProfiles != "" {
		if sp.replicas, err = parseReplicaProfiles(o.replicaProfiles, o.replicas); err != nil {
			return nil, err
		}
	}
	if o.routerProfile != "" {
		rp, err := costmodel.Resolve(o.routerProfile)
		if err != nil {
			return nil, fmt.Errorf("--router-profile: %w", err)
		}
		for i := 0; i < o.replicas; i++ {
			sp.router = append(sp.router, rp)
		}
	}
	return sp, nil
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
	sp, err := resolveSimProfiles(o)
	if err != nil {
		return err
	}
	prof := sp.base
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
			for _, p := range sp.distinct() {
				c := replica.DefaultConfig()
				c.Local = local
				c.Slots = o.slots
				c.ChunkBudget, c.MaxRunning = o.chunk, o.maxSeqs
				c.Profile = p
				c.Default()
				if err := c.Validate(); err != nil {
					return fmt.Errorf("--policies %q: %w", s, err)
				}
			}
		}
	}
	rc := replica.DefaultConfig()
	rc.Local = o.local
	rc.ChunkBudget = o.chunk
	rc.MaxRunning = o.maxSeqs
	rc.Slots = o.slots
	for _, p := range sp.distinct() {
		c := rc
		c.Profile = p
		c.Default()
		if err := c.Validate(); err != nil {
			return fmt.Errorf("profile %s: %w", p.Name(), err)
		}
	}
	var calCfg *calibrate.Config
	if o.calibrate {
		c := calibrate.DefaultConfig()
		calCfg = &c
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
		oracle := sim.Oracle(reqs, sp.fastest(), rc.BlockSize)
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
				Profiles: sp.replicas, RouterProfiles: sp.router, Calibrate: calCfg,
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
			if len(sp.replicas) > 0 {
				r.Profile = o.replicaProfiles
				for _, p := range sp.replicas {
					r.ReplicaProfiles = append(r.ReplicaProfiles, p.Name())
				}
			}
			if len(sp.router) > 0 {
				r.RouterProfile = sp.router[0].Name()
			}
			r.Utilization = res.Utilization()
			r.Calibrated = o.calibrate
			for i, c := range res.Calibration {
				r.Calibration = append(r.Calibration, report.CalibrationFit{
					Replica:                  fmt.Sprintf("replica-%d", i),
					PrefillSecondsPer1K:      c.Fit.PrefillSecondsPer1K,
					PriorPrefillSecondsPer1K: c.Fit.PriorPrefillSecondsPer1K,
					TruePrefillSecondsPer1K:  c.TruePrefillSecondsPer1K,
					DecodeStepSeconds:        c.Fit.DecodeStepSeconds,
					PriorDecodeStepSeconds:   c.Fit.PriorDecodeStepSeconds,
					TrueDecodeStepSeconds:    c.TrueDecodeStepSeconds,
					PrefillSamples:           c.Fit.PrefillSamples, DecodeSamples: c.Fit.DecodeSamples,
					PrefillError: c.Fit.PrefillError, DecodeError: c.Fit.DecodeError,
					PrefillCoefficients: c.Fit.Prefill, DecodeCoefficients: c.Fit.Decode,
				})
			}

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
	if o.calibrate {
		fmt.Fprintln(stdout, "\nwhat the router learnt of each replica by the end (a cold 1,000-token prefill; one decode step with 1,000 tokens of context):")
		for _, r := range results {
			writeCalibration(stdout, fmt.Sprintf("%s@%g", r.Policy, r.Rate), r.Calibration)
		}
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

// writeCalibration prints, per replica, what the router learnt of its speed
// against the truth and the prior it started from.
func writeCalibration(w io.Writer, policy string, fits []report.CalibrationFit) {
	for _, c := range fits {
		fmt.Fprintf(w, "  %-16s %s: prefill %7.4g s (true %7.4g, told %7.4g; %5d samples), decode step %7.4g ms (true %7.4g, told %7.4g; %5d samples)\n",
			policy, c.Replica, c.PrefillSecondsPer1K, c.TruePrefillSecondsPer1K, c.PriorPrefillSecondsPer1K, c.PrefillSamples,
			1e3*c.DecodeStepSeconds, 1e3*c.TrueDecodeStepSeconds, 1e3*c.PriorDecodeStepSeconds, c.DecodeSamples)
	}
}
