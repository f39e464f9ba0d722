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
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"
	"golang.org/x/sync/errgroup"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/prefixlb/prefixlb/internal/calibrate"
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

// backend is one replica as the proxy reaches it: its member of the pool
// (cluster.Member.Front is the backend) and its health-check state.
type backend struct {
	*cluster.Member
	// fails and oks count consecutive failed and good health checks
	// (guarded by the core's Mu).
	fails, oks int
	// hcOK is the health checks' verdict (guarded by Mu): the replica is
	// in routing (Member.Healthy) while it holds and brk does not hold it
	// out.
	hcOK bool
	// brk is its circuit breaker (breaker.go; guarded by Mu; nil: off).
	brk *breaker
	// basePath is the URL's path less a final "/", host its host less
	// an empty port: what forwarded requests are built from (outRequest).
	basePath, host string
	m              *backendMetrics // its children of the metric vectors
}

// Proxy is the router's HTTP front: see the package comment. Create it with
// New; serve Handler; run Run for health checks and load scraping. A Proxy
// is safe for concurrent use.
type Proxy struct {
	cfg    Config
	log    *slog.Logger
	policy string          // the policy's name, as a metric label
	fwd    *http.Transport // forwards client requests
	checks *http.Client    // health checks, scrapes, /v1/models
	m      *metrics
	nextID atomic.Uint64
	// tokenizeNext rotates /tokenize over the up replicas (serveTokenize).
	tokenizeNext atomic.Uint64
	slots        chan struct{} // one per inference request in flight; nil: no bound (limits.go)
	adminTok     tokenDigest   // digest of cfg.AdminToken, when set
	pdOn         bool          // some replica has role prefill: requests may be disaggregated (pd.go)

	// pool is the replicas with their feeds (KV events, load, engine,
	// tokenizer): a static list from Backends, and what Discovery finds.
	pool *cluster.Pool
	// gate is the router-side queue (queue.go); nil when Config.Queue is
	// off.
	gate *cluster.Gate
	mu   *sync.Mutex // the core's Mu: guards rt, the pool's members, the backends and gate's queue
	rt   *router.Router
	dash dashRing // recent decisions for the dashboard (dashboard.go), its own lock
	// scratch holds backendsLocked's answer.
	scratch []*backend

	// hookState, when set (tests), is called after a replica enters or
	// leaves routing (ejected or re-admitted), outside the lock.
	hookState func(name string, up bool)
	// hookShutdown, when set (tests), is called once Serve has stopped
	// accepting connections and is draining.
	hookShutdown func()

	// tenants tells who each request is from and holds their quotas
	// (tenants.go).
	tenants *cluster.Tenants
	// bodies bounds the request-body bytes held (nil: no bound); allow is
	// AllowedPaths compiled (frontdoor_config.go).
	bodies *byteBudget
	allow  allowlist
	// hookReleased, when set (tests), is called after an inference request
	// gave its max_concurrent slot back.
	hookReleased func()
	// gie is the endpoint picker's client (gie.go); nil without
	// Config.EndpointPicker.
	gie *gieClient
	// shadow is the shadow policy's counters and log (shadow.go); nil
	// without Config.ShadowPolicy.
	shadow *shadow
}

// New builds a Proxy from cfg (validated here). It starts nothing: serve
// Handler and call Run.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var cal *calibrate.Config
	prefill, _ := cfg.roles()
	if cfg.Calibrate && prefill == 0 {
		// Calibration learns a replica's speed from requests it prefills and
		// decodes itself; it does not read the legs of disaggregated ones.
		c := cfg.Calibration
		cal = &c
	}
	pol := cfg.Policy
	if cfg.ShadowPolicy != "" {
		pol = cfg.ShadowPolicy // the core shadows the picker (shadow.go)
	}
	core, err := cluster.New(cluster.Settings{BlockTokens: cfg.BlockTokens, Profile: cfg.Profile, Policy: pol,
		Tokenizer: cfg.Tokenizer, Keyer: cfg.Keyer, Seed: cfg.Seed, SpeculativeTTL: cfg.SpeculativeTTL,
		TreeMaxBlocks: cfg.TreeMaxBlocks, Calibrate: cal, MaxPromptTokens: cfg.MaxPromptTokens, KVLink: cfg.KVLink(),
		Adapters: cfg.LoRAAdapters, AdapterBytes: cfg.LoRAAdapterBytes, IgnoreTiers: cfg.IgnoreCacheTiers})
	if err != nil {
		return nil, fmt.Errorf("proxy: config: %w", err)
	}
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
		mu:     &core.Mu,
		m:      m,
		rt:     core.Router,
	}
	if cfg.MaxConcurrent > 0 {
		p.slots = make(chan struct{}, cfg.MaxConcurrent)
	}
	p.bodies = newByteBudget(cfg.MaxInflightBodyBytes)
	if err := m.bodyBytesGauge(p.bodies); err != nil {
		return nil, fmt.Errorf("proxy: metrics: %w", err)
	}
	if p.allow, err = newAllowlist(cfg.AllowedPaths); err != nil {
		return nil, fmt.Errorf("proxy: config: allowed_paths: %w", err)
	}
	if cfg.Queue.On {
		gm, err := cluster.NewGateMetrics(m.Reg)
		if err != nil {
			return nil, fmt.Errorf("proxy: metrics: %w", err)
		}
		if p.gate, err = cluster.NewGate(core, cfg.Queue, gm); err != nil {
			return nil, fmt.Errorf("proxy: config: %w", err)
		}
	}
	if p.tenants, err = cluster.NewTenants(cfg.Tenants, os.Getenv, m.Reg); err != nil {
		return nil, fmt.Errorf("proxy: config: %w", err)
	}
	if prefill > 0 {
		p.pdOn = true
		p.m.Reg.MustRegister(p.m.pd, p.m.pdPrefill)
		for _, o := range pdOutcomes {
			p.m.pd.WithLabelValues(o)
		}
		if cfg.Calibrate {
			log.Info("calibration is off: the cluster has prefill replicas, and calibration does not learn from disaggregated requests (docs/pd.md)")
		}
	}
	if cfg.AdminToken != "" {
		p.adminTok = digestToken(cfg.AdminToken)
	}
	if cfg.EndpointPicker != "" {
		if p.gie, err = newGIEClient(cfg.EndpointPicker, m.Reg); err != nil {
			return nil, err
		}
	}
	if cfg.ShadowPolicy != "" {
		if p.shadow, err = newShadow(core.Policy, cfg.ShadowLog, m.Reg); err != nil {
			if p.gie != nil {
				_ = p.gie.conn.Close()
			}
			return nil, fmt.Errorf("proxy: config: %w", err)
		}
	}
	dialer := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	p.fwd = &http.Transport{
		DialContext: dialer.DialContext,
		// A request's headers and a 4k-token prompt (~25 KB) go out in one
		// write, from the connection's buffer, with no copy buffer per
		// request.
		WriteBufferSize:       64 << 10,
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
	// The pool: scrapes, detections and tokenizer checks are bounded as a
	// health check is, and a replica that did not answer one is asked
	// again at the next health check's pace.
	p.pool, err = cluster.NewPool(core, m.Metrics, cluster.PoolConfig{Kind: cfg.BackendKind,
		ScrapeInterval: cfg.ScrapeInterval, Timeout: cfg.HealthTimeout, Retry: cfg.HealthInterval,
		Client: p.checks, Logger: log, KVEventsListen: cfg.KVEventsListen})
	if err != nil {
		return nil, fmt.Errorf("proxy: config: %w", err)
	}
	p.pool.Hooks = cluster.PoolHooks{
		Added: func(m *cluster.Member) {
			b := newBackend(m, p.m.forBackend(core.Policy, m.Name))
			b.brk = newBreaker(cfg.BreakerFailures, cfg.BreakerWindow, cfg.BreakerEjectionTime)
			m.Front = b
			p.m.replicaAdded(m.Name)
		},
		Removed: func(m *cluster.Member) { p.m.replicaRemoved(m.Name) },
		Feed:    func(ctx context.Context, m *cluster.Member) { p.watch(ctx, m.Front.(*backend)) },
		Up:      p.upChanged,
	}
	for i, b := range cfg.Backends {
		if b.Profile != "" {
			if _, err := costmodel.Resolve(b.Profile); err != nil {
				return nil, fmt.Errorf("proxy: config: backends[%d].profile: %w", i, err)
			}
		}
		r, err := p.replicaOf(b)
		if err == nil {
			err = p.pool.Validate(r)
		}
		if err != nil {
			return nil, fmt.Errorf("proxy: config: backends[%d]: %w", i, err)
		}
		p.pool.Add(r)
	}
	return p, nil
}

// replicaOf is backend b of the config as a replica of the pool.
func (p *Proxy) replicaOf(b Backend) (cluster.Replica, error) {
	u, err := url.Parse(b.URL) // Validate parsed it
	if err != nil {
		return cluster.Replica{}, err
	}
	r := cluster.Replica{Name: backendName(b), Address: cluster.HostPort(u), URL: b.URL, KVEvents: b.KVEvents,
		KVTopic: b.KVTopic, Kind: backendKind(b, p.cfg.BackendKind), Profile: b.Profile, Role: b.Role, Ready: true}
	if strings.HasPrefix(p.cfg.MetricsPath, "/") {
		m := *u
		m.Path = upstream.TrimSlash(u.Path) + p.cfg.MetricsPath
		m.RawPath = ""
		r.MetricsURL = m.String()
	}
	if b.KVEvents != "" {
		if r.KVReplay, err = replayEndpoint(b); err != nil {
			return r, fmt.Errorf("backend %s: %w", r.Name, err)
		}
	}
	return r, nil
}

// Config returns the proxy's configuration.
func (p *Proxy) Config() Config { return p.cfg }

// Handler returns the proxy's HTTP handler: /v1/* forwarded (completions
// and chat routed by prompt), /v1/models (the union of the replicas'),
// /health, /metrics, the debug endpoints POST /debug/route, GET
// /debug/replicas, GET /debug/cache and Go's profiler under /debug/pprof/,
// and the dashboard at /ui with its JSON at /ui/state.json (bearer
// AdminToken when set).
func (p *Proxy) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", p.limited(p.inference(openai.KindCompletion)))
	mux.HandleFunc("POST /v1/chat/completions", p.limited(p.inference(openai.KindChat)))
	mux.HandleFunc("GET /v1/models", p.allowed(p.serveModels))
	mux.HandleFunc("POST /tokenize", p.limit(p.serveTokenize, false))
	mux.HandleFunc("POST /detokenize", p.limit(p.serveTokenize, false))
	mux.HandleFunc("/v1/", p.limited(p.inference(openai.KindOther)))
	mux.HandleFunc("GET /health", p.serveHealth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(p.m.Reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /debug/route", p.admin(p.serveDebugRoute))
	mux.HandleFunc("GET /debug/replicas", p.admin(p.serveDebugReplicas))
	mux.HandleFunc("GET /debug/cache", p.admin(p.serveDebugCache))
	mux.HandleFunc("GET /debug/queue", p.admin(p.serveDebugQueue))
	p.handlePprof(mux)
	mux.Handle("/ui", p.dashboardHandler())
	mux.Handle("/ui/", p.dashboardHandler())
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeErrorStatus(w, http.StatusNotFound, fmt.Errorf("no route for %s %s", r.Method, r.URL.Path))
	})
	if p.cfg.ClientWriteTimeout > 0 {
		return clearWriteDeadline(mux)
	}
	return mux
}

// Run runs the pool's feeds until ctx ends (cluster.Pool.Run): every
// replica's health checks, load scrapes, engine detection, tokenizer
// check and KV-event stream, and, with Config.Discovery, the watch that
// adds and removes replicas. It returns nil when ctx ends.
func (p *Proxy) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return p.pool.Run(ctx) })
	if p.gate != nil {
		g.Go(func() error { p.gate.Run(ctx); return nil })
	}
	if p.shadow != nil {
		g.Go(func() error { p.shadow.run(ctx); return nil })
	}
	if p.cfg.Discovery != "" {
		ports := p.cfg.DiscoveryPorts
		if ports.MetricsPath == "" {
			ports.MetricsPath = p.cfg.MetricsPath
		}
		if p.cfg.ScrapeInterval <= 0 || !strings.HasPrefix(p.cfg.MetricsPath, "/") {
			ports.Metrics = -1
		}
		w, err := discovery.NewWatcher(p.cfg.Discovery, p.cfg.Kubeconfig,
			discovery.Config{Ports: ports, Registry: p.pool, Logger: p.log})
		if err != nil {
			return fmt.Errorf("proxy: discovery: %w", err)
		}
		g.Go(func() error {
			if err := w.Run(ctx); err != nil && ctx.Err() == nil {
				return fmt.Errorf("proxy: discovery: %w", err)
			}
			return nil
		})
	}
	return g.Wait()
}

// Serve serves Handler on ln until ctx ends, then stops accepting and lets
// in-flight requests (streams included) finish for up to DrainTimeout
// before closing what is left. It returns nil after a complete drain.
// Serve does not run the health loops: call Run too.
func (p *Proxy) Serve(ctx context.Context, ln net.Listener) error {
	return p.serveHandler(ctx, ln, p.Handler())
}

// serveHandler is Serve with handler h (Pools serves its own with the
// first pool's server settings).
func (p *Proxy) serveHandler(ctx context.Context, ln net.Listener, h http.Handler) error {
	// No ReadTimeout or WriteTimeout: they would bound streams too. Bodies
	// are bounded per request (BodyReadTimeout, in limited).
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: p.cfg.ReadHeaderTimeout,
		IdleTimeout:       p.cfg.ClientIdleTimeout,
		MaxHeaderBytes:    p.cfg.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(p.log.Handler(), slog.LevelWarn),
		// A connection back to idle drops the write deadline its last
		// response left (clientWriter.finish).
		ConnState: func(c net.Conn, st http.ConnState) {
			if st == http.StateIdle {
				_ = c.SetWriteDeadline(time.Time{})
			}
		},
	}
	p.warnOpenAdmin(ln.Addr())
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
	if p.gie != nil {
		_ = p.gie.conn.Close()
	}
	if p.shadow != nil {
		p.shadow.closeLog()
	}
}

// route decides where req goes, excluding the replicas in exclude (tried
// already), and commits the decision in the core. It returns the chosen
// replica's backend, taken under the lock: a replica that leaves the pool
// meanwhile is still reached for this request. The dashboard records the
// decision after the core's lock is released. A disaggregated decision's
// prefill replica comes with it (prefill; nil otherwise).
func (p *Proxy) route(req policy.Request, exclude []int) (d policy.Decision, b, prefill *backend, err error) {
	now := time.Now()
	p.mu.Lock()
	d, err = p.rt.RouteWithin(req, now, router.Constraint{Exclude: exclude})
	if err != nil {
		p.mu.Unlock()
		return d, nil, nil, err
	}
	b = p.pool.Member(d.Replica).Front.(*backend)
	if d.Disaggregated {
		prefill = p.pool.Member(d.PrefillReplica).Front.(*backend)
	}
	p.mu.Unlock()
	p.dash.record(now, req.PromptTokens, &d)
	return d, b, prefill, nil
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
	p.kickLocked(now)
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
	p.kickLocked(now)
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("router finished", "id", id, "err", err)
	}
}

// checked records one health observation of replica b (an active check,
// or a passive one: a request that could not connect) and ejects or
// re-admits it when a threshold is crossed. eject=true takes the replica
// out at once (it refused a connection).
//
// A replica the circuit breaker holds out (breaker.go) is re-admitted by
// the first good check once its ejection time is up, if its last
// ReadmitAfter checks passed (counted from the ejection).
func (p *Proxy) checked(b *backend, ok, eject bool) {
	now := time.Now()
	p.mu.Lock()
	hc := b.hcOK
	if ok {
		b.fails, b.oks = 0, b.oks+1
		if !hc && b.oks >= p.cfg.ReadmitAfter {
			hc = true
		}
	} else {
		b.oks, b.fails = 0, b.fails+1
		if hc && (eject || b.fails >= p.cfg.EjectAfter) {
			hc = false
		}
	}
	ejectedNow := b.hcOK && !hc
	b.hcOK = hc
	readmitted := false
	if ok && b.brk.due(now) && b.oks >= p.cfg.ReadmitAfter {
		b.brk.readmit(now)
		readmitted = true
	}
	healthy := hc && !b.brk.ejected()
	changed := healthy != b.Healthy()
	up, _ := p.pool.SetHealthy(b.Member, healthy)
	p.mu.Unlock()
	if ejectedNow {
		reason := ejectHealth
		if eject {
			reason = ejectDial
		}
		p.m.ejections.WithLabelValues(b.Name, reason).Inc()
	}
	if !changed {
		return
	}
	if healthy {
		p.log.Info("replica re-admitted", "replica", b.Name, "breaker", readmitted)
	} else {
		p.log.Warn("replica ejected", "replica", b.Name, "passive", eject)
	}
	if p.hookState != nil {
		p.hookState(b.Name, up)
	}
}

// upChanged is the pool's Up hook: a replica entered or left routing
// (discovery's readiness).
func (p *Proxy) upChanged(name string, up bool) {
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
