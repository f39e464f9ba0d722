package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/llamacpp"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// llamaOptions are demo's flags for real llama.cpp replicas
// (--engine llamacpp).
type llamaOptions struct {
	engine  string // "model" (prefixlb engine) or "llamacpp"
	server  string // llama-server binary
	model   string // GGUF model
	threads int
	slots   int
	context int
	rounds  int
	logDir  string
	// calibrate and timings: the router learns each replica's speed, and
	// from llama.cpp's timings too (else from its own clock only).
	calibrate, timings bool
	// records, when set, is a file that gets every request's record with
	// the timings llama.cpp reported for it, one JSON object a line.
	records string
	// changed reports whether the user gave a flag (cobra's
	// FlagSet.Changed); nil: none given.
	changed func(name string) bool
}

// CPU-sized defaults of `demo --engine llamacpp`, for the tiny model on one
// thread per server: cold prefills of 1–3 s. The shapes are those of the
// built-in workloads (docs/real-engines.md says why these sizes).
func (l *llamaOptions) defaults(o *demoOptions) {
	set := func(name string, apply func()) {
		if l.changed == nil || !l.changed(name) {
			apply()
		}
	}
	set("profile", func() { o.profile = costmodel.LlamaCppTinyCPU })
	set("replicas", func() { o.replicas = 3 })
	set("workload-replicas", func() { o.wl.Spec.Replicas = o.replicas })
	set("requests", func() { o.wl.Spec.Requests = 120 })
	set("rate", func() { o.wl.Arrival.Rate = 1 })
	set("output-tokens", func() { o.wl.Spec.OutputTokens = 24 })
	set("tools", func() { o.wl.Spec.ToolBench.Tools = 20 })
	set("groups", func() { o.wl.Spec.SharedPrefix.Groups = 6 })
	set("system-prompt-tokens", func() { o.wl.Spec.SharedPrefix.SystemTokens = 1800 })
	set("questions-per-group", func() { o.wl.Spec.SharedPrefix.Questions = 8 })
	set("question-tokens", func() { o.wl.Spec.SharedPrefix.QuestionTokens = 200 })
	set("shared-output-tokens", func() { o.wl.Spec.SharedPrefix.Output = 24 })
	set("policies", func() { o.policies = "round-robin,least-load,llmd-approx,sglang,prefix,e2" })
}

func (l *llamaOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&l.engine, "engine", "model", "replicas: model (prefixlb engine, a modelled GPU) or llamacpp (real llama.cpp llama-server processes on this CPU)")
	fs.StringVar(&l.server, "llama-server", "", "llama-server binary for --engine llamacpp (default $PREFIXLB_LLAMA_SERVER, else $"+llamacpp.EnvServer+")")
	fs.StringVar(&l.model, "llama-model", "", "GGUF model for --engine llamacpp (default $PREFIXLB_LLAMA_MODEL; else built once with "+llamacpp.ModelScript+" beside the binary, which needs python3-numpy)")
	fs.IntVar(&l.threads, "llama-threads", 1, "--engine llamacpp: CPU threads per llama-server (-t)")
	fs.IntVar(&l.slots, "llama-slots", 2, "--engine llamacpp: slots per llama-server (-np): one cached prompt each")
	fs.IntVar(&l.context, "llama-context", 16384, "--engine llamacpp: context per llama-server in tokens (-c), split between its slots")
	fs.IntVar(&l.rounds, "rounds", 1, "--engine llamacpp: run every policy this many times, interleaved (policy order rotates each round); figures pool the rounds")
	fs.StringVar(&l.logDir, "llama-logs", "", "--engine llamacpp: write each llama-server's output to a file in this folder")
	fs.BoolVar(&l.calibrate, "calibrate", true, "--engine llamacpp: the router learns each replica's speed (serve's --calibrate); what it learnt is printed against llama.cpp's own timings")
	fs.StringVar(&l.records, "records", "", "--engine llamacpp: write every request's record and llama.cpp's timings of it to this file, one JSON object a line")
	fs.BoolVar(&l.timings, "calibrate-timings", true, "--engine llamacpp: calibration learns from llama.cpp's timings too (false: from the router's own clock only, busy periods and token gaps; the timings then only check it)")
}

// resolve fills the binary and model from the environment (building the
// tiny model when none is given) and checks the flags.
func (l *llamaOptions) resolve(stderr io.Writer) error {
	if l.server == "" {
		l.server = os.Getenv("PREFIXLB_LLAMA_SERVER")
	}
	if l.server == "" {
		l.server = os.Getenv(llamacpp.EnvServer)
	}
	if l.server == "" {
		return fmt.Errorf("--engine llamacpp needs llama.cpp's llama-server: give --llama-server PATH (or set PREFIXLB_LLAMA_SERVER)")
	}
	if l.rounds < 1 {
		return fmt.Errorf("--rounds must be ≥ 1, got %d", l.rounds)
	}
	if l.model == "" {
		l.model = os.Getenv("PREFIXLB_LLAMA_MODEL")
	}
	if l.model == "" {
		script := filepath.Join(filepath.Dir(l.server), llamacpp.ModelScript)
		if _, err := os.Stat(script); err != nil {
			return fmt.Errorf("--engine llamacpp needs a model: give --llama-model FILE.gguf (no %s beside %s to build one)", llamacpp.ModelScript, l.server)
		}
		l.model = filepath.Join(os.TempDir(), "prefixlb-demo-tiny.gguf")
		if _, err := os.Stat(l.model); err != nil {
			fmt.Fprintf(stderr, "prefixlb demo: building the tiny random-weight model %s with %s (about 10 s)\n", l.model, script)
			python := os.Getenv(llamacpp.EnvPython)
			if python == "" {
				python = "/usr/bin/python3"
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := llamacpp.BuildTinyModel(ctx, python, script, l.model); err != nil {
				return err
			}
		}
	}
	return nil
}

// runLlamaDemo is `demo --engine llamacpp`: for each policy (and round),
// fresh llama-servers and a fresh router, the same workload through it, then
// each server's prefill seconds read from its /metrics.
func runLlamaDemo(ctx context.Context, o *demoOptions, stdout, stderr io.Writer) error {
	l := &o.llama
	if err := l.resolve(stderr); err != nil {
		return err
	}
	l.defaults(o)
	reqs, _, err := o.wl.Load()
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	if o.verbose {
		logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	var pols []string
	for _, p := range strings.Split(o.policies, ",") {
		if p = strings.TrimSpace(p); p != "" {
			pols = append(pols, p)
		}
	}
	fmt.Fprintf(stderr, "prefixlb demo: %d llama-server replicas (-t %d -np %d -c %d, %s) on loopback, %s, %d requests at %g req/s, %d round(s)\n",
		o.replicas, l.threads, l.slots, l.context, filepath.Base(l.model), o.wl.Describe(), len(reqs), o.wl.Arrival.Rate, l.rounds)
	fmt.Fprintf(stderr, "prefixlb demo: router profile %s; fresh servers (empty caches) for every run\n", o.profile)
	runs := make(map[string][]llamaRun)
	for round := 0; round < l.rounds; round++ {
		for i := range pols {
			pol := pols[(i+round)%len(pols)]
			run, err := llamaDemoRun(ctx, o, pol, reqs, logger, stderr)
			if err != nil {
				return fmt.Errorf("demo: policy %s: %w", pol, err)
			}
			runs[pol] = append(runs[pol], run)
		}
	}
	var results []report.Result
	for _, pol := range pols {
		results = append(results, poolLlamaRuns(o, pol, runs[pol]))
	}
	if l.records != "" {
		if err := writeLlamaRecords(l.records, pols, runs); err != nil {
			return err
		}
	}
	fmt.Fprintln(stdout)
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	writePrefillTable(stdout, results)
	return writeDemoJSON(o.jsonPath, stdout, results)
}

// llamaRun is one run of one policy.
type llamaRun struct {
	out     loadgen.Output
	prefill map[string]float64 // replica → llamacpp:prompt_seconds_total
	prompt  map[string]float64 // replica → llamacpp:prompt_tokens_total
	cal     []report.CalibrationFit
}

// llamaDemoRun starts o.replicas llama-servers and a router with policy pol,
// drives reqs through it and reads each server's prefill counters.
func llamaDemoRun(ctx context.Context, o *demoOptions, pol string, reqs []workload.Request, logger *slog.Logger, stderr io.Writer) (llamaRun, error) {
	l := &o.llama
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	servers := make([]*llamacpp.Server, o.replicas)
	defer func() {
		for _, s := range servers {
			if s != nil {
				s.Stop()
			}
		}
	}()
	// Not errgroup.WithContext: its context ends when Wait returns, and
	// with it the servers (exec.CommandContext).
	var g errgroup.Group
	for i := range servers {
		g.Go(func() error {
			opts := llamacpp.Default(l.server, l.model)
			opts.Threads, opts.Slots, opts.Context = l.threads, l.slots, l.context
			if l.logDir != "" {
				f, err := os.Create(filepath.Join(l.logDir, fmt.Sprintf("%s-llama-%d.log", pol, i)))
				if err != nil {
					return err
				}
				defer f.Close()
				opts.Log = f
			}
			s, err := llamacpp.Start(ctx, opts)
			if err != nil {
				return fmt.Errorf("llama-server %d: %w", i, err)
			}
			servers[i] = s
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return llamaRun{}, err
	}
	var backends []proxy.Backend
	for i, s := range servers {
		backends = append(backends, proxy.Backend{Name: fmt.Sprintf("llama-%d", i), URL: s.URL})
	}
	pc := proxy.DefaultConfig()
	pc.Backends = backends
	pc.Policy = pol
	pc.Profile = o.profile
	pc.Logger = logger
	pc.ScrapeInterval = 200 * time.Millisecond
	pc.HealthInterval = time.Second
	pc.Calibrate = l.calibrate
	pc.Calibration.NoTimings = !l.timings
	p, err := proxy.New(pc)
	if err != nil {
		return llamaRun{}, err
	}
	defer p.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(1)
	go func() { defer wg.Done(); _ = p.Run(ctx) }()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return llamaRun{}, err
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = p.Serve(ctx, ln) }() // drains when ctx ends
	target := "http://" + ln.Addr().String()
	// The router learns each replica's kind and slots from its first
	// health check and scrape; give it that before the load starts.
	if err := waitReplicasUp(ctx, p, 10*time.Second); err != nil {
		return llamaRun{}, err
	}
	lc := loadgen.DefaultConfig()
	lc.Target = target
	lc.Policy = pol
	lc.Mode = loadgen.Mode(o.mode)
	lc.Rate = o.wl.Arrival.Rate
	lc.Workload = o.wl.Describe()
	lc.Progress = stderr
	lc.ProgressAlways = false
	start := time.Now()
	out, err := loadgen.Run(ctx, lc, reqs)
	if err != nil {
		return llamaRun{}, err
	}
	run := llamaRun{out: out, prefill: map[string]float64{}, prompt: map[string]float64{}}
	if l.calibrate {
		for _, r := range p.Replicas() {
			c := report.CalibrationFit{Replica: r.Name,
				PrefillSecondsPer1K: r.Speed.PrefillSecondsPer1K, PriorPrefillSecondsPer1K: r.Speed.PriorPrefillSecondsPer1K,
				DecodeStepSeconds: r.Speed.DecodeStepSeconds, PriorDecodeStepSeconds: r.Speed.PriorDecodeStepSeconds,
				PrefillSamples: r.Speed.PrefillSamples, DecodeSamples: r.Speed.DecodeSamples,
				PrefillError: r.Speed.PrefillError, DecodeError: r.Speed.DecodeError,
				PrefillCoefficients: r.Speed.Prefill, DecodeCoefficients: r.Speed.Decode}
			if st := r.Learnt; st != nil {
				c.TimingsPrefillRatio, c.TimingsDecodeRatio = st.TimedPrefill.Ratio(), st.TimedDecode.Ratio()
				c.TimedRequests = st.TimedPrefill.N
			}
			run.cal = append(run.cal, c)
			fmt.Fprintf(stderr, "%-14s   %s learnt: prefill %.3g s/1k tokens (profile %.3g), decode step %.3g ms (profile %.3g); predicted/timings prefill %.2f, decode %.2f over %d requests\n",
				pol, r.Name, c.PrefillSecondsPer1K, c.PriorPrefillSecondsPer1K, 1e3*c.DecodeStepSeconds, 1e3*c.PriorDecodeStepSeconds,
				c.TimingsPrefillRatio, c.TimingsDecodeRatio, c.TimedRequests)
		}
	}
	for i, s := range servers {
		m, err := llamacpp.Metrics(ctx, s.URL)
		if err != nil {
			return llamaRun{}, err
		}
		run.prefill[backends[i].Name] = m["llamacpp:prompt_seconds_total"]
		run.prompt[backends[i].Name] = m["llamacpp:prompt_tokens_total"]
	}
	fmt.Fprintf(stderr, "%-14s %d requests in %v, %d errors, hit ratio %.3f\n", pol, len(reqs),
		time.Since(start).Round(100*time.Millisecond), out.Result.Errors, out.Result.PrefixHitRatio)
	errs := map[string]int{}
	for _, r := range out.Records {
		if r.Failed() {
			errs[r.Error]++
		}
	}
	for e, n := range errs {
		fmt.Fprintf(stderr, "%-14s   %d× %s\n", pol, n, e)
	}
	return run, nil
}

// poolLlamaRuns summarises a policy's runs as one result: the requests of
// every round pooled, prefill seconds per replica summed.
func poolLlamaRuns(o *demoOptions, pol string, runs []llamaRun) report.Result {
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
	res := report.Build(pol, o.wl.Arrival.Rate, recs, dur)
	res.Workload = o.wl.Describe()
	res.Replicas = o.replicas
	res.Profile = o.profile
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

// waitReplicasUp waits until the router has every replica up, detected as
// llama.cpp, with its slots known.
func waitReplicasUp(ctx context.Context, p *proxy.Proxy, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ready := true
		for _, r := range p.Replicas() {
			ready = ready && r.Up && r.Kind == upstream.LlamaCpp && r.Slots > 0
		}
		if ready {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replicas not all up after %v: %+v", timeout, p.Replicas())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// llamaRecord is one line of --records: a request's record, the round it
// ran in, and llama.cpp's timings of it (nil: none).
type llamaRecord struct {
	report.RequestRecord
	Round   int              `json:"round"`
	Timings *loadgen.Timings `json:"timings"`
}

// writeLlamaRecords writes every run's requests to path as JSON lines.
func writeLlamaRecords(path string, pols []string, runs map[string][]llamaRun) error {
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
