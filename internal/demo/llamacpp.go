package demo

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/llamacpp"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/upstream"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// LlamaCppConfig configures the llama.cpp replicas of a demo
// (EngineLlamaCpp).
type LlamaCppConfig struct {
	// Server is the llama-server binary ("": $PREFIXLB_LLAMA_SERVER, else
	// $PREFIXLB_TEST_LLAMA_SERVER).
	Server string
	// Model is the GGUF model ("": $PREFIXLB_LLAMA_MODEL, else the tiny
	// random-weight model, built once beside the binary's script).
	Model string
	// Threads, Slots and Context are each server's -t, -np and -c.
	Threads int
	Slots   int
	Context int
	// Rounds runs every policy this many times, interleaved; figures pool
	// the rounds.
	Rounds int
	// LogDir, when set, gets each server's output in a file.
	LogDir string
	// Calibrate and Timings: the router learns each replica's speed, and
	// from llama.cpp's timings too (else from its own clock only).
	Calibrate, Timings bool
	// Records, when set, is a file that gets every request's record with
	// the timings llama.cpp reported for it, one JSON object a line.
	Records string
}

// LlamaCppDefaults changes the flags the user did not give (changed; nil:
// none given) to the CPU-sized defaults of `demo --engine llamacpp`, for the
// tiny model on one thread per server: cold prefills of 1–3 s. The shapes
// are those of the built-in workloads (docs/real-engines.md says why these
// sizes).
func LlamaCppDefaults(c *Config, changed func(name string) bool) {
	set := func(name string, apply func()) {
		if changed == nil || !changed(name) {
			apply()
		}
	}
	set("profile", func() { c.Profile = costmodel.LlamaCppTinyCPU })
	set("replicas", func() { c.Replicas = 3 })
	set("workload-replicas", func() { c.Workload.Spec.Replicas = c.Replicas })
	set("requests", func() { c.Workload.Spec.Requests = 120 })
	set("rate", func() { c.Workload.Arrival.Rate = 1 })
	set("output-tokens", func() { c.Workload.Spec.OutputTokens = 24 })
	set("tools", func() { c.Workload.Spec.ToolBench.Tools = 20 })
	set("groups", func() { c.Workload.Spec.SharedPrefix.Groups = 6 })
	set("system-prompt-tokens", func() { c.Workload.Spec.SharedPrefix.SystemTokens = 1800 })
	set("questions-per-group", func() { c.Workload.Spec.SharedPrefix.Questions = 8 })
	set("question-tokens", func() { c.Workload.Spec.SharedPrefix.QuestionTokens = 200 })
	set("shared-output-tokens", func() { c.Workload.Spec.SharedPrefix.Output = 24 })
	set("policies", func() { c.Policies = "round-robin,least-load,llmd-approx,sglang,prefix,e2" })
}

// resolve fills the binary and model from the environment (building the
// tiny model when none is given) and checks the options.
func (l *LlamaCppConfig) resolve(stderr io.Writer) error {
	if l.Server == "" {
		l.Server = os.Getenv("PREFIXLB_LLAMA_SERVER")
	}
	if l.Server == "" {
		l.Server = os.Getenv(llamacpp.EnvServer)
	}
	if l.Server == "" {
		return fmt.Errorf("--engine llamacpp needs llama.cpp's llama-server: give --llama-server PATH (or set PREFIXLB_LLAMA_SERVER)")
	}
	if l.Rounds < 1 {
		return fmt.Errorf("--rounds must be ≥ 1, got %d", l.Rounds)
	}
	if l.Model == "" {
		l.Model = os.Getenv("PREFIXLB_LLAMA_MODEL")
	}
	if l.Model == "" {
		script := filepath.Join(filepath.Dir(l.Server), llamacpp.ModelScript)
		if _, err := os.Stat(script); err != nil {
			return fmt.Errorf("--engine llamacpp needs a model: give --llama-model FILE.gguf (no %s beside %s to build one)", llamacpp.ModelScript, l.Server)
		}
		l.Model = filepath.Join(os.TempDir(), "prefixlb-demo-tiny.gguf")
		if _, err := os.Stat(l.Model); err != nil {
			fmt.Fprintf(stderr, "prefixlb demo: building the tiny random-weight model %s with %s (about 10 s)\n", l.Model, script)
			python := os.Getenv(llamacpp.EnvPython)
			if python == "" {
				python = "/usr/bin/python3"
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := llamacpp.BuildTinyModel(ctx, python, script, l.Model); err != nil {
				return err
			}
		}
	}
	return nil
}

// runLlamaCpp is the demo on llama.cpp (EngineLlamaCpp): for each policy
// (and round), fresh llama-servers and a fresh router, the same workload
// through it, then each server's prefill seconds read from its /metrics;
// the rounds are pooled per policy.
func runLlamaCpp(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	l := &c.LlamaCpp
	if err := l.resolve(stderr); err != nil {
		return err
	}
	LlamaCppDefaults(&c, c.Changed)
	reqs, _, err := c.Workload.Load()
	if err != nil {
		return err
	}
	logger := newLogger(c.Verbose, stderr)
	pols := splitPolicies(c.Policies)
	fmt.Fprintf(stderr, "prefixlb demo: %d llama-server replicas (-t %d -np %d -c %d, %s) on loopback, %s, %d requests at %g req/s, %d round(s)\n",
		c.Replicas, l.Threads, l.Slots, l.Context, filepath.Base(l.Model), c.Workload.Describe(), len(reqs), c.Workload.Arrival.Rate, l.Rounds)
	fmt.Fprintf(stderr, "prefixlb demo: router profile %s; fresh servers (empty caches) for every run\n", c.Profile)
	runs := make(map[string][]llamaRun)
	for round := 0; round < l.Rounds; round++ {
		for i := range pols {
			pol := pols[(i+round)%len(pols)]
			run, err := llamaCppRun(ctx, c, pol, reqs, logger, stderr)
			if err != nil {
				return fmt.Errorf("demo: policy %s: %w", pol, err)
			}
			runs[pol] = append(runs[pol], run)
		}
	}
	labels := poolLabels{Rate: c.Workload.Arrival.Rate, Workload: c.Workload.Describe(), Replicas: c.Replicas, Profile: c.Profile}
	var results []report.Result
	for _, pol := range pols {
		results = append(results, poolRuns(pol, runs[pol], labels))
	}
	if l.Records != "" {
		if err := writeRecords(l.Records, pols, runs); err != nil {
			return err
		}
	}
	fmt.Fprintln(stdout)
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	writePrefillTable(stdout, results)
	return writeJSON(c.JSONPath, stdout, results)
}

// splitPolicies splits comma-separated policies, dropping empty ones.
func splitPolicies(list string) []string {
	var pols []string
	for _, p := range strings.Split(list, ",") {
		if p = strings.TrimSpace(p); p != "" {
			pols = append(pols, p)
		}
	}
	return pols
}

// llamaCppRun starts c.Replicas llama-servers and a router with policy pol,
// drives reqs through it and reads each server's prefill counters.
func llamaCppRun(ctx context.Context, c Config, pol string, reqs []workload.Request, logger *slog.Logger, stderr io.Writer) (llamaRun, error) {
	l := &c.LlamaCpp
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	servers := make([]*llamacpp.Server, c.Replicas)
	defer func() {
		for _, s := range servers {
			if s != nil {
				s.Stop()
			}
		}
	}()
	// Not errgroup.WithContext: its context ends when Wait returns, and
	// with it the servers (exec.CommandContext).
	var start errgroup.Group
	for i := range servers {
		start.Go(func() error {
			opts := llamacpp.Default(l.Server, l.Model)
			opts.Threads, opts.Slots, opts.Context = l.Threads, l.Slots, l.Context
			if l.LogDir != "" {
				f, err := os.Create(filepath.Join(l.LogDir, fmt.Sprintf("%s-llama-%d.log", pol, i)))
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
	if err := start.Wait(); err != nil {
		return llamaRun{}, err
	}
	var backends []proxy.Backend
	for i, s := range servers {
		backends = append(backends, proxy.Backend{Name: fmt.Sprintf("llama-%d", i), URL: s.URL})
	}
	pc := proxy.DefaultConfig()
	pc.Backends = backends
	pc.Policy = pol
	pc.Profile = c.Profile
	pc.Logger = logger
	pc.ScrapeInterval = 200 * time.Millisecond
	pc.HealthInterval = time.Second
	pc.Calibrate = l.Calibrate
	pc.Calibration.NoTimings = !l.Timings
	p, err := proxy.New(pc)
	if err != nil {
		return llamaRun{}, err
	}
	defer p.Close()
	// The router runs and serves until ctx ends (Serve drains then).
	var g errgroup.Group
	defer func() { _ = g.Wait() }()
	defer cancel()
	g.Go(func() error { _ = p.Run(ctx); return nil })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return llamaRun{}, err
	}
	g.Go(func() error { _ = p.Serve(ctx, ln); return nil })
	target := "http://" + ln.Addr().String()
	// The router learns each replica's kind and slots from its first
	// health check and scrape; give it that before the load starts.
	if err := waitReplicasUp(ctx, p, 10*time.Second); err != nil {
		return llamaRun{}, err
	}
	began := time.Now()
	out, err := loadgen.Run(ctx, loadConfig(c, target, pol, c.Workload.Arrival.Rate, stderr), reqs)
	if err != nil {
		return llamaRun{}, err
	}
	run := llamaRun{out: out, prefill: map[string]float64{}, prompt: map[string]float64{}}
	if l.Calibrate {
		for _, r := range p.Replicas() {
			fit := report.CalibrationFit{Replica: r.Name,
				PrefillSecondsPer1K: r.Speed.PrefillSecondsPer1K, PriorPrefillSecondsPer1K: r.Speed.PriorPrefillSecondsPer1K,
				DecodeStepSeconds: r.Speed.DecodeStepSeconds, PriorDecodeStepSeconds: r.Speed.PriorDecodeStepSeconds,
				PrefillSamples: r.Speed.PrefillSamples, DecodeSamples: r.Speed.DecodeSamples,
				PrefillError: r.Speed.PrefillError, DecodeError: r.Speed.DecodeError,
				PrefillCoefficients: r.Speed.Prefill, DecodeCoefficients: r.Speed.Decode}
			if st := r.Learnt; st != nil {
				fit.TimingsPrefillRatio, fit.TimingsDecodeRatio = st.TimedPrefill.Ratio(), st.TimedDecode.Ratio()
				fit.TimedRequests = st.TimedPrefill.N
			}
			run.cal = append(run.cal, fit)
			fmt.Fprintf(stderr, "%-14s   %s learnt: prefill %.3g s/1k tokens (profile %.3g), decode step %.3g ms (profile %.3g); predicted/timings prefill %.2f, decode %.2f over %d requests\n",
				pol, r.Name, fit.PrefillSecondsPer1K, fit.PriorPrefillSecondsPer1K, 1e3*fit.DecodeStepSeconds, 1e3*fit.PriorDecodeStepSeconds,
				fit.TimingsPrefillRatio, fit.TimingsDecodeRatio, fit.TimedRequests)
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
		time.Since(began).Round(100*time.Millisecond), out.Result.Errors, out.Result.PrefixHitRatio)
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
