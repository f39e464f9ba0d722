package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// runModel is the demo on modelled GPUs (EngineModel): for each policy, fresh
// engines and a fresh router, the same workload through it; then the
// comparison.
func runModel(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	if c.Speedup <= 0 {
		return fmt.Errorf("--speedup must be > 0, got %v", c.Speedup)
	}
	if c.PrefillReplicas < 0 || c.PrefillReplicas >= c.Replicas {
		return fmt.Errorf("--prefill-replicas must be in [0, --replicas), got %d of %d", c.PrefillReplicas, c.Replicas)
	}
	prof, err := costmodel.Resolve(c.Profile)
	if err != nil {
		return err
	}
	switch loadgen.Mode(c.Mode) {
	case loadgen.ModeCompletions, loadgen.ModeText, loadgen.ModeChat:
	default:
		return fmt.Errorf("--mode must be completions, text or chat, got %q", c.Mode)
	}
	var tok *tokenize.Tokenizer
	if c.Tokenizer != "" && c.Tokenizer != "none" {
		if tok, err = keying.LoadTokenizer(c.Tokenizer); err != nil {
			return fmt.Errorf("--tokenizer: %w", err)
		}
	}
	reqs, _, err := c.Workload.Load()
	if err != nil {
		return err
	}
	// The modelled GPUs run Speedup times faster: compress arrivals alike.
	if err := workload.ScaleTime(reqs, c.Speedup); err != nil {
		return err
	}
	logger := newLogger(c.Verbose, stderr)
	fmt.Fprintf(stderr, "prefixlb demo: %d replicas of %s on loopback, %s, %d requests at %g req/s; %s\n",
		c.Replicas, prof.Name(), c.Workload.Describe(), len(reqs), c.Workload.Arrival.Rate, speedNote(c.Speedup))
	if c.PrefillReplicas > 0 {
		fmt.Fprintf(stderr, "prefixlb demo: %d prefill + %d decode replicas: disaggregated requests prefill on one and pull their KV to the other (vLLM's P/D protocol)\n",
			c.PrefillReplicas, c.Replicas-c.PrefillReplicas)
	}
	if c.NoKVEvents {
		fmt.Fprintln(stderr, "prefixlb demo: KV events off: the router mirrors the replicas' caches from its own decisions")
	} else {
		fmt.Fprintln(stderr, "prefixlb demo: KV events on: each replica publishes its cache changes over ZeroMQ on loopback; the router follows them")
	}
	switch {
	case tok != nil:
		fmt.Fprintf(stderr, "prefixlb demo: tokenizer %s in the replicas and the router, %s requests\n", c.Tokenizer, c.Mode)
	case loadgen.Mode(c.Mode) != loadgen.ModeCompletions:
		// Text as users send it, to replicas of a Qwen3 model; the router
		// at its defaults (tokenizer auto) learns their tokenizer from
		// their /tokenize.
		if c.engineTok, err = qwen3.Shared(); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "prefixlb demo: replicas tokenize with Qwen3; the router at its defaults (tokenizer auto); %s requests\n", c.Mode)
	default:
		fmt.Fprintf(stderr, "prefixlb demo: no tokenizer (one token per word, text-chunk keys), %s requests\n", c.Mode)
	}
	if !c.Hold {
		fmt.Fprintln(stderr, "prefixlb demo: each policy's router and dashboard live only while its run lasts; --hold keeps the last one up afterwards")
	}
	var results []report.Result
	var held func(report.Result) error
	for _, pol := range strings.Split(c.Policies, ",") {
		pol = strings.TrimSpace(pol)
		if c.Hold && len(results) == strings.Count(c.Policies, ",") {
			// The last run shows the comparison once its load is done,
			// then keeps its cluster up.
			held = func(res report.Result) error {
				return compare(c, append(results, label(c, prof.Name(), res)), stdout)
			}
		}
		res, err := modelRun(ctx, c, prof.Name(), pol, reqs, tok, logger, stderr, held)
		if err != nil {
			return fmt.Errorf("demo: policy %s: %w", pol, err)
		}
		results = append(results, label(c, prof.Name(), res))
	}
	if held != nil {
		return nil // the last run showed the comparison while holding
	}
	return compare(c, results, stdout)
}

// modelRun starts fresh engines and a router with policy pol, drives reqs
// through it, and tears everything down. held, when set, is called with the
// result once the load is done; the run then keeps its cluster up until ctx
// ends (--hold).
func modelRun(ctx context.Context, c Config, profile, pol string, reqs []workload.Request, tok *tokenize.Tokenizer,
	logger *slog.Logger, stderr io.Writer, held func(report.Result) error) (report.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The engines, the router and their HTTP servers run until ctx ends;
	// their errors are logged, not returned: the run's outcome is the
	// load's.
	var g errgroup.Group
	defer func() { _ = g.Wait() }()
	defer cancel()
	prof, err := costmodel.Resolve(profile)
	if err != nil {
		return report.Result{}, err
	}
	var backends []proxy.Backend
	for i := 0; i < c.Replicas; i++ {
		ec := engine.DefaultConfig()
		ec.Replica = replica.DefaultConfig()
		ec.Replica.Profile = prof
		ec.TimeScale = c.Speedup
		ec.Logger = logger
		role := ""
		if c.PrefillReplicas > 0 {
			role = "decode"
			if i < c.PrefillReplicas {
				role = "prefill"
			}
		}
		ec.Replica.Role = role
		if tok != nil {
			ec.SetTokenizer(tok)
		} else if c.engineTok != nil {
			ec.SetTokenizer(c.engineTok)
		}
		var pub *kvevents.Publisher
		if !c.NoKVEvents {
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
		g.Go(func() error {
			err := e.Run(ctx)
			if err != nil && !errors.Is(err, context.Canceled) {
				logger.Error("engine stopped", "err", err)
			}
			runErr <- err
			return nil
		})
		b := proxy.Backend{Name: fmt.Sprintf("replica-%d", i), Role: role}
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
		if b.URL, err = serveLoopback(ctx, &g, e.Handler()); err != nil {
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
	g.Go(func() error { _ = p.Run(ctx); return nil })
	target, err := serveLoopback(ctx, &g, p.Handler())
	if err != nil {
		return report.Result{}, err
	}
	if held != nil {
		fmt.Fprintf(stderr, "%-14s router %s, dashboard %s/ui/ (kept up after the run: --hold)\n", pol, target, target)
	} else {
		fmt.Fprintf(stderr, "%-14s router %s, dashboard %s/ui/ (only while this run lasts)\n", pol, target, target)
	}
	start := time.Now()
	out, err := loadgen.Run(ctx, loadConfig(c, target, pol, c.Workload.Arrival.Rate*c.Speedup, stderr), reqs)
	if err != nil {
		return report.Result{}, err
	}
	fmt.Fprintf(stderr, "%-14s %d requests in %v, %d errors\n", pol, len(reqs), time.Since(start).Round(100*time.Millisecond), out.Result.Errors)
	if held != nil {
		if err := held(out.Result); err != nil {
			return report.Result{}, err
		}
		fmt.Fprintf(stderr, "\nprefixlb demo: --hold: the %s cluster keeps running; router %s, dashboard %s/ui/ (Ctrl-C to stop)\n", pol, target, target)
		<-ctx.Done()
	}
	return out.Result, nil
}

// serveLoopback serves h on a free loopback port in g until ctx ends (then
// shuts it down, giving requests in flight 5 s) and returns its base URL.
func serveLoopback(ctx context.Context, g *errgroup.Group, h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	g.Go(func() error { _ = srv.Serve(ln); return nil })
	g.Go(func() error {
		<-ctx.Done()
		sctx, c := context.WithTimeout(context.Background(), 5*time.Second)
		defer c()
		_ = srv.Shutdown(sctx)
		return nil
	})
	return "http://" + ln.Addr().String(), nil
}
