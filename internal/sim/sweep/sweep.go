// Package sweep is `prefixlb sim`: it runs the simulator (internal/sim) once
// per policy and rate on one workload, next to the oracle bound, and reports
// the runs as a table, JSON and the --out files (internal/report). It
// resolves the cluster's profiles (a mixed cluster, the profile the router
// is told), the engine modelled (vLLM's block cache or llama.cpp's slots)
// and the policies' own local schedulers.
package sweep

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/sim"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// The replica engines a sweep models (Config.Engine).
const (
	// EngineVLLM: vLLM's block prefix cache, evicted LRU (the default).
	EngineVLLM = "vllm"
	// EngineLlamaCpp: llama.cpp llama-server's slot cache
	// (replica.Config.Slots).
	EngineLlamaCpp = "llamacpp"
	// DefaultSlots is --slots' default with --engine llamacpp, the -np of
	// docs/real-engines.md's llama-server runs.
	DefaultSlots = 2
)

// Config is one sweep: the flags of `prefixlb sim`.
type Config struct {
	// Workload is the workload or trace; its arrival rate is replaced by
	// each of Rates in turn.
	Workload workload.Flags
	// Replicas is the number of replicas.
	Replicas int
	// Profile is the replicas' cost profile (costmodel.Resolve's spec).
	Profile string
	// ReplicaProfiles gives each replica its own true profile
	// (SPEC[*N],...; "" for none); RouterProfile is the profile the router
	// is told for every replica ("": each replica's own); Calibrate makes
	// the router learn each one's speed.
	ReplicaProfiles string
	RouterProfile   string
	Calibrate       bool
	// Policies are comma-separated policy specs, each optionally with a
	// local scheduler of its own after @ (e2@priority).
	Policies string
	// Rates are comma-separated rates to sweep ("": the workload's rate).
	Rates string
	// Local is the replicas' local scheduler.
	Local string
	// ChunkBudget and MaxSeqs are vLLM's max_num_batched_tokens and
	// max_num_seqs (0: each replica's profile's engine default).
	ChunkBudget int
	MaxSeqs     int
	// KVEvents feeds the router the replicas' KV events, EventLag late.
	KVEvents bool
	EventLag time.Duration
	// HostCores puts every replica on one host of this many cores (0: each
	// its own hardware).
	HostCores int
	// SpeculativeTTL is the router's speculative-entry lifetime.
	SpeculativeTTL time.Duration
	// RouterSeed seeds the router's random choices.
	RouterSeed uint64
	// JSONPath gets the results as JSON ("": none, "-": stdout); OutDir
	// gets results.json, requests.csv, chart.svg and report.html.
	JSONPath string
	OutDir   string
	// TierTrace, when set with CPUOffloadTokens, gets every run's requests
	// as CSV with their TTFT split at admission and at the end of their
	// CPU-tier copy (sim.TierRecord; WriteTierTrace).
	TierTrace string
	// Quiet writes no progress.
	Quiet bool
	// Engine is EngineVLLM or EngineLlamaCpp; Slots is llama.cpp's slots
	// per replica (-np).
	Engine string
	Slots  int
	// PrefillReplicas makes the first N of Replicas prefill replicas and
	// the rest decode replicas (sim.Config.PrefillReplicas; 0: none).
	// KVLinkGbps and KVLinkLatency are each replica's link for the KV of
	// disaggregated requests, in gigabits per second and per transfer.
	PrefillReplicas int
	// MaxLoras is each replica's LoRA adapter slots (vLLM's --max-loras;
	// replica.Config.MaxLoras); 0: adapters not modelled as slots.
	MaxLoras int
	// KVCapacity is each replica's GPU KV cache in tokens
	// (replica.Config.KVCapacity; 0: the profile's).
	KVCapacity int
	// CPUOffloadTokens is each replica's CPU offload tier in tokens
	// (replica.Config.CPUOffloadTokens; 0: none); IgnoreCacheTiers drops
	// its KV events on their way to the router for every policy
	// (sim.Config.IgnoreCacheTiers).
	CPUOffloadTokens int
	IgnoreCacheTiers bool
	KVLinkGbps       float64
	KVLinkLatency    time.Duration
	// SLO, when set, makes the sweep a capacity search per policy
	// (internal/capacity's syntax, e.g. "ttft_p90=2s"): RunCapacity.
	// SLOTolerance is the search's relative precision and SLOMaxRate
	// caps the rates it tries.
	SLO          string
	SLOTolerance float64
	SLOMaxRate   float64
	// RouterQueue, when not "", puts the router-side queue in front of the
	// router (sim.ParseQueueConfig: "on" or KEY=VALUE,...).
	RouterQueue string
	// Changed reports whether the user gave a flag (cobra's
	// FlagSet.Changed); nil: none given. With EngineLlamaCpp, flags not
	// given take llama-server's defaults (ApplyEngine).
	Changed func(name string) bool
}

// ApplyEngine checks Engine and Slots and, for llamacpp, changes the
// defaults of the flags the user did not give (Changed) to llama-server's:
// n_batch 2048 as the chunk budget, no KV events (llama.cpp publishes none:
// the router models the slots from its own decisions and the cached tokens
// each response reports) and the llamacpp-tiny-cpu profile. --slots with
// vllm is an error rather than ignored: vLLM has no slots, and a silently
// ignored flag would make two different experiments look alike.
func (c *Config) ApplyEngine() error {
	changed := c.Changed
	if changed == nil {
		changed = func(string) bool { return false }
	}
	switch c.Engine {
	case EngineVLLM:
		if changed("slots") {
			return fmt.Errorf("--slots is for --engine %s (vLLM keeps a block cache, not slots)", EngineLlamaCpp)
		}
		c.Slots = 0
	case EngineLlamaCpp:
		if !changed("slots") {
			c.Slots = DefaultSlots
		}
		if c.Slots < 1 {
			return fmt.Errorf("--slots must be ≥ 1, got %d", c.Slots)
		}
		if !changed("chunk-budget") {
			c.ChunkBudget = replica.LlamaCppBatch
		}
		if !changed("kv-events") {
			c.KVEvents = false
		}
		if !changed("profile") {
			c.Profile = costmodel.LlamaCppTinyCPU
		}
	default:
		return fmt.Errorf("--engine must be %s or %s, got %q", EngineVLLM, EngineLlamaCpp, c.Engine)
	}
	return nil
}

// setup is what a sweep resolves once from its Config before simulating:
// the cluster's profiles, the replicas' configuration, the policies'
// options and the calibration the router runs with.
type setup struct {
	sp     *Profiles
	rc     replica.Config
	opts   policy.Options
	calCfg *calibrate.Config
	specs  []string
	queue  *sim.QueueConfig // --router-queue; nil: none
}

// prepare applies the engine's defaults (ApplyEngine) and resolves and
// checks c's profiles, replicas and policies.
func (c *Config) prepare() (*setup, error) {
	if err := c.ApplyEngine(); err != nil {
		return nil, err
	}
	sp, err := ResolveProfiles(c.Profile, c.ReplicaProfiles, c.RouterProfile, c.Replicas)
	if err != nil {
		return nil, err
	}
	specs := strings.Split(c.Policies, ",")
	opts := policy.DefaultOptions()
	rc := replica.DefaultConfig()
	rc.Local = c.Local
	rc.ChunkBudget = c.ChunkBudget
	rc.MaxRunning = c.MaxSeqs
	rc.Slots = c.Slots
	rc.MaxLoras = c.MaxLoras
	rc.CPUOffloadTokens = c.CPUOffloadTokens
	rc.KVCapacity = c.KVCapacity
	if err := checkPolicies(specs, opts, rc, sp); err != nil {
		return nil, err
	}
	for _, p := range sp.Distinct() {
		rp := rc
		rp.Profile = p
		rp.Default()
		if err := rp.Validate(); err != nil {
			return nil, fmt.Errorf("profile %s: %w", p.Name(), err)
		}
	}
	var calCfg *calibrate.Config
	if c.Calibrate {
		cc := calibrate.DefaultConfig()
		calCfg = &cc
	}
	if c.OutDir != "" {
		if err := os.MkdirAll(c.OutDir, 0o755); err != nil {
			return nil, err
		}
	}
	su := &setup{sp: sp, rc: rc, opts: opts, calCfg: calCfg, specs: specs}
	if c.RouterQueue != "" {
		qc, err := sim.ParseQueueConfig(c.RouterQueue)
		if err != nil {
			return nil, err
		}
		su.queue = &qc
	}
	return su, nil
}

// run is one simulated run: the policy's name as given, its local
// scheduler and the simulator's result.
type run struct {
	name, local string
	res         *sim.Result
}

// simulate runs policy spec (NAME[@LOCAL]) at rate label on reqs, writing
// progress to stderr unless c.Quiet, and labels the records.
func (c *Config) simulate(ctx context.Context, su *setup, spec string, label float64, reqs []workload.Request, stderr io.Writer) (run, error) {
	name := spec
	prc := su.rc
	if name, local, ok := strings.Cut(spec, "@"); ok {
		spec, prc.Local = name, local
	}
	pol, err := policy.Parse(spec, su.opts)
	if err != nil {
		return run{}, err
	}
	start := time.Now()
	cfg := sim.Config{Replicas: c.Replicas, Replica: prc, Profile: su.sp.Base, Policy: pol,
		Profiles: su.sp.Replicas, RouterProfiles: su.sp.Router, Calibrate: su.calCfg,
		KVEvents: c.KVEvents, EventLag: c.EventLag, SpeculativeTTL: c.SpeculativeTTL, Seed: c.RouterSeed, Rate: label,
		HostCores: c.HostCores, PrefillReplicas: c.PrefillReplicas, IgnoreCacheTiers: c.IgnoreCacheTiers,
		KVLink: policy.KVLink{BytesPerSecond: c.KVLinkGbps * 1e9 / 8, Latency: c.KVLinkLatency}}
	if q := su.queue; q != nil && !q.Off {
		cfg.Queue = q
	}
	if !c.Quiet {
		cfg.Progress = func(done, total int) {
			fmt.Fprintf(stderr, "\r%-24s rate %-6.3g %6d/%d requests", name, label, done, total)
		}
	}
	res, err := sim.Run(ctx, cfg, reqs)
	if err != nil {
		return run{}, err
	}
	if !c.Quiet {
		fmt.Fprintf(stderr, "\r%-24s rate %-6.3g %6d requests simulated in %v\n", name, label, len(reqs), time.Since(start).Round(time.Millisecond))
	}
	for i := range res.Records {
		res.Records[i].Policy, res.Records[i].Rate = name, label
	}
	return run{name: name, local: prc.Local, res: res}, nil
}

// labels are the results' labels of the sweep's cluster for a run of
// local scheduler local.
func (c *Config) labels(su *setup, local string) Labels {
	return Labels{
		Workload: c.Workload.Describe(), Replicas: c.Replicas, Profiles: su.sp,
		ReplicaProfiles: c.ReplicaProfiles, Calibrated: c.Calibrate, Local: local,
	}
}

// Run applies the engine's defaults (ApplyEngine), simulates every policy
// at every rate, writes progress to stderr and the results to stdout (and
// JSONPath and OutDir). With an SLO it searches each policy's capacity
// instead (RunCapacity).
func Run(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	if c.SLO != "" {
		return RunCapacity(ctx, c, stdout, stderr)
	}
	su, err := c.prepare()
	if err != nil {
		return err
	}
	rates, err := ParseRates(c.Rates, c.Workload.Arrival.Rate)
	if err != nil {
		return err
	}
	var results []report.Result
	var records []report.RequestRecord
	var pdLines, loraLines, tierLines, queueLines []string
	queue := su.queue
	var trace bytes.Buffer
	for _, rate := range rates {
		c.Workload.Arrival.Rate = rate
		reqs, skipped, err := c.Workload.Load()
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
		if len(rates) == 1 && c.Rates == "" && c.Workload.Arrival.Process != "poisson" && c.Workload.Arrival.Process != "gamma" &&
			(c.Workload.Arrival.Process != "auto" || c.Workload.Trace != "") {
			// Ramps and traces set their own times: report the offered rate.
			if span := reqs[len(reqs)-1].Arrival.Seconds(); span > 0 {
				label = float64(len(reqs)-1) / span
			}
		}
		oracle := OracleTTFT(reqs, su.sp.Fastest(), su.rc.BlockSize)
		for _, spec := range su.specs {
			rn, err := c.simulate(ctx, su, spec, label, reqs, stderr)
			if err != nil {
				return err
			}
			name, res := rn.name, rn.res
			r := Result(name, label, res, c.labels(su, rn.local), oracle)
			results = append(results, r)
			if pd := res.PD; pd != nil {
				pdLines = append(pdLines, PDLine(name, label, pd))
			}
			if c.MaxLoras > 0 {
				loraLines = append(loraLines, LoRALine(name, label, res))
			}
			if c.CPUOffloadTokens > 0 {
				tierLines = append(tierLines, TierLine(name, label, res))
				if c.TierTrace != "" {
					WriteTierTrace(&trace, trace.Len() == 0, res)
				}
			}
			if queue != nil || c.Workload.Priorities != "" || c.Workload.Tenants != "" {
				q := queue
				if q == nil {
					q = &sim.QueueConfig{}
				}
				queueLines = append(queueLines, QueueLine(name, label, res, q))
			}
			if c.OutDir != "" {
				records = append(records, res.Records...)
			}
		}
	}
	if err := Write(stdout, stderr, c, results, records); err != nil {
		return err
	}
	if c.TierTrace != "" {
		if err := os.WriteFile(c.TierTrace, trace.Bytes(), 0o644); err != nil {
			return fmt.Errorf("sim: tier trace: %w", err)
		}
	}
	if len(loraLines) > 0 {
		fmt.Fprintf(stderr, "\nLoRA adapters (%d slots per replica):\n", c.MaxLoras)
		for _, l := range loraLines {
			fmt.Fprintln(stderr, l)
		}
	}
	if len(tierLines) > 0 {
		fmt.Fprintf(stderr, "\nCPU offload tier (%d tokens per replica):\n", c.CPUOffloadTokens)
		for _, l := range tierLines {
			fmt.Fprintln(stderr, l)
		}
	}
	if len(queueLines) > 0 {
		fmt.Fprintf(stderr, "\nrouter-side queue (%s):\n", orOff(c.RouterQueue))
		for _, l := range queueLines {
			fmt.Fprintln(stderr, l)
		}
	}
	if len(pdLines) > 0 {
		fmt.Fprintf(stderr, "\nprefill/decode (%d prefill + %d decode replicas, %g Gb/s links, %v latency):\n", c.PrefillReplicas, c.Replicas-c.PrefillReplicas, c.KVLinkGbps, c.KVLinkLatency)
		for _, l := range pdLines {
			fmt.Fprintln(stderr, l)
		}
	}
	return nil
}

// orOff is s, or "off" when empty.
func orOff(s string) string {
	if s == "" {
		return "off"
	}
	return s
}

// LoRALine renders a run's adapter figures: loads per minute over the
// cluster, the evictions among them, and the iteration time they added.
func LoRALine(name string, rate float64, res *sim.Result) string {
	var loads, evictions int64
	var t time.Duration
	for _, st := range res.Replicas {
		loads, evictions, t = loads+st.AdapterLoads, evictions+st.AdapterEvictions, t+st.AdapterLoadTime
	}
	return fmt.Sprintf("  %-16s rate %-6.3g adapter loads %6d (%7.1f/min)  evictions %6d  load time %8.1f s",
		name, rate, loads, res.AdapterLoadsPerMinute(), evictions, t.Seconds())
}

// TierLine renders a run's CPU offload tier figures over the cluster: the
// prompt tokens found in GPU caches and loaded from CPU tiers (shares of
// all prompt tokens), the loads and their total copy time.
func TierLine(name string, rate float64, res *sim.Result) string {
	var loads, loaded, gpu, prompt int64
	var t time.Duration
	for _, st := range res.Replicas {
		loads, loaded, t = loads+st.OffloadLoads, loaded+st.OffloadLoadedTokens, t+st.OffloadLoadTime
		gpu += st.PrefixCacheHits
	}
	for _, rec := range res.Records {
		prompt += int64(rec.PromptTokens)
	}
	share := func(n int64) float64 {
		if prompt == 0 {
			return 0
		}
		return 100 * float64(n) / float64(prompt)
	}
	return fmt.Sprintf("  %-28s rate %-6.3g GPU hits %5.1f%%  CPU-tier loads %5.1f%% of prompt tokens (%d loads, %.1f s of copies)",
		name, rate, share(gpu), share(loaded), loads, t.Seconds())
}

// WriteTierTrace appends res's requests to w as CSV (the header first when
// header): policy, rate, id, replica, session, group, prompt tokens, the
// tokens found in the GPU cache and loaded from the CPU tier, and the ms
// from arrival to admission, to the end of the CPU-tier copy and to the
// first token (sim.TierRecord).
func WriteTierTrace(w *bytes.Buffer, header bool, res *sim.Result) {
	if header {
		w.WriteString("policy,rate,id,replica,session,group,prompt_tokens,gpu_tokens,cpu_tokens,admitted_ms,load_done_ms,ttft_ms\n")
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	for i, rec := range res.Records {
		var t sim.TierRecord
		if i < len(res.Tiers) {
			t = res.Tiers[i]
		}
		fmt.Fprintf(w, "%s,%g,%d,%s,%s,%s,%d,%d,%d,%.3f,%.3f,%.3f\n", rec.Policy, rec.Rate, rec.ID, rec.Replica,
			rec.Session, rec.Group, rec.PromptTokens, t.GPUTokens, t.CPUTokens, ms(t.Admitted), ms(t.LoadDone), rec.TTFTMs)
	}
}

// PDLine renders a run's disaggregation figures: how many requests were
// disaggregated, the KV moved, and their TTFT split into the prefill leg,
// the transfer and the wait for the first token on the decode replica.
func PDLine(name string, rate float64, pd *sim.PDStats) string {
	return fmt.Sprintf("  %-16s rate %-6.3g disaggregated %5d local %5d  KV moved %7.1f GB  ttft split (mean/p99 ms): prefill %.0f/%.0f transfer %.0f/%.0f first decode %.0f/%.0f",
		name, rate, pd.Disaggregated, pd.Local, pd.TransferBytes/1e9,
		pd.PrefillMs.Mean, pd.PrefillMs.P99, pd.TransferMs.Mean, pd.TransferMs.P99, pd.DecodeWaitMs.Mean, pd.DecodeWaitMs.P99)
}

// checkPolicies checks that every policy spec parses and that each local
// scheduler a spec names after @ is valid for every replica's profile.
func checkPolicies(specs []string, opts policy.Options, rc replica.Config, sp *Profiles) error {
	for _, s := range specs {
		name, local, hasLocal := strings.Cut(s, "@")
		if _, err := policy.Parse(name, opts); err != nil {
			return err
		}
		if hasLocal {
			for _, p := range sp.Distinct() {
				c := replica.DefaultConfig()
				c.Local = local
				c.Slots = rc.Slots
				c.ChunkBudget, c.MaxRunning = rc.ChunkBudget, rc.MaxRunning
				c.Profile = p
				c.Default()
				if err := c.Validate(); err != nil {
					return fmt.Errorf("--policies %q: %w", s, err)
				}
			}
		}
	}
	return nil
}

// OracleTTFT summarises the oracle's TTFTs of reqs in milliseconds: each
// request alone on a replica of profile p that holds every earlier prefix
// (sim.Oracle).
func OracleTTFT(reqs []workload.Request, p costmodel.Profile, blockSize int) report.Summary {
	var orc report.Samples
	for _, d := range sim.Oracle(reqs, p, blockSize) {
		orc.Add(float64(d) / float64(time.Millisecond))
	}
	return orc.Summary()
}

// Labels are what a sweep's results say of the cluster and the run.
type Labels struct {
	Workload string
	Replicas int
	// Profiles label Profile, ReplicaProfiles and RouterProfile.
	Profiles *Profiles
	// ReplicaProfiles is the --replica-profiles spec, the results' Profile
	// when Profiles.Replicas is set.
	ReplicaProfiles string
	Calibrated      bool
	// Local is the run's local scheduler.
	Local string
}

// Result builds the report of one simulated run of policy name at rate:
// its records' figures, the cluster's labels, the replicas' utilisation,
// what the router learnt of each replica (Calibration), its cache
// predictions' accuracy and the TTFT against the oracle's.
func Result(name string, rate float64, res *sim.Result, l Labels, oracle report.Summary) report.Result {
	r := report.Build(name, rate, res.Records, 0)
	r.Workload = l.Workload
	r.Replicas = l.Replicas
	r.Profile = l.Profiles.Base.Name()
	if len(l.Profiles.Replicas) > 0 {
		r.Profile = l.ReplicaProfiles
		for _, p := range l.Profiles.Replicas {
			r.ReplicaProfiles = append(r.ReplicaProfiles, p.Name())
		}
	}
	if len(l.Profiles.Router) > 0 {
		r.RouterProfile = l.Profiles.Router[0].Name()
	}
	r.Utilization = res.Utilization()
	r.Calibrated = l.Calibrated
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
	r.Local = l.Local
	if st := res.Router; st.PredictionsChecked > 0 {
		r.CachePredictionExact = float64(st.PredictionsExact) / float64(st.PredictionsChecked)
		r.CachePredictedTokens, r.CacheReportedTokens = st.PredictedTokens, st.ReportedTokens
	}
	o := oracle
	r.OracleTTFT = &o
	if oracle.Mean > 0 {
		r.TTFTVsOracle = r.TTFT.Mean / oracle.Mean
	}
	return r
}
