package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// demoOptions are the flags of `prefixlb demo`.
type demoOptions struct {
	wl        workload.Flags
	replicas  int
	profile   string
	policies  string
	timeScale float64
	jsonPath  string
	verbose   bool
	noEvents  bool
	hold      bool
	// held, when set, is called by the last run with its result once its
	// load is done (--hold); the run then keeps its cluster up until Ctrl-C.
	held      func(report.Result) error
	tokenizer string
	mode      string
	llama     llamaOptions // --engine llamacpp (demo_llamacpp.go)
}

func newDemoCmd() *cobra.Command {
	o := &demoOptions{wl: workload.DefaultFlags()}
	o.wl.Spec = workload.DefaultSpec("toolbench")
	o.wl.Spec.ToolBench.Zipf = 1.1
	o.wl.Spec.Requests = 900
	o.wl.Arrival.Rate = 36
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run replicas and the router on loopback and compare policies live",
		Long: `demo starts N modelled GPU replicas (prefixlb engine) and the router
(prefixlb serve) in this process on loopback, drives the same open-loop
workload through each policy in turn, over real HTTP and SSE, with fresh
replicas each time, and prints the comparison. Nothing but the GPU is
simulated: the replicas' time comes from the cost profile.

Each replica publishes its KV-cache events (vLLM's ZeroMQ stream) on loopback
and the router follows them, so it knows every replica's cache exactly
(--no-kv-events: the router mirrors the caches from its own decisions).

The replicas and the router share a real tokenizer (--tokenizer, the bundled
Qwen3 one by default; none: one token per word and text-chunk keys), which the
router checks against each replica's /tokenize at start. --mode chat sends
every request as a chat (one user message holding the prompt as text), so the
chat template and tokenizer run end to end in the router and the replicas;
the default sends token ids.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("workload-replicas") {
				o.wl.Spec.Replicas = o.replicas
			}
			o.llama.changed = cmd.Flags().Changed
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			return runDemo(ctx, o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	o.wl.AddFlags(fs)
	fs.IntVar(&o.replicas, "replicas", 4, "number of replicas")
	fs.StringVar(&o.profile, "profile", "mistral-7b-a6000", "replicas' cost profile (name or YAML file)")
	fs.StringVar(&o.policies, "policies", "round-robin,e2", "comma-separated policies to compare")
	fs.Float64Var(&o.timeScale, "speedup", 1, "run the modelled GPUs this many times faster (the arrival rate is scaled to match)")
	fs.StringVar(&o.jsonPath, "json", "", "write the comparison as JSON to this file (- for stdout)")
	fs.BoolVarP(&o.verbose, "verbose", "v", false, "log the replicas' and the router's messages")
	fs.BoolVar(&o.noEvents, "no-kv-events", false, "do not publish KV events: the router mirrors the replicas' caches from its decisions")
	fs.BoolVar(&o.hold, "hold", false, "after the comparison, keep the last policy's replicas, router and dashboard running until Ctrl-C")
	fs.StringVar(&o.tokenizer, "tokenizer", keying.TokenizerQwen3, "tokenizer of the replicas and the router: qwen3 (bundled), a tokenizer.json, a model directory, or none")
	o.llama.addFlags(fs)
	fs.StringVar(&o.mode, "mode", string(loadgen.ModeCompletions), "how prompts are sent: completions (token ids), text (/v1/completions with text) or chat (/v1/chat/completions)")
	return cmd
}

func init() { rootCmd.AddCommand(newDemoCmd()) }

func runDemo(ctx context.Context, o *demoOptions, stdout, stderr io.Writer) error {
	if o.replicas < 1 {
		return fmt.Errorf("--replicas must be ≥ 1, got %d", o.replicas)
	}
	switch o.llama.engine {
	case "model":
	case "llamacpp":
		return runLlamaDemo(ctx, o, stdout, stderr)
	default:
		return fmt.Errorf("--engine must be model or llamacpp, got %q", o.llama.engine)
	}
	if o.timeScale <= 0 {
		return fmt.Errorf("--speedup must be > 0, got %v", o.timeScale)
	}
	prof, err := costmodel.Resolve(o.profile)
	if err != nil {
		return err
	}
	switch loadgen.Mode(o.mode) {
	case loadgen.ModeCompletions, loadgen.ModeText, loadgen.ModeChat:
	default:
		return fmt.Errorf("--mode must be completions, text or chat, got %q", o.mode)
	}
	var tok *tokenize.Tokenizer
	if o.tokenizer != "" && o.tokenizer != "none" {
		if tok, err = keying.LoadTokenizer(o.tokenizer); err != nil {
			return fmt.Errorf("--tokenizer: %w", err)
		}
	}
	reqs, _, err := o.wl.Load()
	if err != nil {
		return err
	}
	// The modelled GPUs run timeScale times faster: compress arrivals alike.
	if err := workload.ScaleTime(reqs, o.timeScale); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	if o.verbose {
		logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	fmt.Fprintf(stderr, "prefixlb demo: %d replicas of %s on loopback, %s, %d requests at %g req/s; %s\n",
		o.replicas, prof.Name(), o.wl.Describe(), len(reqs), o.wl.Arrival.Rate, demoSpeed(o.timeScale))
	if o.noEvents {
		fmt.Fprintln(stderr, "prefixlb demo: KV events off: the router mirrors the replicas' caches from its own decisions")
	} else {
		fmt.Fprintln(stderr, "prefixlb demo: KV events on: each replica publishes its cache changes over ZeroMQ on loopback; the router follows them")
	}
	if tok != nil {
		fmt.Fprintf(stderr, "prefixlb demo: tokenizer %s in the replicas and the router, %s requests\n", o.tokenizer, o.mode)
	} else {
		fmt.Fprintf(stderr, "prefixlb demo: no tokenizer (one token per word, text-chunk keys), %s requests\n", o.mode)
	}
	if !o.hold {
		fmt.Fprintln(stderr, "prefixlb demo: each policy's router and dashboard live only while its run lasts; --hold keeps the last one up afterwards")
	}
	var results []report.Result
	for _, pol := range strings.Split(o.policies, ",") {
		pol = strings.TrimSpace(pol)
		if o.hold && len(results) == strings.Count(o.policies, ",") {
			o.held = func(res report.Result) error {
				return demoCompare(o, append(results, demoResult(o, prof.Name(), res)), stdout)
			}
		}
		res, err := demoRun(ctx, o, prof.Name(), pol, reqs, tok, logger, stderr)
		if err != nil {
			return fmt.Errorf("demo: policy %s: %w", pol, err)
		}
		results = append(results, demoResult(o, prof.Name(), res))
	}
	if o.held != nil {
		return nil // the last run showed the comparison while holding
	}
	return demoCompare(o, results, stdout)
}

// demoResult labels the result of one run, in the modelled GPU's time.
func demoResult(o *demoOptions, profile string, res report.Result) report.Result {
	// Report times in the modelled GPU's time, so figures compare with sim.
	scaleResult(&res, o.timeScale)
	res.Rate = o.wl.Arrival.Rate
	res.Workload = o.wl.Describe()
	res.Replicas = o.replicas
	res.Profile = profile
	return res
}

// demoCompare prints the comparison of the runs (and writes --json).
func demoCompare(o *demoOptions, results []report.Result, stdout io.Writer) error {
	fmt.Fprintln(stdout)
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n  ttft_ms: time to first token, latency_ms: to the last token, in ms of the modelled GPU's time;\n"+
		"  hit: share of prompt tokens the replicas served from their prefix cache (cached tokens reported / prompt tokens);\n"+
		"  req/s, tok/s: requests completed and tokens generated per second%s\n", demoScaleNote(o.timeScale))
	if len(results) >= 2 {
		a, b := results[0], results[len(results)-1]
		if b.TTFT.Mean > 0 && b.TTFT.P99 > 0 {
			fmt.Fprintf(stdout, "\n%s vs %s: mean TTFT %.2fx lower, p99 TTFT %.2fx lower, mean latency %.2fx lower\n",
				b.Policy, a.Policy, a.TTFT.Mean/b.TTFT.Mean, a.TTFT.P99/b.TTFT.P99, a.Latency.Mean/max(b.Latency.Mean, 1e-9))
		}
	}
	return writeDemoJSON(o.jsonPath, stdout, results)
}

// writeDemoJSON writes --json: nothing for "", stdout for "-", else a file.
func writeDemoJSON(path string, stdout io.Writer, results []report.Result) error {
	switch path {
	case "":
		return nil
	case "-":
		return report.WriteJSON(stdout, results)
	default:
		return report.WriteJSONFile(path, results)
	}
}

// demoSpeed says how fast the modelled GPUs run against real time
// (--speedup), to three significant figures.
func demoSpeed(x float64) string {
	if x == 1 {
		return "modelled GPUs at real speed (--speedup 1)"
	}
	return fmt.Sprintf("modelled GPUs run %.3g× as fast as real time (--speedup %.3g)", x, x)
}

// demoScaleNote is the legend's remark on a time-scaled run.
func demoScaleNote(x float64) string {
	if x == 1 {
		return ""
	}
	return fmt.Sprintf(";\n  the run went %.3g× as fast as real time (--speedup): every figure is converted back to the modelled GPU's time", x)
}

// scaleResult converts wall-clock figures of a time-scaled run back into the
// modelled GPU's time.
func scaleResult(r *report.Result, x float64) {
	if x == 1 {
		return
	}
	for _, s := range []*report.Summary{&r.TTFT, &r.Latency, &r.TPOT} {
		s.Mean, s.P50, s.P90, s.P99 = s.Mean*x, s.P50*x, s.P90*x, s.P99*x
	}
	if r.ITL != nil {
		r.ITL.Mean, r.ITL.P50, r.ITL.P90, r.ITL.P99 = r.ITL.Mean*x, r.ITL.P50*x, r.ITL.P90*x, r.ITL.P99*x
	}
	r.ThroughputRPS /= x
	r.OutputTokensPerS /= x
	r.DurationS *= x
}

// demoRun starts fresh engines and a router with policy pol, drives reqs
// through it, and tears everything down.
func demoRun(ctx context.Context, o *demoOptions, profile, pol string, reqs []workload.Request, tok *tokenize.Tokenizer, logger *slog.Logger, stderr io.Writer) (report.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	prof, err := costmodel.Resolve(profile)
	if err != nil {
		return report.Result{}, err
	}
	serve := func(h http.Handler) (string, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		wg.Add(2)
		go func() { defer wg.Done(); _ = srv.Serve(ln) }()
		go func() {
			defer wg.Done()
			<-ctx.Done()
			sctx, c := context.WithTimeout(context.Background(), 5*time.Second)
			defer c()
			_ = srv.Shutdown(sctx)
		}()
		return "http://" + ln.Addr().String(), nil
	}
	var backends []proxy.Backend
	for i := 0; i < o.replicas; i++ {
		ec := engine.DefaultConfig()
		ec.Replica = replica.DefaultConfig()
		ec.Replica.Profile = prof
		ec.TimeScale = o.timeScale
		ec.Logger = logger
		if tok != nil {
			setEngineTokenizer(&ec, tok)
		}
		var pub *kvevents.Publisher
		if !o.noEvents {
			// Free loopback ports; the engine's Run binds and closes them.
			pub = kvevents.NewPublisher(kvevents.PublisherConfig{
				Endpoint:       "tcp://127.0.0.1:0",
				ReplayEndpoint: "tcp://127.0.0.1:0",
				Topic:          fmt.Sprintf("kv@replica-%d@%s", i, ec.Model),
				Logger:         logger,
			})
			ec.KVPublisher = pub
		}
		e, err := engine.New(ec)
		if err != nil {
			return report.Result{}, err
		}
		runErr := make(chan error, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := e.Run(ctx)
			if err != nil && !errors.Is(err, context.Canceled) {
				logger.Error("engine stopped", "err", err)
			}
			runErr <- err
		}()
		b := proxy.Backend{Name: fmt.Sprintf("replica-%d", i)}
		if pub != nil {
			select {
			case <-pub.Ready():
			case err := <-runErr:
				return report.Result{}, fmt.Errorf("engine %d: %w", i, err)
			}
			if pub.Endpoint() == "" {
				return report.Result{}, fmt.Errorf("engine %d: %w", i, <-runErr)
			}
			b.KVEvents, b.KVReplay = pub.Endpoint(), pub.ReplayEndpoint()
		}
		if b.URL, err = serve(e.Handler()); err != nil {
			return report.Result{}, err
		}
		backends = append(backends, b)
	}
	pc := proxy.DefaultConfig()
	pc.Backends = backends
	pc.Policy = pol
	pc.Profile = profile
	pc.Logger = logger
	pc.ScrapeInterval = 200 * time.Millisecond
	pc.HealthInterval = time.Second
	if tok != nil {
		pc.Keyer = keying.NewTokenizerKeyer(tok, pc.BlockTokens)
	}
	p, err := proxy.New(pc)
	if err != nil {
		return report.Result{}, err
	}
	defer p.Close()
	wg.Add(1)
	go func() { defer wg.Done(); _ = p.Run(ctx) }()
	target, err := serve(p.Handler())
	if err != nil {
		return report.Result{}, err
	}
	if o.held != nil {
		fmt.Fprintf(stderr, "%-14s router %s, dashboard %s/ui/ (kept up after the run: --hold)\n", pol, target, target)
	} else {
		fmt.Fprintf(stderr, "%-14s router %s, dashboard %s/ui/ (only while this run lasts)\n", pol, target, target)
	}
	lc := loadgen.DefaultConfig()
	lc.Target = target
	lc.Policy = pol
	lc.Mode = loadgen.Mode(o.mode)
	lc.Rate = o.wl.Arrival.Rate * o.timeScale
	lc.Workload = o.wl.Describe()
	lc.Progress = stderr
	lc.ProgressAlways = false
	start := time.Now()
	out, err := loadgen.Run(ctx, lc, reqs)
	if err != nil {
		return report.Result{}, err
	}
	fmt.Fprintf(stderr, "%-14s %d requests in %v, %d errors\n", pol, len(reqs), time.Since(start).Round(100*time.Millisecond), out.Result.Errors)
	if o.held != nil {
		if err := o.held(out.Result); err != nil {
			return report.Result{}, err
		}
		fmt.Fprintf(stderr, "\nprefixlb demo: --hold: the %s cluster keeps running; router %s, dashboard %s/ui/ (Ctrl-C to stop)\n", pol, target, target)
		<-ctx.Done()
	}
	return out.Result, nil
}
