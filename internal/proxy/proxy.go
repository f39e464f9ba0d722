// Package proxy is `prefixlb serve`: an OpenAI-compatible reverse proxy in
// front of inference replicas (vLLM, SGLang, llama.cpp's llama-server,
// prefixlb engine) that routes every request with the routing core
// (internal/router) and feeds the core what it observes: first tokens,
// finishes, output tokens and the cached tokens the replicas report
// (usage.prompt_tokens_details, or llama.cpp's timings). Each replica's
// engine, its BackendKind, is configured or detected (DetectBackend), and
// says how the core models its cache (llama.cpp: one prompt per slot).
//
// Like net/http/httputil.ReverseProxy it is one concrete type, Proxy,
// configured by a plain Config. Streamed responses (Server-Sent Events) are
// passed through event by event, byte for byte, flushed the moment each
// event's blank line arrives (events that arrived in one read are flushed
// together), and read on the side for the router's observations. A request that fails before any byte reached the client is
// retried on another replica; after that the client gets a clean SSE error
// event. Active health checks eject and re-admit replicas; a loop scrapes
// each replica's /metrics for its load.
//
// The routing core is not safe for concurrent use and does no I/O: the Proxy
// holds its lock only around core calls, never during I/O.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"
	"golang.org/x/sync/errgroup"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/calmetrics"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// Response headers that explain a routing decision.
const (
	// HeaderReplica names the replica that served the response.
	HeaderReplica = "x-prefixlb-replica"
	// HeaderRoute is policy.Decision.Explain of the decision: branch,
	// matched tokens, cost terms per candidate.
	HeaderRoute = "x-prefixlb-route"
	// HeaderRetries counts the replicas tried before the one that answered
	// (absent when the first one did).
	HeaderRetries = "x-prefixlb-retries"
	// HeaderSession is the request header that carries a session key (else
	// the body's "user" is used).
	HeaderSession = "x-session-id"
)

// backend is one replica as the proxy reaches it.
type backend struct {
	id   int
	name string
	url  *url.URL
	sub  *kvevents.Subscriber // nil: no KV events, the router mirrors
	kv   *kvCounters          // with sub
}

// engineState is what the proxy knows of a replica's engine (BackendKind).
type engineState struct {
	// configured is the kind the config gives (BackendAuto: detect).
	configured upstream.Kind
	// kind is the kind in effect: configured, or detected (BackendUnknown
	// until then); slots is its slot count for a slot cache (0: a block
	// cache, or not known).
	kind  upstream.Kind
	slots int
	// due says a detection (or, for a configured llama.cpp, a read of its
	// slot count) is due: at start, on re-admission, and when a scrape's
	// metric names name another engine.
	due bool
	// kvTokens is the last scraped llamacpp:kv_cache_tokens (-1 unknown).
	kvTokens int
}

// newEngine is the engine state of a backend configured as kind.
func newEngine(kind upstream.Kind) engineState {
	e := engineState{configured: kind, kind: kind, kvTokens: -1}
	switch kind {
	case upstream.Auto:
		e.kind, e.due = upstream.Unknown, true
	case upstream.LlamaCpp:
		e.due = true
	}
	return e
}

// health is a replica's health-check state.
type health struct {
	up         bool
	fails, oks int // consecutive failed and good checks
}

// Proxy is the router's HTTP front: see the package comment. Create it with
// New; serve Handler; run Run for health checks and load scraping. A Proxy
// is safe for concurrent use.
type Proxy struct {
	cfg      Config
	log      *slog.Logger
	backends []*backend
	byName   map[string]*backend
	kv       *cluster.KV
	sink     *cluster.Sink   // applies the replicas' KV events to core (kvevents.go)
	policy   string          // the policy's name, as a metric label
	fwd      *http.Transport // forwards client requests
	checks   *http.Client    // health checks, scrapes, /v1/models
	m        *metrics
	nextID   atomic.Uint64
	tokProbe *tokenizerProbe // nil unless the keyer is a *keying.TokenizerKeyer
	slots    chan struct{}   // one per inference request in flight; nil: no bound (limits.go)
	adminTok tokenDigest     // digest of cfg.AdminToken, when set

	core    *cluster.Core
	mu      *sync.Mutex // core.Mu: guards rt, state, engines and dash
	rt      *router.Router
	state   []health
	engines []engineState // by replica id (backendkind.go)
	dash    dashRing      // recent decisions for the dashboard (dashboard.go)

	// hookState, when set (tests), is called after a replica is ejected or
	// re-admitted, outside the lock.
	hookState func(name string, up bool)
	// hookProbe, when set (tests), is called after a tokenizer probe of a
	// replica has recorded its state and the fallback.
	hookProbe func(name string, state int)
	// hookDetect, when set (tests), is called after a replica's backend
	// kind has been detected (or its slots read) and recorded, outside the
	// lock.
	hookDetect func(name string, d upstream.Detection)
	// hookShutdown, when set (tests), is called once Serve has stopped
	// accepting connections and is draining.
	hookShutdown func()
}

// New builds a Proxy from cfg (validated here). It starts nothing: serve
// Handler and call Run.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var cal *calibrate.Config
	if cfg.Calibrate {
		c := cfg.Calibration
		cal = &c
	}
	core, err := cluster.New(cluster.Settings{BlockTokens: cfg.BlockTokens, Profile: cfg.Profile, Policy: cfg.Policy,
		Tokenizer: cfg.Tokenizer, Keyer: cfg.Keyer, Seed: cfg.Seed, SpeculativeTTL: cfg.SpeculativeTTL,
		TreeMaxBlocks: cfg.TreeMaxBlocks, Calibrate: cal, MaxPromptTokens: cfg.MaxPromptTokens})
	if err != nil {
		return nil, fmt.Errorf("proxy: config: %w", err)
	}
	rt, keyer := core.Router, core.Keyer
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	m, err := newMetrics()
	if err != nil {
		return nil, fmt.Errorf("proxy: metrics: %w", err)
	}
	p := &Proxy{
		cfg:    cfg,
		log:    log,
		policy: core.Policy,
		core:   core,
		mu:     &core.Mu,
		m:      m,
		kv:     m.KV,
		rt:     rt,
		byName: make(map[string]*backend),
	}
	if cfg.MaxConcurrent > 0 {
		p.slots = make(chan struct{}, cfg.MaxConcurrent)
	}
	// The global tree's size, read under the core's lock at scrape time.
	p.m.Reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "prefixlb_tree_blocks",
		Help: "Blocks held by the router's global prefix tree (bounded by tree_max_blocks).",
	}, func() float64 {
		p.mu.Lock()
		defer p.mu.Unlock()
		return float64(p.rt.Tree().Blocks())
	}))
	// The router's view of each replica's cache, and each replica's kind,
	// read under the core's lock at scrape time (metrics.go).
	p.m.Reg.MustRegister(cluster.CacheCollector{Rows: p.cacheRows})
	p.m.Reg.MustRegister(calmetrics.Collector{Rows: p.calibrationRows})
	if cfg.AdminToken != "" {
		p.adminTok = digestToken(cfg.AdminToken)
	}
	p.sink = p.kvSink()
	for i, b := range cfg.Backends {
		u, _ := url.Parse(b.URL) // Validate parsed it
		name := backendName(b)
		id := rt.AddReplica(name, b.KVEvents != "")
		if b.Profile != "" {
			bp, err := costmodel.Resolve(b.Profile)
			if err != nil {
				return nil, fmt.Errorf("proxy: config: backends[%d].profile: %w", i, err)
			}
			if err := rt.SetProfile(id, bp); err != nil {
				return nil, fmt.Errorf("proxy: config: backends[%d].profile: %w", i, err)
			}
		}
		be := &backend{id: id, name: name, url: u}
		if b.KVEvents != "" {
			if err := p.addSubscriber(be, b); err != nil {
				return nil, fmt.Errorf("proxy: backend %s: %w", name, err)
			}
		}
		p.backends = append(p.backends, be)
		p.byName[name] = be
		p.state = append(p.state, health{up: true})
		p.engines = append(p.engines, newEngine(backendKind(b, cfg.BackendKind)))
		p.m.ReplicaAdded(name, b.KVEvents != "")
		p.m.up.WithLabelValues(name).Set(1)
		p.m.inflight.WithLabelValues(name)
	}
	if tk, ok := keyer.(*keying.TokenizerKeyer); ok {
		p.tokProbe = newTokenizerProbe(tk, len(p.backends))
		for _, b := range p.backends {
			p.m.tokMatch.WithLabelValues(b.name).Set(tokUnknown)
		}
		p.m.tokFallback.Set(boolFloat(tk.Fallback()))
	}
	dialer := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	p.fwd = &http.Transport{
		DialContext:           dialer.DialContext,
		ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		IdleConnTimeout:       90 * time.Second,
		MaxIdleConnsPerHost:   256,
		DisableCompression:    true, // identity bodies: the proxy reads them on the side
		ExpectContinueTimeout: time.Second,
	}
	p.checks = &http.Client{
		Transport: &http.Transport{
			DialContext:         dialer.DialContext,
			IdleConnTimeout:     90 * time.Second,
			MaxIdleConnsPerHost: 4,
		},
		Timeout: cfg.HealthTimeout,
	}
	return p, nil
}

// Config returns the proxy's configuration.
func (p *Proxy) Config() Config { return p.cfg }

// Handler returns the proxy's HTTP handler: /v1/* forwarded (completions
// and chat routed by prompt), /v1/models (the union of the replicas'),
// /health, /metrics, the debug endpoints POST /debug/route, GET
// /debug/replicas and GET /debug/cache, and the dashboard at /ui with its
// JSON at /ui/state.json (bearer AdminToken when set).
func (p *Proxy) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", p.limited(func(w http.ResponseWriter, r *http.Request) { p.serveInference(w, r, openai.KindCompletion) }))
	mux.HandleFunc("POST /v1/chat/completions", p.limited(func(w http.ResponseWriter, r *http.Request) { p.serveInference(w, r, openai.KindChat) }))
	mux.HandleFunc("GET /v1/models", p.serveModels)
	mux.HandleFunc("/v1/", p.limited(func(w http.ResponseWriter, r *http.Request) { p.serveInference(w, r, openai.KindOther) }))
	mux.HandleFunc("GET /health", p.serveHealth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(p.m.Reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /debug/route", p.admin(p.serveDebugRoute))
	mux.HandleFunc("GET /debug/replicas", p.admin(p.serveDebugReplicas))
	mux.HandleFunc("GET /debug/cache", p.admin(p.serveDebugCache))
	mux.Handle("/ui", p.dashboardHandler())
	mux.Handle("/ui/", p.dashboardHandler())
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeErrorStatus(w, http.StatusNotFound, fmt.Errorf("no route for %s %s", r.Method, r.URL.Path))
	})
	return mux
}

// Run checks every replica's health and scrapes its load, one goroutine per
// replica, and follows the KV-event stream of every replica that has one,
// until ctx ends; it returns nil then.
func (p *Proxy) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		p.runKV(ctx)
	}()
	for _, b := range p.backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.watch(ctx, b)
		}()
	}
	wg.Wait()
	return nil
}

// Serve serves Handler on ln until ctx ends, then stops accepting and lets
// in-flight requests (streams included) finish for up to DrainTimeout
// before closing what is left. It returns nil after a complete drain.
// Serve does not run the health loops: call Run too.
func (p *Proxy) Serve(ctx context.Context, ln net.Listener) error {
	// No ReadTimeout or WriteTimeout: they would bound streams too. Bodies
	// are bounded per request (BodyReadTimeout, in limited).
	srv := &http.Server{
		Handler:           p.Handler(),
		ReadHeaderTimeout: p.cfg.ReadHeaderTimeout,
		IdleTimeout:       p.cfg.ClientIdleTimeout,
		MaxHeaderBytes:    p.cfg.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
	}
	if p.hookShutdown != nil {
		srv.RegisterOnShutdown(p.hookShutdown)
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("proxy: serve: %w", err)
	case <-ctx.Done():
	}
	p.log.Info("draining", "timeout", p.cfg.DrainTimeout)
	dctx, cancel := context.WithTimeout(context.Background(), p.cfg.DrainTimeout)
	defer cancel()
	err := srv.Shutdown(dctx)
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		p.log.Warn("serve ended", "err", serr)
	}
	if err != nil {
		_ = srv.Close()
		return fmt.Errorf("proxy: drain: %w", err)
	}
	return nil
}

// RunAndServe is Run and Serve together, as `prefixlb serve` runs them:
// the health loops and KV feeds keep running while Serve drains, and stop
// once it has.
func (p *Proxy) RunAndServe(ctx context.Context, ln net.Listener) error {
	feeds, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	var g errgroup.Group
	g.Go(func() error { return p.Run(feeds) })
	err := p.Serve(ctx, ln)
	stop()
	_ = g.Wait() // Run returns nil
	return err
}

// Close releases idle connections to the replicas.
func (p *Proxy) Close() {
	p.fwd.CloseIdleConnections()
	p.checks.CloseIdleConnections()
}

// route decides where req goes, excluding the replicas in exclude (tried
// already), and commits the decision in the core.
func (p *Proxy) route(req policy.Request, exclude []int) (policy.Decision, error) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	d, err := p.rt.RouteWithin(req, now, router.Constraint{Exclude: exclude})
	if err == nil {
		p.dash.record(now, req.PromptTokens, &d)
	}
	return d, err
}

// predict returns the decision for req without committing it.
func (p *Proxy) predict(req policy.Request) (policy.Decision, error) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rt.Predict(req, now)
}

// firstToken reports request id's first output token to the core.
func (p *Proxy) firstToken(id uint64) {
	now := time.Now()
	p.mu.Lock()
	err := p.rt.FirstToken(id, now)
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("router first token", "id", id, "err", err)
	}
}

// finish reports the end of request id to the core.
func (p *Proxy) finish(id uint64, outputTokens, cachedTokens int, ok bool) {
	p.finishWith(id, router.Finish{OutputTokens: outputTokens, CachedTokens: cachedTokens, OK: ok})
}

// finishWith reports the end of request id to the core, with what the
// replica measured (llama.cpp's timings) and the stream's token gaps.
func (p *Proxy) finishWith(id uint64, fin router.Finish) {
	now := time.Now()
	p.mu.Lock()
	err := p.rt.Finish(id, fin, now)
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("router finished", "id", id, "err", err)
	}
}

// calibrationRows snapshots each replica's calibration for the metrics.
func (p *Proxy) calibrationRows() []calmetrics.Row {
	rows := make([]calmetrics.Row, len(p.backends))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, b := range p.backends {
		fit, st, ok := p.rt.Calibration(b.id)
		rows[i] = calmetrics.Row{Replica: b.name, Calibrated: ok, Fit: fit, Stats: st}
	}
	return rows
}

// checked records one health observation of replica id (an active check,
// or a passive one: a request that could not connect) and ejects or
// re-admits it when a threshold is crossed. eject=true takes the replica
// out at once (it refused a connection).
func (p *Proxy) checked(id int, ok, eject bool) {
	now := time.Now()
	changed := false
	p.mu.Lock()
	s := &p.state[id]
	if ok {
		s.fails, s.oks = 0, s.oks+1
		if !s.up && s.oks >= p.cfg.ReadmitAfter {
			s.up, changed = true, true
		}
	} else {
		s.oks, s.fails = 0, s.fails+1
		if s.up && (eject || s.fails >= p.cfg.EjectAfter) {
			s.up, changed = false, true
		}
	}
	up := s.up
	if changed && up && p.tokProbe != nil {
		p.tokProbe.markDue(id) // a replica that comes back may be another build
	}
	if changed && up {
		p.engines[id].markDue() // or another engine
	}
	if changed {
		if err := p.rt.SetUp(id, up, now); err != nil {
			p.log.Error("router set up", "replica", p.backends[id].name, "err", err)
		}
	}
	p.mu.Unlock()
	if !changed {
		return
	}
	name := p.backends[id].name
	if up {
		p.m.up.WithLabelValues(name).Set(1)
		p.log.Info("replica re-admitted", "replica", name)
	} else {
		p.m.up.WithLabelValues(name).Set(0)
		p.log.Warn("replica ejected", "replica", name, "passive", eject)
	}
	if p.hookState != nil {
		p.hookState(name, up)
	}
}

// upCount is the number of replicas in routing.
func (p *Proxy) upCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rt.UpCount()
}
