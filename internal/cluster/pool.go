package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// Replica is one replica of a pool as a static config or discovery names
// it: where it is, what it feeds the router, and whether it takes
// requests. discovery.Replica and epp.Replica are this type.
type Replica struct {
	// Name identifies the replica (a pod's name, serve's backend name);
	// unique in the pool.
	Name string
	// Address is "host:port", what a gateway forwards to (epp's answer).
	Address string
	// URL is the replica's base URL ("": "http://"+Address): serve forwards
	// there, and the engine's kind, its /tokenize and its health are read
	// there.
	URL string
	// MetricsURL is the replica's Prometheus page ("": not scraped).
	MetricsURL string
	// KVEvents is the replica's KV-event PUB socket, "tcp://host:5557"
	// ("": none; the router mirrors its cache from its own decisions).
	KVEvents string
	// KVReplay is the replica's replay ROUTER socket ("": none).
	KVReplay string
	// KVTopic is the subscription prefix ("": every topic). Without
	// KVEvents, with the pool's listener (PoolConfig.KVEventsListen), a
	// message whose topic is exactly KVTopic is the replica's.
	KVTopic string
	// Kind is the replica's engine ("": the pool's PoolConfig.Kind).
	Kind upstream.Kind
	// Profile is the replica's own cost profile (costmodel.Resolve; "":
	// the core's), for a pool of mixed GPUs.
	Profile string
	// Role is the replica's role in a disaggregated cluster
	// (policy.ParseRole: "" or "both", "prefill", "decode").
	Role string
	// Ready says whether the replica takes requests (a pod's readiness;
	// always true for a static backend).
	Ready bool
}

// sameEndpoints reports whether a and b are the same replica at the same
// endpoints (readiness aside).
func sameEndpoints(a, b Replica) bool {
	a.Ready, b.Ready = false, false
	return a == b
}

// Member is a replica in a pool: the Replica it was added as, its router
// ID, and what the pool knows of it. Its exported fields are set when it
// joins and never change; the rest is guarded by the core's Mu.
type Member struct {
	Replica
	// ID is its router ID (a slot a removed replica may have held before).
	ID int
	// Base is Replica.URL, parsed.
	Base *url.URL
	// Front is the front door's own state of the replica (PoolHooks.Added
	// sets it).
	Front any

	healthy bool               // the front door's health checks pass (SetHealthy)
	role    policy.Role        // Replica.Role, parsed
	stop    context.CancelFunc // ends its feeds (nil: not started)
	sub     *kvevents.Subscriber
	// listen: the replica has no KVEvents and the pool a listener, which
	// may receive its events; listenOn: its first batch arrived, and the
	// router takes its cache from events (Router.SetEvents).
	listen, listenOn bool
	kv               kvCounts

	// The engine: kind is the one in effect (upstream.Unknown until
	// detected), slots a slot cache's slot count, kindDue says a detection
	// is due, kindWake wakes its loop; kvTokens is the last scraped
	// llamacpp:kv_cache_tokens (-1 unknown).
	kind     upstream.Kind
	slots    int
	kindDue  bool
	kindWake chan struct{}
	// slotTries counts the detections in a row that found a slot cache
	// but not its slot count (slotRetries).
	slotTries int
	kvTokens  int
	// The engine's KV capacity: scrapeCap as its metrics page last stated
	// it (kept through a failed scrape), detectCap as its last detection
	// read it (/get_server_info, /props); capLogged is the capacity and
	// source last logged.
	scrapeCap, detectCap upstream.Capacity
	capLogged            string
	// The tokenizer check, when on: tokDue says a check is due, tokState
	// is what the last answered one found, tokWake wakes its loop.
	tokDue   bool
	tokState keying.TokenizerState
	tokWake  chan struct{}
}

// kvCounts count what one replica's events did to the router.
type kvCounts struct {
	stored, removed, cleared, cpu, unknownParent, tierStored, tierRemoved atomic.Uint64
}

// Up reports whether the replica is in routing: ready and healthy (Mu
// held).
func (m *Member) Up() bool { return m.Ready && m.healthy }

// PDRole is the replica's role in a disaggregated cluster (Replica.Role,
// parsed).
func (m *Member) PDRole() policy.Role { return m.role }

// Healthy reports the front door's health verdict (SetHealthy; Mu held).
func (m *Member) Healthy() bool { return m.healthy }

// Kind is the engine in effect (Mu held).
func (m *Member) Kind() upstream.Kind { return m.kind }

// PoolConfig configures a Pool's feeds. Zero fields take the defaults given.
type PoolConfig struct {
	// Kind is the engine of replicas that name none (default
	// upstream.Auto: each is detected when it joins and whenever it is in
	// routing again).
	Kind upstream.Kind
	// ScrapeInterval is how often each replica's MetricsURL is read for its
	// queue and KV usage (0: never).
	ScrapeInterval time.Duration
	// Timeout bounds each scrape, detection and tokenizer-check request
	// (default 2s).
	Timeout time.Duration
	// Retry is how soon a detection or tokenizer check that got no answer
	// is tried again (default ScrapeInterval, else 5s).
	Retry time.Duration
	// Client makes the feeds' HTTP requests (nil: one of the pool's own).
	Client *http.Client
	// Logger receives the pool's logs (nil: slog.Default()).
	Logger *slog.Logger
	// KVEventsListen, when set, is where the pool binds one SUB socket
	// that engines' KV-event PUB sockets dial ("tcp://0.0.0.0:5557";
	// kvevents.Listener). A message is a member's when the pod part of its
	// topic "kv@<pod>@<model>" is the member's host:port (HostPort of its
	// URL, or its Address), or a bare host only that member has, or its
	// name; or when the topic is the member's KVTopic. Members with their
	// own KVEvents are dialled as before and never take the listener's
	// messages. A member is mirrored until its first batch arrives.
	KVEventsListen string
}

func (c *PoolConfig) defaults() {
	if c.Kind == "" {
		c.Kind = upstream.Auto
	}
	if c.Timeout <= 0 {
		c.Timeout = 2 * time.Second
	}
	if c.Retry <= 0 {
		c.Retry = c.ScrapeInterval
	}
	if c.Retry <= 0 {
		c.Retry = 5 * time.Second
	}
	if c.Client == nil {
		c.Client = &http.Client{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// PoolHooks let a front door keep its own state beside each member and
// tests wait on the feeds. Set them before the first Add.
type PoolHooks struct {
	// Added and Removed are called with Mu held when a member joins or
	// leaves (serve sets Member.Front).
	Added, Removed func(m *Member)
	// Feed, when set, is the front door's own loop for a member (serve's
	// health checks), run with its feeds until it leaves or Run ends.
	Feed func(ctx context.Context, m *Member)
	// Up is called, without Mu, when a member enters or leaves routing.
	Up func(name string, up bool)
	// Detected is called, without Mu, after each engine detection is
	// recorded.
	Detected func(name string, d upstream.Detection)
	// Tokenizer is called, without Mu, after each tokenizer check
	// (recorded, or not answered).
	Tokenizer func(name string, state keying.TokenizerState, err error)
	// KV is called with Mu held after each KV event applied to the router.
	KV func()
}

// Pool is the set of replicas behind one Core: members join, leave and
// change readiness (from a static list, discovery, or serve's health
// checks), each in its router slot, with its feeds — KV events, load
// scrapes, engine detection and the tokenizer check — run while Run runs.
// serve and epp hold one each; every method is safe for concurrent use.
type Pool struct {
	*Core
	// Hooks: see PoolHooks.
	Hooks PoolHooks

	cfg  PoolConfig
	m    *Metrics
	sink *Sink
	tok  *keying.TokenizerKeyer // nil: no tokenizer check
	// listener receives the events of engines that dial the pool (nil:
	// no KVEventsListen).
	listener *kvevents.Listener
	// check is tok's tokenizer check (tokenizerCheck): the Qwen3 probe ids
	// for an auto keyer, else made from the loaded tokenizer.
	checkOnce sync.Once
	check     *keying.TokenizerCheck
	loadOnce  sync.Once          // loadAutoTokenizer
	byName    map[string]*Member // guarded by Mu, as everything below
	byAddr    map[string]*Member
	slots     []*Member // by router ID; nil for a free slot
	members   []*Member // scratch of Members
	runCtx    context.Context
	wg        sync.WaitGroup
}

// NewPool returns an empty pool over core, counting in m. It starts
// nothing.
func NewPool(core *Core, m *Metrics, cfg PoolConfig) (*Pool, error) {
	if _, err := upstream.ParseKind(string(cfg.Kind)); err != nil {
		return nil, fmt.Errorf("backend kind: %w", err)
	}
	cfg.defaults()
	p := &Pool{Core: core, cfg: cfg, m: m, byName: make(map[string]*Member), byAddr: make(map[string]*Member)}
	if tk, ok := core.Keyer.(*keying.TokenizerKeyer); ok {
		p.tok = tk
	}
	p.sink = &Sink{Core: core, KV: m.KV, Log: cfg.Logger, IgnoreTiers: core.ignoreTiers,
		ID: func(name string) int {
			if r, ok := p.byName[name]; ok && (r.sub != nil || r.listen) {
				return r.ID
			}
			return -1
		},
		Applied: func(name, outcome string) {
			r := p.byName[name]
			r.kv.add(outcome)
			if outcome != OutcomeCPUIgnored && p.Hooks.KV != nil {
				p.Hooks.KV()
			}
		},
	}
	if cfg.KVEventsListen != "" {
		p.listener = kvevents.NewListener(kvevents.ListenerConfig{Endpoint: cfg.KVEventsListen,
			Resolve: p.resolveTopic, OnFirstBatch: p.listenFirstBatch,
			Index: m.KV.Index, Sink: p.sink, Metrics: m.KV.Metrics, Logger: p.cfg.Logger})
	}
	m.Reg.MustRegister(poolCollector{p}, CacheCollector{Rows: p.cacheRows})
	k := p.Keying()
	p.cfg.Logger.Info("keying text and chats", "mode", k.Mode, "tokenizer", k.Tokenizer, "auto", k.Auto, "why", k.Why)
	return p, nil
}

// Validate checks r as Add would take it.
func (p *Pool) Validate(r Replica) error {
	if r.Name == "" {
		return errors.New("replica: a name is required")
	}
	if _, err := memberURL(r); err != nil {
		return fmt.Errorf("replica %s: %w", r.Name, err)
	}
	if _, err := upstream.ParseKind(string(r.Kind)); err != nil {
		return fmt.Errorf("replica %s: kind: %w", r.Name, err)
	}
	if r.Profile != "" {
		if _, err := costmodel.Resolve(r.Profile); err != nil {
			return fmt.Errorf("replica %s: profile: %w", r.Name, err)
		}
	}
	if _, err := policy.ParseRole(r.Role); err != nil {
		return fmt.Errorf("replica %s: %w", r.Name, err)
	}
	return nil
}

// memberURL is r's base URL, parsed.
func memberURL(r Replica) (*url.URL, error) {
	s := r.URL
	if s == "" {
		if r.Address == "" {
			return nil, errors.New("an address or a URL is required")
		}
		s = "http://" + r.Address
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("url: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("url %q: want http(s)://host[:port][/path]", s)
	}
	return u, nil
}

// Add adds a replica, or updates the one of the same name: the same
// endpoints change only its readiness; others make it a new replica (the
// old one leaves first). A replica Validate refuses is logged and left
// out (discovery's Registry has no error to return).
func (p *Pool) Add(r Replica) {
	if err := p.Validate(r); err != nil {
		p.cfg.Logger.Error("pool: replica refused", "replica", r.Name, "err", err)
		return
	}
	p.Mu.Lock()
	up, changed := p.add(r)
	p.Mu.Unlock()
	if changed && p.Hooks.Up != nil {
		p.Hooks.Up(r.Name, up)
	}
}

// add is Add with Mu held (r valid); it reports the member's routing state
// and whether it changed.
func (p *Pool) add(r Replica) (up, changed bool) {
	if old, ok := p.byName[r.Name]; ok {
		if sameEndpoints(old.Replica, r) {
			return p.setReady(old, r.Ready)
		}
		p.remove(old)
	}
	u, _ := memberURL(r) // validated
	if r.Address == "" {
		r.Address = u.Host
	}
	if r.Kind == "" {
		r.Kind = p.cfg.Kind
	}
	now := time.Now()
	m := &Member{Replica: r, ID: -1, Base: u, healthy: true, tokState: keying.TokenizerUnknown,
		tokWake: make(chan struct{}, 1), kindWake: make(chan struct{}, 1), kvTokens: -1}
	// Reuse a free slot with nothing left in flight, else add one.
	for id, s := range p.slots {
		if s != nil {
			continue
		}
		if st, err := p.Router.Replica(id); err == nil && st.InFlight == 0 {
			m.ID = id
			break
		}
	}
	reused := m.ID >= 0
	if !reused {
		m.ID = p.Router.AddReplica(r.Name, r.KVEvents != "")
		p.slots = append(p.slots, nil)
	} else {
		_ = p.Router.CacheCleared(m.ID)
		_ = p.Router.SetEvents(m.ID, r.KVEvents != "")
		_ = p.Router.ReplicaLoad(m.ID, -1, -1, -1)
		_ = p.Router.SetExternalLoad(m.ID, router.ExternalLoad{})
		_ = p.Router.SetName(m.ID, r.Name)
		_ = p.Router.SetKVCapacity(m.ID, 0, "") // the old replica's
	}
	if reused || r.Profile != "" {
		// Its own profile, or another replica's speed learnt afresh.
		prof := p.Profile
		if r.Profile != "" {
			prof, _ = costmodel.Resolve(r.Profile) // validated
		}
		_ = p.Router.SetProfile(m.ID, prof)
	}
	_ = p.Router.SetAdapterBytes(m.ID, p.adapterBytes) // ≥ 0: New checked it
	_ = p.Router.SetUp(m.ID, m.Up(), now)
	m.role, _ = policy.ParseRole(r.Role) // validated
	_ = p.Router.SetRole(m.ID, m.role)
	m.kind = r.Kind
	if r.Kind == upstream.Auto {
		m.kind = upstream.Unknown
	}
	_ = p.Router.SetCacheSlots(m.ID, 0) // a reused slot may have had a slot cache
	p.markKindDue(m)
	p.markTokenizerDue(m)
	m.listen = r.KVEvents == "" && p.listener != nil
	if r.KVEvents != "" {
		m.sub = kvevents.NewSubscriber(kvevents.SubscriberConfig{
			Replica: r.Name, Endpoint: r.KVEvents, ReplayEndpoint: r.KVReplay, Topic: r.KVTopic,
			Index: p.m.KV.Index, Sink: p.sink, Metrics: p.m.KV.Metrics, Logger: p.cfg.Logger,
		})
	}
	p.slots[m.ID] = m
	p.byName[r.Name] = m
	p.byAddr[r.Address] = m
	p.m.ReplicaAdded(r.Name, r.KVEvents != "" || m.listen)
	if p.Hooks.Added != nil {
		p.Hooks.Added(m)
	}
	if p.runCtx != nil {
		p.start(m)
	}
	p.cfg.Logger.Info("replica added", "replica", r.Name, "url", u.String(), "ready", r.Ready, "kv_events", r.KVEvents)
	return m.Up(), true
}

// Remove takes replica name out of the pool: it is never routed to again
// and its cache leaves the router's tree. Requests in flight on it finish
// as usual.
func (p *Pool) Remove(name string) {
	p.Mu.Lock()
	m, ok := p.byName[name]
	if ok {
		p.remove(m)
	}
	p.Mu.Unlock()
	if ok {
		p.cfg.Logger.Info("replica removed", "replica", name)
	}
}

func (p *Pool) remove(m *Member) {
	_ = p.Router.SetUp(m.ID, false, time.Now())
	_ = p.Router.CacheCleared(m.ID)
	_ = p.Router.SetExternalLoad(m.ID, router.ExternalLoad{})
	if m.stop != nil {
		m.stop()
	}
	if p.listener != nil {
		p.listener.Forget(m.Name) // a successor of its name starts a new stream
	}
	p.m.KV.Index.Forget(m.Name)
	p.m.ReplicaRemoved(m.Name)
	p.slots[m.ID] = nil
	delete(p.byName, m.Name)
	if p.byAddr[m.Address] == m {
		delete(p.byAddr, m.Address)
	}
	if p.Hooks.Removed != nil {
		p.Hooks.Removed(m)
	}
	p.setTokenizerFallback() // it may have been the one that mismatched
}

// SetReady marks replica name ready or not (a pod's readiness).
func (p *Pool) SetReady(name string, ready bool) {
	p.Mu.Lock()
	var up, changed bool
	if m, ok := p.byName[name]; ok {
		up, changed = p.setReady(m, ready)
	}
	p.Mu.Unlock()
	if changed && p.Hooks.Up != nil {
		p.Hooks.Up(name, up)
	}
}

func (p *Pool) setReady(m *Member, ready bool) (up, changed bool) {
	if m.Ready == ready {
		return m.Up(), false
	}
	was := m.Up()
	m.Ready = ready
	p.cfg.Logger.Info("replica readiness", "replica", m.Name, "ready", ready)
	return p.routed(m, was)
}

// SetHealthy records the front door's health verdict on m (Mu held): a
// replica that fails its checks leaves routing until they pass again. It
// reports m's routing state and whether it changed; the caller calls
// Hooks.Up, outside Mu.
func (p *Pool) SetHealthy(m *Member, healthy bool) (up, changed bool) {
	if m.healthy == healthy {
		return m.Up(), false
	}
	was := m.Up()
	m.healthy = healthy
	return p.routed(m, was)
}

// routed gives the router m's routing state after a change from was, and
// makes a replica back in routing due a detection and a tokenizer check:
// it may run another engine or another build now.
func (p *Pool) routed(m *Member, was bool) (up, changed bool) {
	up = m.Up()
	if up == was {
		return up, false
	}
	if err := p.Router.SetUp(m.ID, up, time.Now()); err != nil {
		p.cfg.Logger.Error("router set up", "replica", m.Name, "err", err)
	}
	if up {
		p.markKindDue(m)
		p.markTokenizerDue(m)
	}
	return up, true
}

// Member returns the member in router slot id, or nil (Mu held).
func (p *Pool) Member(id int) *Member {
	if id < 0 || id >= len(p.slots) {
		return nil
	}
	return p.slots[id]
}

// ByName returns the member called name, or nil (Mu held).
func (p *Pool) ByName(name string) *Member { return p.byName[name] }

// ByAddress returns the member at address "host:port", or nil (Mu held).
func (p *Pool) ByAddress(addr string) *Member { return p.byAddr[addr] }

// Members returns the members by router ID (Mu held). The slice is the
// pool's scratch: valid until the next call.
func (p *Pool) Members() []*Member {
	p.members = p.members[:0]
	for _, m := range p.slots {
		if m != nil {
			p.members = append(p.members, m)
		}
	}
	return p.members
}

// Len is the number of members (Mu held).
func (p *Pool) Len() int { return len(p.byName) }

// Run runs every member's feeds until ctx ends; members added meanwhile get
// theirs at once, removed ones lose them, and the router's speculative
// entries are expired. It returns when ctx ends and every feed has
// stopped.
func (p *Pool) Run(ctx context.Context) error {
	p.Mu.Lock()
	if p.runCtx != nil {
		p.Mu.Unlock()
		return errors.New("cluster: pool already running")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	p.runCtx = ctx
	for _, m := range p.slots {
		if m != nil {
			p.start(m)
		}
	}
	p.Mu.Unlock()
	var lerr error
	if p.listener != nil {
		// A failed bind ends Run with its error: serve and epp fail at
		// start rather than mirror every cache unawares.
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			if err := p.listener.Run(ctx); err != nil {
				lerr = fmt.Errorf("cluster: kv events listener: %w", err)
				cancel()
			}
		}()
	}
	p.ExpireSpeculative(ctx, 500*time.Millisecond)
	p.Mu.Lock()
	p.runCtx = nil
	p.Mu.Unlock()
	p.wg.Wait()
	return lerr
}

// Listener is the pool's KV-event listener (nil without
// PoolConfig.KVEventsListen).
func (p *Pool) Listener() *kvevents.Listener { return p.listener }

// resolveTopic names the listening member a KV-event topic belongs to
// (PoolConfig.KVEventsListen says how); it runs on the listener's
// goroutine.
func (p *Pool) resolveTopic(topic string) (string, bool) {
	pod := kvevents.TopicPod(topic)
	p.Mu.Lock()
	defer p.Mu.Unlock()
	byHost := ""
	hosts := 0
	for _, m := range p.slots {
		if m == nil || !m.listen {
			continue
		}
		switch {
		case m.KVTopic != "" && topic == m.KVTopic:
			return m.Name, true
		case pod == "":
		case pod == HostPort(m.Base) || pod == m.Address || pod == m.Name:
			return m.Name, true
		case pod == m.Base.Hostname():
			byHost = m.Name
			hosts++
		}
	}
	if hosts == 1 {
		return byHost, true
	}
	return "", false
}

// listenFirstBatch switches member name, if it is still a listening
// member, from mirrored to event-fed: its first batch arrived through the
// listener (which applies it next). It runs on the listener's goroutine.
func (p *Pool) listenFirstBatch(name string) {
	p.Mu.Lock()
	m, ok := p.byName[name]
	if ok && m.listen && !m.listenOn {
		m.listenOn = true
		if err := p.Router.SetEvents(m.ID, true); err != nil {
			p.cfg.Logger.Error("router set events", "replica", name, "err", err)
		}
	}
	p.Mu.Unlock()
	if ok {
		p.cfg.Logger.Info("replica's KV events arrive through the listener: its cache is taken from them",
			"replica", name, "listen", p.cfg.KVEventsListen)
	}
}

// start launches m's feeds under Run's context (Mu held).
func (p *Pool) start(m *Member) {
	ctx, cancel := context.WithCancel(p.runCtx)
	m.stop = cancel
	goFeed := func(f func(context.Context)) {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			f(ctx)
		}()
	}
	if m.sub != nil {
		goFeed(func(ctx context.Context) {
			if err := m.sub.Run(ctx); err != nil {
				p.cfg.Logger.Error("kv events subscriber", "replica", m.Name, "err", err)
			}
		})
	}
	if m.MetricsURL != "" && p.cfg.ScrapeInterval > 0 {
		goFeed(func(ctx context.Context) { p.scrapeLoop(ctx, m) })
	}
	if p.tok != nil {
		goFeed(func(ctx context.Context) { p.tokenizerLoop(ctx, m) })
	}
	if needsDetection(m.Replica.Kind) {
		goFeed(func(ctx context.Context) { p.detectLoop(ctx, m) })
	}
	if p.Hooks.Feed != nil {
		goFeed(func(ctx context.Context) { p.Hooks.Feed(ctx, m) })
	}
}

// needsDetection: auto is detected, llama.cpp's slot count and KV
// capacity read, SGLang's KV capacity read (/get_server_info); vLLM states
// its capacity on its metrics page.
func needsDetection(k upstream.Kind) bool {
	return k == upstream.Auto || k == upstream.LlamaCpp || k == upstream.SGLang
}

// live reports whether m is still the pool's member of its name (Mu held).
func (p *Pool) live(m *Member) bool { return p.byName[m.Name] == m }

// scrapeLoop reads m's load every ScrapeInterval until ctx ends.
func (p *Pool) scrapeLoop(ctx context.Context, m *Member) {
	every(ctx, p.cfg.ScrapeInterval, nil, func() { p.Scrape(ctx, m) })
}

// every runs f at once, then every period and whenever wake (nil: never)
// fires, until ctx ends: the loop of each of a member's feeds.
func every(ctx context.Context, period time.Duration, wake <-chan struct{}, f func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		f()
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-t.C:
		}
	}
}

// Scrape reads m's queue and KV usage once and gives them to the router; a
// failure makes them unknown (the policies fall back on the router's own
// counts). Metric names of another engine than m's detected one make m due
// a new detection.
func (p *Pool) Scrape(ctx context.Context, m *Member) {
	sctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	l, err := upstream.FetchLoad(sctx, p.cfg.Client, m.MetricsURL)
	cancel()
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.cfg.Logger.Debug("metrics scrape failed", "replica", m.Name, "err", err)
		p.m.ScrapeErrs.WithLabelValues(m.Name).Inc()
		l = upstream.UnknownLoad
	}
	p.Mu.Lock()
	defer p.Mu.Unlock()
	if !p.live(m) {
		return
	}
	if err := p.Router.ReplicaLoad(m.ID, l.Waiting, l.Running, l.KVUsage); err != nil {
		p.cfg.Logger.Warn("router replica load", "replica", m.Name, "err", err)
	}
	m.kvTokens = l.KVTokens
	if err == nil {
		m.scrapeCap = l.Capacity
	}
	p.applyCapacity(m)
	if l.LoRA != nil {
		// vLLM's running adapters are those it holds for certain (the
		// rest of its LRU slots it does not report); max_lora its slots.
		if err := p.Router.SetAdapters(m.ID, l.LoRA.Running, l.LoRA.MaxLoRAs); err != nil {
			p.cfg.Logger.Warn("router adapters", "replica", m.Name, "err", err)
		}
		// The same running list, and the waiting one: e2's adapter_wait.
		if err := p.Router.SetRunningAdapters(m.ID, l.LoRA.Running, l.LoRA.Waiting); err != nil {
			p.cfg.Logger.Warn("router running adapters", "replica", m.Name, "err", err)
		}
	}
	if m.Replica.Kind == upstream.Auto && l.Kind != "" && l.Kind != m.kind && !m.kindDue {
		p.markKindDue(m) // another engine answers there now
	}
}

// applyCapacity gives the router m's KV capacity as its engine last
// reported it — its metrics page's figure, else its detection's — or
// none, and the router falls back on the profile's (router.KVCapacity); a
// change of the capacity in force or of its source is logged (Mu held).
func (p *Pool) applyCapacity(m *Member) {
	c := m.scrapeCap
	if !c.Known() {
		c = m.detectCap
	}
	if err := p.Router.SetKVCapacity(m.ID, c.Tokens, c.Source); err != nil {
		p.cfg.Logger.Warn("router kv capacity", "replica", m.Name, "err", err)
	}
	tokens, source := p.Router.KVCapacity(m.ID)
	if key := fmt.Sprint(tokens, source); key != m.capLogged {
		m.capLogged = key
		if source == router.CapacityProfile || source == router.CapacityConfig {
			p.cfg.Logger.Info("replica kv capacity: the engine did not say; using the "+source+"'s",
				"replica", m.Name, "kv_capacity_tokens", tokens, "source", source)
		} else {
			p.cfg.Logger.Info("replica kv capacity", "replica", m.Name, "kv_capacity_tokens", tokens, "source", source)
		}
	}
}

// markKindDue makes m due a detection, when its kind needs one, and wakes
// its loop (Mu held).
func (p *Pool) markKindDue(m *Member) {
	if !needsDetection(m.Replica.Kind) {
		return
	}
	m.kindDue = true
	wake(m.kindWake)
}

// slotRetries bounds the detections of a llama.cpp replica that answer
// without its slot count before the pool settles for none (GET /props
// total_slots and GET /slots both unanswered or empty); each waits the
// pool's Retry. A llama-server answers its kind before /props while it is
// loading, or when /props is slow: a first detection then saw no slots,
// and the replica stayed a block cache until it was re-admitted.
const slotRetries = 5

func wake(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// detectLoop detects m's engine whenever it is due and m is in routing:
// at once, when it is woken, and every Retry while a detection got no
// answer.
func (p *Pool) detectLoop(ctx context.Context, m *Member) {
	every(ctx, p.cfg.Retry, m.kindWake, func() { p.Detect(ctx, m) })
}

// Detect runs one detection of m if it is due and m is in routing
// (upstream.Detect: a llama.cpp replica's slot count too), records the
// kind and gives the router its cache model: a llama.cpp replica's slots
// (router.SetCacheSlots), a block cache for any other. A replica that did
// not answer stays due.
func (p *Pool) Detect(ctx context.Context, m *Member) {
	p.Mu.Lock()
	if !p.live(m) || !m.kindDue || !m.Up() {
		p.Mu.Unlock()
		return
	}
	p.Mu.Unlock()

	dctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	d, err := upstream.Detect(dctx, p.cfg.Client, m.Base.String(), m.MetricsURL, m.Replica.Kind)
	cancel()

	p.Mu.Lock()
	if ctx.Err() != nil || !p.live(m) {
		p.Mu.Unlock()
		return
	}
	if errors.Is(err, upstream.ErrNoAnswer) {
		p.Mu.Unlock()
		p.cfg.Logger.Debug("backend kind: no answer; trying again later", "replica", m.Name, "retry_in", p.cfg.Retry, "err", err)
		return
	}
	slots := 0
	if d.Kind.SlotCache() {
		slots = d.Slots
	}
	old, oldSlots := m.kind, m.slots
	// A llama.cpp replica that answered without its slot count (its /props
	// slow or not yet serving) is asked again, up to slotRetries times,
	// before its cache is taken for a block cache.
	retry := d.Kind.SlotCache() && slots == 0 && m.slotTries < slotRetries
	if retry {
		m.slotTries++
	} else {
		m.slotTries = 0
	}
	m.kind, m.slots, m.kindDue = d.Kind, slots, retry
	m.detectCap = d.Capacity
	p.applyCapacity(m)
	serr := p.Router.SetCacheSlots(m.ID, slots)
	if old != d.Kind {
		p.markTokenizerDue(m) // the check speaks the engine's /tokenize
	} else if m.tokDue {
		wake(m.tokWake) // a check that waited for the kind may run now
	}
	hook := p.Hooks.Detected
	p.Mu.Unlock()
	if err != nil {
		p.cfg.Logger.Warn("backend kind", "replica", m.Name, "err", err)
	}
	if serr != nil {
		p.cfg.Logger.Error("router cache slots", "replica", m.Name, "slots", slots, "err", serr)
	}
	if old != d.Kind || oldSlots != slots {
		p.cfg.Logger.Info("replica backend kind", "replica", m.Name, "kind", d.Kind, "via", d.Via, "slots", slots)
	}
	if d.Kind.SlotCache() && slots == 0 && !retry {
		p.cfg.Logger.Warn("llama.cpp replica did not say its slot count (GET /props total_slots, GET /slots): its cache is mirrored as a block cache",
			"replica", m.Name)
	}
	if hook != nil {
		hook(m.Name, d)
	}
}

// markTokenizerDue makes m due a tokenizer check and wakes its loop (Mu
// held).
func (p *Pool) markTokenizerDue(m *Member) {
	if p.tok == nil {
		return
	}
	m.tokDue = true
	wake(m.tokWake)
}

// tokenizerLoop checks m's tokenizer whenever it is due and m is in
// routing: at once, when it is woken, and every Retry while a check got
// no answer.
func (p *Pool) tokenizerLoop(ctx context.Context, m *Member) {
	every(ctx, p.cfg.Retry, m.tokWake, func() { p.CheckTokenizer(ctx, m) })
}

// CheckTokenizer compares the keyer's tokenizer with m's /tokenize
// (keying.TokenizerCheck, in the shape of m's engine) if a check is due
// and m is in routing, records what it found and sets the keyer's
// fallback: on while any member mismatches, so that prompts are keyed by
// text chunks rather than by token keys that match none of its blocks. A
// replica without /tokenize (an HTTP error) is "unknown" and does not stop
// a configured tokenizer's token keying (an auto one needs a match:
// keyingLocked); one that did not answer stays due. An auto keyer's
// tokenizer is loaded at the first match (loadAutoTokenizer). The check waits for a
// due detection: the engine says which /tokenize it speaks.
func (p *Pool) CheckTokenizer(ctx context.Context, m *Member) {
	if p.tok == nil {
		return
	}
	check := p.tokenizerCheck(ctx)
	if check == nil {
		return
	}
	p.Mu.Lock()
	if !p.live(m) || !m.tokDue || !m.Up() || m.kindDue {
		p.Mu.Unlock()
		return
	}
	m.tokDue = false // a change of routing state may make it due again meanwhile
	kind := m.kind
	p.Mu.Unlock()

	state, err := check.CompareKind(ctx, p.cfg.Client, m.Base.String(), kind)

	p.Mu.Lock()
	if ctx.Err() != nil || !p.live(m) {
		m.tokDue = true
		p.Mu.Unlock()
		return
	}
	hook := p.Hooks.Tokenizer
	if errors.Is(err, upstream.ErrNoAnswer) {
		m.tokDue = true
		p.Mu.Unlock()
		p.cfg.Logger.Debug("tokenizer check: no answer; checking again later", "replica", m.Name, "retry_in", p.cfg.Retry, "err", err)
		if hook != nil {
			hook(m.Name, state, err)
		}
		return
	}
	m.tokState = state
	if state == keying.TokenizerMatch {
		p.loadAutoTokenizer()
	}
	p.setTokenizerFallback()
	p.Mu.Unlock()
	state.Log(p.cfg.Logger, m.Name, err)
	if hook != nil {
		hook(m.Name, state, err)
	}
}

// tokenizerCheck returns the check of the keyer's tokenizer: at once for
// an auto keyer (its probe ids are known before it is loaded), else once
// the tokenizer is loaded; nil if ctx ended first or it could not be
// loaded (logged once: text stays keyed by chunks).
func (p *Pool) tokenizerCheck(ctx context.Context) *keying.TokenizerCheck {
	if !p.tok.Auto() {
		select {
		case <-p.tok.Ready():
		case <-ctx.Done():
			return nil
		}
	}
	p.checkOnce.Do(func() {
		if !p.tok.Auto() && p.tok.Tokenizer() == nil {
			p.cfg.Logger.Error("cannot load the tokenizer: keying text and chats by text chunks", "tokenizer", p.tok.Spec(), "err", p.tok.LoadErr())
			return
		}
		p.check = p.tok.Check()
		p.check.Timeout = p.cfg.Timeout
	})
	return p.check
}

// loadAutoTokenizer loads an auto keyer's tokenizer once a replica has
// confirmed it, and logs when it is in use (or could not be loaded).
func (p *Pool) loadAutoTokenizer() {
	if !p.tok.Auto() {
		return
	}
	p.loadOnce.Do(func() {
		p.tok.Load()
		go func() {
			<-p.tok.Ready()
			if err := p.tok.LoadErr(); err != nil {
				p.cfg.Logger.Error("cannot load the tokenizer: keying text and chats by text chunks", "tokenizer", p.tok.Spec(), "err", err)
				return
			}
			k := p.Keying()
			p.cfg.Logger.Info("tokenizer loaded", "tokenizer", p.tok.Spec(), "mode", k.Mode, "why", k.Why)
		}()
	})
}

// setTokenizerFallback turns the keyer's fallback on while a member
// mismatches, off otherwise; an auto keyer (keying.TokenizerAuto) also
// needs a member that matched (Mu held).
func (p *Pool) setTokenizerFallback() {
	if p.tok == nil {
		return
	}
	fallback, why := p.keyingLocked()
	if p.tok.Fallback() == fallback {
		return
	}
	p.tok.SetFallback(fallback)
	if !fallback {
		msg := "keying text and chats by token ids"
		if p.tok.Cache() == nil {
			msg += " once the tokenizer is loaded"
		}
		p.cfg.Logger.Info(msg, "tokenizer", p.tok.Spec(), "why", why)
	} else if p.tok.Auto() {
		p.cfg.Logger.Warn("keying text and chats by text chunks", "why", why)
	}
}

// keyingLocked decides whether the keyer falls back to text chunks, and why
// (Mu held).
func (p *Pool) keyingLocked() (fallback bool, why string) {
	matched := 0
	for _, m := range p.slots {
		if m == nil {
			continue
		}
		switch m.tokState {
		case keying.TokenizerMismatch:
			return true, fmt.Sprintf("replica %s's /tokenize gives other ids than %s", m.Name, p.tok.Spec())
		case keying.TokenizerMatch:
			matched++
		}
	}
	switch {
	case matched > 0:
		return false, fmt.Sprintf("%d replica(s)' /tokenize give the ids of %s, none other", matched, p.tok.Spec())
	case p.tok.Auto():
		return true, fmt.Sprintf("no replica has confirmed %s through its /tokenize yet", p.tok.Spec())
	}
	return false, fmt.Sprintf("%s as configured (no replica's /tokenize has answered)", p.tok.Spec())
}

// Keying is how the pool keys text and chat prompts now, for logs and the
// debug endpoints.
type Keying struct {
	// Mode is "token ids" or "text chunks".
	Mode string `json:"mode"`
	// Tokenizer is the tokenizer whose ids key prompts, or would once
	// confirmed ("" none).
	Tokenizer string `json:"tokenizer,omitempty"`
	// Auto: the tokenizer was chosen by "tokenizer: auto", not configured.
	Auto bool `json:"auto,omitempty"`
	// Why says what decided it.
	Why string `json:"why"`
}

// Keying reports how text and chat prompts are keyed now.
func (p *Pool) Keying() Keying {
	if p.tok == nil {
		return Keying{Mode: "text chunks", Why: `tokenizer "none": text is keyed by chunks of bytes`}
	}
	p.Mu.Lock()
	_, why := p.keyingLocked()
	p.Mu.Unlock()
	k := Keying{Mode: "token ids", Tokenizer: p.tok.Spec(), Auto: p.tok.Auto(), Why: why}
	switch {
	case p.tok.Fallback():
		k.Mode = "text chunks"
	case p.tok.Cache() == nil:
		k.Mode = "text chunks"
		k.Why += "; loading " + p.tok.Spec()
	}
	return k
}

// State is one member as the debug endpoints show it (Mu held while it is
// taken).
type State struct {
	Name, Address, URL string
	// Ready is the membership's readiness, Healthy the front door's health
	// checks; the replica is in routing when both hold.
	Ready, Healthy bool
	// Kind is its engine (upstream.Unknown until detected); Slots its slot
	// count for a slot cache (0: a block cache); KVTokens its scraped
	// llamacpp:kv_cache_tokens (-1 unknown); KindDue says a detection is
	// due.
	Kind     upstream.Kind
	Slots    int
	KVTokens int
	KindDue  bool
	// Tokenizer is the last tokenizer check's verdict.
	Tokenizer keying.TokenizerState
	// KVEvents is the replica's KV-event socket ("": none), or
	// "listen:ENDPOINT" for a member whose engine may dial the pool's
	// listener (PoolConfig.KVEventsListen).
	KVEvents string
	// KVCapacity is its KV cache in tokens as the router prices it, and
	// KVCapacitySource where it came from (router.KVCapacity: an engine's
	// source such as upstream.SourceVLLMMetrics, else "profile").
	KVCapacity       int
	KVCapacitySource string
}

// StateOf snapshots m (Mu held).
func (p *Pool) StateOf(m *Member) State {
	capTokens, capSource := p.Router.KVCapacity(m.ID)
	return State{Name: m.Name, Address: m.Address, URL: m.Base.String(), Ready: m.Ready, Healthy: m.healthy,
		Kind: m.kind, Slots: m.slots, KVTokens: m.kvTokens, KindDue: m.kindDue, Tokenizer: m.tokState,
		KVEvents: p.kvEndpoint(m), KVCapacity: capTokens, KVCapacitySource: capSource}
}

// kvEndpoint is where m's KV events come from: its KVEvents, or
// "listen:" and the listener's endpoint for a listening member ("": none).
func (p *Pool) kvEndpoint(m *Member) string {
	if m.listen {
		ep := p.cfg.KVEventsListen
		if strings.HasSuffix(ep, ":0") { // a free port: the one bound
			ep = cmp.Or(p.listener.Endpoint(), ep)
		}
		return "listen:" + ep
	}
	return m.KVEvents
}

// KVState is what a member's KV-event stream did (GET /debug/cache).
type KVState struct {
	// Stream is the subscriber's state.
	Stream kvevents.Stats
	// Stored .. UnknownParent count the events applied to the router by
	// outcome.
	Stored, Removed, Cleared, CPUIgnored, UnknownParent uint64
	// TierStored and TierRemoved count the slower tiers' events.
	TierStored, TierRemoved uint64
	// TierBlocks is the blocks the router holds in its slower tiers.
	TierBlocks int
}

// KVStateOf returns m's KV-event state; ok is false for a replica without
// KV events. A listening member's Stream is its listener stream's
// (kvevents.StateListening), or, before its first batch, an empty one in
// that state. It takes no lock.
func (p *Pool) KVStateOf(m *Member) (KVState, bool) {
	var st kvevents.Stats
	switch {
	case m.sub != nil:
		st = m.sub.Stats()
	case m.listen:
		var ok bool
		if st, ok = p.listener.ReplicaStats(m.Name); !ok {
			st = kvevents.Stats{Replica: m.Name, State: kvevents.StateListening, LastSeq: -1}
		}
	default:
		return KVState{}, false
	}
	return KVState{Stream: st, Stored: m.kv.stored.Load(), Removed: m.kv.removed.Load(),
		Cleared: m.kv.cleared.Load(), CPUIgnored: m.kv.cpu.Load(), UnknownParent: m.kv.unknownParent.Load(),
		TierStored: m.kv.tierStored.Load(), TierRemoved: m.kv.tierRemoved.Load()}, true
}

func (k *kvCounts) add(outcome string) {
	switch outcome {
	case OutcomeStored:
		k.stored.Add(1)
	case OutcomeRemoved:
		k.removed.Add(1)
	case OutcomeCleared:
		k.cleared.Add(1)
	case OutcomeCPUIgnored:
		k.cpu.Add(1)
	case OutcomeUnknownParent:
		k.unknownParent.Add(1)
	case OutcomeTierStored:
		k.tierStored.Add(1)
	case OutcomeTierRemoved:
		k.tierRemoved.Add(1)
	}
}

// cacheRows snapshots the router's cache view and the engine of each
// member (CacheCollector).
func (p *Pool) cacheRows() []CacheRow {
	p.Mu.Lock()
	defer p.Mu.Unlock()
	rows := make([]CacheRow, 0, len(p.byName))
	for _, m := range p.slots {
		if m != nil {
			v, _ := p.Router.CacheView(m.ID)
			rows = append(rows, CacheRow{Name: m.Name, Cache: v, Kind: m.kind})
		}
	}
	return rows
}

// HostPort is u's host with its port made explicit (the scheme's default
// when absent), as a gateway names an endpoint.
func HostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(strings.Trim(u.Hostname(), "[]"), port)
}

// Names returns the members' names, sorted (Mu held).
func (p *Pool) Names() []string {
	out := make([]string, 0, len(p.byName))
	for n := range p.byName {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}
