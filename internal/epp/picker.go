// Package epp is prefixlb as an Endpoint Picker for the Kubernetes Gateway
// API Inference Extension: the routing core behind Envoy's ext_proc gRPC
// protocol (INTERFACES.md §4). A gateway asks it, per request, which pod
// serves; it answers with the x-gateway-destination-endpoint header and the
// same value in the envoy.lb dynamic metadata.
//
// Picker is the routing core with its feeds (KV events, scraped load,
// shared in-flight counts from other picker replicas); Server speaks
// ext_proc. The Kubernetes side (which pods exist, which are ready) comes
// from internal/discovery through Picker's Add, Remove and SetReady.
package epp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// Errors Pick returns; the ext_proc edge maps them to HTTP statuses.
var (
	// ErrNoEndpoint: no ready replica (or none in the gateway's subset
	// hint) can take the request (503).
	ErrNoEndpoint = errors.New("epp: no ready endpoint")
	// ErrShed: every candidate's queue is at Config.MaxQueue (429).
	ErrShed = errors.New("epp: every endpoint is saturated")
)

// Replica is one model-server pod as discovery reports it
// (cluster.Replica: discovery.Replica is the same type).
type Replica = cluster.Replica

// Shared is the in-flight load of the other routers that front the same
// pool (sharedstate.Redis, sharedstate.Memory). Implementations must be
// safe for concurrent use.
type Shared interface {
	// Add adds delta to this router's published load on replica.
	Add(ctx context.Context, replica string, delta router.ExternalLoad) error
	// Others returns the other routers' load, summed per replica.
	Others(ctx context.Context) (map[string]router.ExternalLoad, error)
}

// Config configures a Picker. Zero fields take the defaults given.
type Config struct {
	// Policy is the routing policy spec (policy.Parse; default "e2").
	Policy string
	// Profile is the cost profile: a built-in name or a YAML file,
	// optionally with scaled times (costmodel.Resolve; default
	// costmodel.Llama31_8BH100's name, "llama3.1-8b-h100"). Every replica
	// of the pool starts from it.
	Profile string
	// NoCalibrate turns off what is on by default: learning each replica's
	// real prefill and decode speed from the requests it serves
	// (internal/calibrate), the profile being the prior, and pricing every
	// policy's costs with it — how a pool of mixed GPUs gets each its own
	// speed. Calibration tunes it (zero: calibrate.DefaultConfig()).
	NoCalibrate bool
	Calibration calibrate.Config
	// BlockTokens is the engines' KV block size (default 16).
	BlockTokens int
	// Seed seeds the router's random choices.
	Seed uint64
	// Fallbacks is how many endpoints follow the primary in the answer, for
	// the gateway to retry on (default 2; negative: none).
	Fallbacks int
	// MaxQueue sheds load: when every candidate's queue (policy.Replica.
	// Queue: the engine's waiting requests, vllm:num_requests_waiting, as
	// GIE's saturation detector reads; else the routers' requests not yet
	// started on it) is at least MaxQueue, Pick fails with ErrShed (429).
	// 0: never shed.
	MaxQueue int
	// DefaultOutputTokens is the output assumed without max_tokens (256).
	DefaultOutputTokens int
	// MaxPromptTokens bounds a prompt's length in tokens (counted or
	// estimated by the keyer), as serve's max_prompt_tokens does: a longer
	// one is answered 400 before it costs a decision (default 1<<20).
	MaxPromptTokens int
	// SpeculativeTTL: router.Config's (0: its default).
	SpeculativeTTL time.Duration
	// Keyer keys prompts (nil: Tokenizer's keys if set, else
	// proxy.ChunkKeyer{BlockTokens}). A *proxy.TokenizerKeyer (the one
	// Tokenizer makes too) is checked against every replica: the probe prompt and chat of
	// proxy.TokenizerCheck go to the replica's /tokenize (vLLM's, or
	// llama.cpp's once BackendKind says or detects it) at
	// "http://"+Address when it joins and whenever it is ready again, off
	// the request path, and while any replica in the pool mismatches the
	// keyer falls back to text chunks (TokenizerKeyer.SetFallback), as
	// prefixlb serve does. A replica that does not answer is checked again
	// every ScrapeInterval (5s without one); one whose /tokenize answers an
	// HTTP error stays unknown and does not stop token keys.
	Keyer keying.Keyer
	// Tokenizer, when Keyer is nil, is the replicas' tokenizer
	// (proxy.LoadTokenizer: "qwen3" for the bundled one, a tokenizer.json
	// or a model directory): prompts are keyed by blocks of its token ids,
	// chats rendered with its chat template, so that keys are the router
	// keys of the engines' KV blocks (the kvevents.Index computes those from
	// the token ids of vLLM's BlockStored events). "" or "auto": the
	// bundled Qwen3 once a replica's /tokenize confirms it, text chunks
	// until then (keying.TokenizerAuto); "none": text chunks
	// (keying.ChunkKeyer), which match nothing in KV events.
	Tokenizer string
	// TreeMaxBlocks bounds the router's prefix tree (0: its default, 2M).
	TreeMaxBlocks int
	// Shared, when set, shares in-flight load with other routers.
	Shared Shared
	// ScrapeInterval is how often each replica's MetricsURL is read for its
	// queue and KV usage (0: never); each read, and each /tokenize request
	// of a tokenizer check, is bounded by ScrapeTimeout (default 2s).
	ScrapeInterval, ScrapeTimeout time.Duration
	// KVEventsListen, when set, is where the picker binds one ZeroMQ SUB
	// socket for engines that dial it with their KV events
	// ("tcp://0.0.0.0:5557", as llm-d deploys vLLM and
	// llm-d-inference-sim's --zmq-endpoint): a message whose topic
	// "kv@<ip:port>@<model>" names a replica's address is that replica's,
	// mirrored until its first batch arrives
	// (cluster.PoolConfig.KVEventsListen; docs/kv-events.md).
	KVEventsListen string
	// BackendKind is the replicas' engine (proxy.ParseBackendKind: "auto",
	// the default, "vllm", "sglang" or "llamacpp"). With auto each
	// replica's kind is detected (proxy.DetectBackend) when it joins and
	// whenever it is ready again, off the request path (a replica that did
	// not answer is tried again every ScrapeInterval, 5s without one);
	// with llamacpp its slot count is read then. A llama.cpp replica's
	// cache is modelled as its -np slots, its cached tokens read from its
	// timings and its tokenizer checked through its own /tokenize.
	BackendKind upstream.Kind
	// KVLink is the network between prefill and decode pods that a
	// disaggregating policy (e2-pd, llmd-pd, dynamo-pd, round-robin-pd)
	// prices a KV transfer on. Pods take their role from llm-d's label
	// llm-d.ai/role (discovery.LabelRole); the picker names a
	// disaggregated request's prefill pod in x-prefiller-host-port for
	// llm-d's routing sidecar (PrefillerHeader). Calibration does not learn
	// from disaggregated requests: in a P/D pool turn it off (NoCalibrate).
	KVLink policy.KVLink
	// LoRAAdapters are the model names that are LoRA adapters: their
	// requests are keyed from the adapter's seed (cluster.Settings.Adapters).
	LoRAAdapters []string
	// LoRAAdapterBytes is the size of an adapter's weights, which prices
	// an adapter load (engine's --lora-adapter-bytes; 0: the fixed cost).
	LoRAAdapterBytes int64
	// Queue, when set and On, is the router-side queue (cluster.Gate, as
	// prefixlb serve runs it): while every replica is saturated a request's
	// ext_proc stream is held until the queue dispatches it, or answered
	// 429 (503 with no replica up) when it is shed (docs/overload.md). nil:
	// none (`prefixlb epp` sets it on by default).
	Queue *cluster.QueueConfig
	// Objectives give the priority of requests that name a GIE
	// InferenceObjective in ObjectiveHeader: its spec.priority (higher
	// first, unset 0; api/v1alpha2 InferenceObjectiveSpec.Priority). An
	// x-prefixlb-priority header wins over it. SetObjectives (the cluster's
	// objectives, watched) overrides these.
	Objectives map[string]int
	// Tenants are who requests are from: configured tenants by API key,
	// their token quotas, and whether the gateway's class headers
	// (x-prefixlb-tenant, -priority, -ttft-slo) are believed
	// (TrustClientHeaders: only when the gateway strips client-set values;
	// TrustedProxies does not apply, the gateway being every request's
	// peer). See tenants.go.
	Tenants tenant.Config
	// TenantIsolation salts every request with its tenant, as serve's
	// tenant_isolation does (tenancy.Isolation): the body the replica gets
	// carries the tenant's cache_salt (Pick.Body), and the keys use it.
	// TenantSaltSecret keys the salts; the same on every router of the
	// pool (serve's included), or their salts differ.
	TenantIsolation  bool
	TenantSaltSecret string
	// Logger receives the picker's logs (nil: slog.Default()).
	Logger *slog.Logger
}

// ObjectiveHeader names the InferenceObjective a request is served under
// (GIE's x-gateway-inference-objective).
const ObjectiveHeader = "x-gateway-inference-objective"

func (c *Config) defaults() {
	if c.Policy == "" {
		c.Policy = "e2"
	}
	if c.Profile == "" {
		c.Profile = "llama3.1-8b-h100"
	}
	if c.BlockTokens == 0 {
		c.BlockTokens = blocks.DefaultBlockSize
	}
	if c.Fallbacks == 0 {
		c.Fallbacks = 2
	}
	if c.DefaultOutputTokens == 0 {
		c.DefaultOutputTokens = 256
	}
	if c.MaxPromptTokens == 0 {
		c.MaxPromptTokens = 1 << 20
	}
	if c.ScrapeTimeout == 0 {
		c.ScrapeTimeout = 2 * time.Second
	}
	if c.Calibration == (calibrate.Config{}) {
		c.Calibration = calibrate.DefaultConfig()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	switch {
	case c.BlockTokens < 0:
		return fmt.Errorf("epp: block_tokens must be ≥ 1, got %d", c.BlockTokens)
	case c.MaxQueue < 0:
		return fmt.Errorf("epp: max_queue must be ≥ 0, got %d", c.MaxQueue)
	case c.DefaultOutputTokens < 0:
		return fmt.Errorf("epp: default_output_tokens must be ≥ 0, got %d", c.DefaultOutputTokens)
	case c.MaxPromptTokens < 0:
		return fmt.Errorf("epp: max_prompt_tokens must be ≥ 0, got %d", c.MaxPromptTokens)
	case c.ScrapeInterval < 0 || c.ScrapeTimeout < 0:
		return errors.New("epp: scrape interval and timeout must be ≥ 0")
	case c.TreeMaxBlocks < 0:
		return fmt.Errorf("epp: tree_max_blocks must be ≥ 0, got %d", c.TreeMaxBlocks)
	}
	if _, err := upstream.ParseKind(string(c.BackendKind)); err != nil {
		return fmt.Errorf("epp: backend kind: %w", err)
	}
	if c.KVEventsListen != "" {
		if err := kvevents.CheckListenEndpoint(c.KVEventsListen); err != nil {
			return fmt.Errorf("epp: kv_events_listen: %w", err)
		}
	}
	if !c.NoCalibrate {
		if err := c.Calibration.Validate(); err != nil {
			return fmt.Errorf("epp: %w", err)
		}
	}
	return nil
}

// flight is a request routed and not finished: what it added to the
// shared load, so that exactly that comes off again.
type flight struct {
	req     policy.Request
	replica *cluster.Member
	load    router.ExternalLoad // still published (shared state)
	matched int                 // prompt tokens predicted cached there
	first   bool
}

// Picker is the routing core of the endpoint picker over a cluster.Pool:
// the replicas with their feeds, one lock over the router. It is safe for
// concurrent use.
type Picker struct {
	cfg    Config
	log    *slog.Logger
	policy string // the policy's name, a metrics label
	m      *metrics
	nextID atomic.Uint64
	pool   *cluster.Pool

	mu         *sync.Mutex // the core's Mu: guards everything below
	rt         *router.Router
	allowed    []int // scratch: the replicas a decision may choose (pickLocked)
	room       []int // the replicas with room for a request the queue held (nil: any)
	decoders   []int // scratch: those of allowed that decode, the answer's candidates
	flights    map[uint64]*flight
	others     map[string]router.ExternalLoad // last good Shared.Others
	rw         rewriter                       // the pool's model rewrites (rewrite.go)
	objectives objectives                     // InferenceObjective priorities (objectives.go)
	gate       *cluster.Gate                  // the router-side queue (nil: none)
	// onFinish, when set (by tests), is called after each Finished.
	onFinish func()

	// tenants tells who each request is from and holds their quotas.
	tenants *cluster.Tenants
}

// NewPicker returns a Picker with no replicas. It starts nothing.
func NewPicker(cfg Config) (*Picker, error) {
	cfg.defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var cal *calibrate.Config
	if !cfg.NoCalibrate {
		c := cfg.Calibration
		cal = &c
	}
	core, err := cluster.New(cluster.Settings{BlockTokens: cfg.BlockTokens, Profile: cfg.Profile, Policy: cfg.Policy,
		Tokenizer: cfg.Tokenizer, Keyer: cfg.Keyer, Seed: cfg.Seed, SpeculativeTTL: cfg.SpeculativeTTL,
		TreeMaxBlocks: cfg.TreeMaxBlocks, DefaultOutputTokens: cfg.DefaultOutputTokens, Calibrate: cal,
		MaxPromptTokens: cfg.MaxPromptTokens, KVLink: cfg.KVLink, Adapters: cfg.LoRAAdapters, AdapterBytes: cfg.LoRAAdapterBytes})
	if err != nil {
		return nil, fmt.Errorf("epp: %w", err)
	}
	cfg.Keyer = core.Keyer
	p := &Picker{
		cfg: cfg, log: cfg.Logger, mu: &core.Mu, policy: core.Policy, rt: core.Router,
		flights: make(map[uint64]*flight),
	}
	p.rw.rng = rand.New(rand.NewPCG(cfg.Seed, 0x6d6f64656c))
	p.objectives.init(cfg.Objectives)
	p.m = newMetrics(p)
	p.pool, err = cluster.NewPool(core, p.m.Metrics, cluster.PoolConfig{Kind: cfg.BackendKind,
		ScrapeInterval: cfg.ScrapeInterval, Timeout: cfg.ScrapeTimeout, Logger: cfg.Logger, KVEventsListen: cfg.KVEventsListen})
	if err != nil {
		return nil, fmt.Errorf("epp: %w", err)
	}
	p.pool.Hooks.Removed = func(m *cluster.Member) { p.m.replicaRemoved(m.Name) }
	if p.tenants, err = newTenants(&cfg, p.m.Reg); err != nil {
		return nil, err
	}
	if q := cfg.Queue; q != nil && q.On {
		gm, err := cluster.NewGateMetrics(p.m.Reg)
		if err != nil {
			return nil, fmt.Errorf("epp: metrics: %w", err)
		}
		if p.gate, err = cluster.NewGate(core, *q, gm); err != nil {
			return nil, fmt.Errorf("epp: %w", err)
		}
	}
	return p, nil
}

// SetModelRewrites installs the pool's InferenceModelRewrites (a request's
// model is rewritten before it is routed; rewrite.go), replacing any
// installed before.
func (p *Picker) SetModelRewrites(rs []ModelRewrite) { p.rw.set(rs) }

// Pool is the picker's replicas: discovery registers them there (Add,
// Remove, SetReady).
func (p *Picker) Pool() *cluster.Pool { return p.pool }

// Add adds a replica, or updates one of the same name (an address or a
// port that changed makes it a new replica: the old one leaves first).
func (p *Picker) Add(r Replica) { p.pool.Add(r) }

// Remove takes replica name out of the pool: it is never picked again and
// its cache leaves the router's tree. Requests in flight on it finish as
// usual.
func (p *Picker) Remove(name string) { p.pool.Remove(name) }

// SetReady marks replica name ready or not (a pod's readiness).
func (p *Picker) SetReady(name string, ready bool) { p.pool.SetReady(name, ready) }

// Ready returns the number of ready replicas.
func (p *Picker) Ready() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rt.UpCount()
}

// Input is one request as the gateway hands it over.
type Input struct {
	// Kind is the OpenAI endpoint (from the :path header).
	Kind openai.Kind
	// Body is the request body, whole.
	Body []byte
	// Session is a session key for affinity ("" none).
	Session string
	// Explain asks for the decision's cost terms (policy.Request.Explain:
	// e2's candidates carry them, Decision.ExplainTerms renders them).
	Explain bool
	// Subset, when non-nil, is the gateway's subset hint: the "ip:port"
	// endpoints the answer must come from.
	Subset []string
	// Header returns a request header by its lower-case name (nil: none):
	// the router-side queue classes a request by them.
	Header func(name string) string
}

// Pick is the picker's answer for one request.
type Pick struct {
	// ID identifies the request to Served, FirstToken and Finished.
	ID uint64
	// Endpoints are "ip:port": the primary, then the fallbacks.
	Endpoints []string
	// Replica is the primary's name.
	Replica string
	// Body is the request body with its model rewritten (an
	// InferenceModelRewrite applied; Model the new model) or its
	// cache_salt set to the tenant's (Config.TenantIsolation), nil when
	// the body goes on as it came.
	Body  []byte
	Model string
	// Prefill is, for a disaggregated decision, the prefill replica's
	// "ip:port" (llm-d's x-prefiller-host-port), PrefillReplica its name;
	// "" otherwise.
	Prefill, PrefillReplica string
	// Decision is the router's decision, explained.
	Decision policy.Decision
	// Tenant is who the request is from (cluster.Tenants.Identify).
	Tenant tenant.Identity

	// hold is the request's reservation against its tenant's quota,
	// settled by the ext_proc exchange when the response ends.
	hold cluster.Hold
}

// Pick decides which replica serves in and commits the decision: the
// request is in flight there until Finished. Errors: proxy.ErrBadRequest
// (wrapped) for a body it cannot read, ErrNoEndpoint, ErrShed.
func (p *Picker) Pick(ctx context.Context, in Input) (Pick, error) {
	start := time.Now()
	id, err := p.identify(in)
	if err != nil {
		return Pick{}, err
	}
	pr, err := openai.ParseRequest(in.Kind, in.Body)
	if err != nil {
		return Pick{}, err
	}
	var rewritten []byte
	if m := p.rw.rewrite(pr.Model); m != pr.Model {
		if rewritten, err = withModel(in.Body, m); err != nil {
			return Pick{}, fmt.Errorf("%w: rewrite the model: %v", openai.ErrBadRequest, err)
		}
		pr.Model = m
	}
	// Tenant isolation: the tenant's salt keys the request and goes on
	// in its body.
	out := rewritten
	if out == nil {
		out = in.Body
	}
	if salted, err := p.isolate(pr, out, id.Tenant); err != nil {
		return Pick{}, fmt.Errorf("epp: %w", err)
	} else if salted != nil {
		rewritten = salted
	}
	keys, promptTokens, err := p.pool.Key(pr)
	if err != nil {
		return Pick{}, fmt.Errorf("epp: %w", err)
	}
	session := in.Session
	if session == "" {
		session = pr.User
	}
	req := policy.Request{ID: p.nextID.Add(1), Keys: keys, PromptTokens: promptTokens, Estimated: pr.TokensEstimated,
		OutputTokens: pr.MaxTokens, Session: session, Unary: !pr.Stream, Explain: in.Explain, Adapter: pr.Adapter}
	if req.OutputTokens == 0 {
		req.OutputTokens = p.cfg.DefaultOutputTokens
	}
	hold, err := p.tenants.Reserve(&id, promptTokens, pr.MaxTokens, start)
	if err != nil {
		return Pick{}, fmt.Errorf("epp: %w", err)
	}
	var others map[string]router.ExternalLoad
	if p.cfg.Shared != nil {
		if others, err = p.cfg.Shared.Others(ctx); err != nil {
			p.m.errors.WithLabelValues(errSharedRead).Inc()
			p.log.Warn("epp: shared state: reading other routers' load; using the last known", "err", err)
			others = nil
		}
	}

	var (
		pick Pick
		f    *flight
	)
	if p.gate == nil {
		p.mu.Lock()
		pick, f, err = p.pickLocked(&req, in.Subset, others)
		p.mu.Unlock()
	} else {
		pick, f, err = p.admitPick(ctx, &req, pr.Model, &id, in, others, start)
	}
	if err != nil {
		hold.Settle(0, time.Now()) // not routed: refunded
		return Pick{}, err
	}
	pick.Tenant, pick.hold = id, hold
	if p.cfg.Shared != nil {
		if err := p.cfg.Shared.Add(ctx, f.replica.Name, f.load); err != nil {
			p.m.errors.WithLabelValues(errSharedWrite).Inc()
			p.log.Warn("epp: shared state: publishing load", "replica", f.replica.Name, "err", err)
		}
	}
	if rewritten != nil {
		pick.Body, pick.Model = rewritten, pr.Model
	}
	p.m.decided(p.policy, &pick, req.PromptTokens, time.Since(start))
	return pick, nil
}

func (p *Picker) pickLocked(req *policy.Request, subset []string, others map[string]router.ExternalLoad) (Pick, *flight, error) {
	if others != nil {
		p.others = others
	}
	members := p.pool.Members()
	for _, m := range members {
		_ = p.rt.SetExternalLoad(m.ID, p.others[m.Name])
	}
	// Candidates: ready replicas, within the subset hint if there is one.
	p.allowed = p.allowed[:0]
	var within router.Constraint
	if subset != nil {
		for _, a := range subset {
			if m := p.pool.ByAddress(strings.TrimSpace(a)); m != nil && m.Up() {
				p.allowed = append(p.allowed, m.ID)
			}
		}
		within.Only = p.allowed
	} else {
		for _, m := range members {
			if m.Up() {
				p.allowed = append(p.allowed, m.ID)
			}
		}
	}
	if p.room != nil {
		// A request the router-side queue held goes only where there is
		// room (cluster.Waiter.Room), when some allowed replica has it.
		n := 0
		for _, id := range p.allowed {
			if slices.Contains(p.room, id) {
				p.allowed[n] = id
				n++
			}
		}
		if n > 0 {
			p.allowed = p.allowed[:n]
			within.Only = p.allowed
		}
	}
	// The answer's endpoints (the primary, fallbacks) decode; a prefill
	// replica is only ever a decision's prefill leg (the router knows the
	// roles: Only may name prefill replicas for it to choose from).
	p.decoders = p.decoders[:0]
	for _, id := range p.allowed {
		if p.pool.Member(id).PDRole().Decodes() {
			p.decoders = append(p.decoders, id)
		}
	}
	if len(p.decoders) == 0 {
		if subset != nil {
			return Pick{}, nil, fmt.Errorf("%w in the subset hint %v", ErrNoEndpoint, subset)
		}
		return Pick{}, nil, ErrNoEndpoint
	}
	if p.cfg.MaxQueue > 0 {
		shed := true
		for _, id := range p.decoders {
			st, _ := p.rt.Replica(id)
			if st.Queue() < p.cfg.MaxQueue { // the waiting queue (engine's, else requests not yet started), as GIE's saturation detector reads
				shed = false
				break
			}
		}
		if shed {
			return Pick{}, nil, fmt.Errorf("%w (max queue %d)", ErrShed, p.cfg.MaxQueue)
		}
	}
	now := time.Now()
	d, err := p.rt.RouteWithin(*req, now, within)
	if err != nil {
		if errors.Is(err, policy.ErrNoReplica) {
			return Pick{}, nil, ErrNoEndpoint
		}
		return Pick{}, nil, fmt.Errorf("epp: route: %w", err)
	}
	primary := p.pool.Member(d.Replica)
	pick := Pick{ID: req.ID, Replica: primary.Name, Decision: d, Endpoints: []string{primary.Address}}
	if d.Disaggregated {
		pm := p.pool.Member(d.PrefillReplica)
		pick.Prefill, pick.PrefillReplica = pm.Address, pm.Name
	}
	pick.Endpoints = append(pick.Endpoints, p.fallbacks(d)...)
	f := &flight{req: *req, replica: primary, load: p.flightLoad(req.ID), matched: d.MatchedTokens}
	p.flights[req.ID] = f
	return pick, f, nil
}

// flightLoad is what request id, just routed, adds to its replica's load:
// the figures the router added to its own counts, priced by the replica's
// profile as calibrated (Router.FlightLoad).
func (p *Picker) flightLoad(id uint64) router.ExternalLoad {
	l, _ := p.rt.FlightLoad(id)
	return l
}

// fallbacks lists up to Config.Fallbacks other allowed replicas' addresses,
// most cached tokens first, then least in flight.
func (p *Picker) fallbacks(d policy.Decision) []string {
	if p.cfg.Fallbacks < 0 {
		return nil
	}
	matched := make(map[int]int, len(d.Candidates))
	for _, c := range d.Candidates {
		matched[c.Replica] = c.MatchedTokens
	}
	type cand struct{ id, matched, inflight int }
	var cs []cand
	for _, id := range p.decoders {
		if id == d.Replica {
			continue
		}
		st, _ := p.rt.Replica(id)
		cs = append(cs, cand{id, matched[id], st.InFlight})
	}
	slices.SortFunc(cs, func(a, b cand) int {
		if c := cmp.Compare(b.matched, a.matched); c != 0 {
			return c
		}
		if c := cmp.Compare(a.inflight, b.inflight); c != 0 {
			return c
		}
		return cmp.Compare(a.id, b.id)
	})
	var out []string
	for _, c := range cs[:min(len(cs), p.cfg.Fallbacks)] {
		out = append(out, p.pool.Member(c.id).Address)
	}
	return out
}

// Served records the endpoint that actually served request id (the gateway
// may have fallen back). A request served elsewhere than its primary moves
// there in the router's accounts.
func (p *Picker) Served(id uint64, endpoint string) {
	p.mu.Lock()
	f, ok := p.flights[id]
	r := p.pool.ByAddress(endpoint)
	if !ok || r == nil || r == f.replica || f.first {
		p.mu.Unlock()
		return
	}
	now := time.Now()
	old, oldLoad := f.replica, f.load
	_ = p.rt.Finished(id, 0, -1, false, now)
	d, err := p.rt.Assign(f.req, r.ID, now)
	if err != nil {
		delete(p.flights, id)
		p.mu.Unlock()
		p.log.Warn("epp: moving request to its served endpoint", "id", id, "endpoint", endpoint, "err", err)
		p.publish(old.Name, neg(oldLoad))
		return
	}
	f.replica = r
	f.load = p.flightLoad(f.req.ID)
	f.matched = d.MatchedTokens
	newLoad := f.load
	p.mu.Unlock()
	p.publish(old.Name, neg(oldLoad))
	p.publish(r.Name, newLoad)
}

// FirstToken records request id's first output token.
func (p *Picker) FirstToken(id uint64) {
	p.mu.Lock()
	f, ok := p.flights[id]
	if !ok || f.first {
		p.mu.Unlock()
		return
	}
	f.first = true
	now := time.Now()
	_ = p.rt.FirstToken(id, now)
	if p.gate != nil {
		p.gate.KickLocked(now)
	}
	delta := router.ExternalLoad{Prefilling: -f.load.Prefilling, PendingPrefill: -f.load.PendingPrefill,
		PendingPrefillTokens: -f.load.PendingPrefillTokens}
	f.load = f.load.Add(delta)
	name := f.replica.Name
	p.mu.Unlock()
	p.publish(name, delta)
}

// Finished records the end of request id: outputTokens generated, the
// cached prompt tokens the engine reported (-1 none), ok false if it failed.
func (p *Picker) Finished(id uint64, outputTokens, cachedTokens int, ok bool) {
	p.Finish(id, router.Finish{OutputTokens: outputTokens, CachedTokens: cachedTokens, OK: ok})
}

// Finish records the end of request id with everything the response path
// told: Finished's figures, llama.cpp's timings and the stream's token gaps
// (calibration learns from them).
func (p *Picker) Finish(id uint64, fin router.Finish) {
	ok, cachedTokens := fin.OK, fin.CachedTokens
	p.mu.Lock()
	f, found := p.flights[id]
	if !found {
		p.mu.Unlock()
		return
	}
	delete(p.flights, id)
	now := time.Now()
	if err := p.rt.Finish(id, fin, now); err != nil {
		p.log.Warn("epp: router finished", "id", id, "err", err)
	}
	if p.gate != nil {
		p.gate.KickLocked(now)
	}
	name, load, matched, hook := f.replica.Name, f.load, f.matched, p.onFinish
	p.mu.Unlock()
	if ok && cachedTokens >= 0 {
		p.m.Prediction(matched, cachedTokens, p.cfg.BlockTokens)
	}
	p.publish(name, neg(load))
	if hook != nil {
		hook()
	}
}

// publish adds delta to this router's shared load on replica.
func (p *Picker) publish(replica string, delta router.ExternalLoad) {
	if p.cfg.Shared == nil || delta == (router.ExternalLoad{}) {
		return
	}
	if err := p.cfg.Shared.Add(context.Background(), replica, delta); err != nil {
		p.m.errors.WithLabelValues(errSharedWrite).Inc()
		p.log.Warn("epp: shared state: publishing load", "replica", replica, "err", err)
	}
}

func neg(l router.ExternalLoad) router.ExternalLoad {
	return router.ExternalLoad{InFlight: -l.InFlight, Prefilling: -l.Prefilling, PendingPrefill: -l.PendingPrefill,
		PendingPrefillTokens: -l.PendingPrefillTokens, DecodeTokens: -l.DecodeTokens}
}

// ReplicaState is a snapshot of one replica, for tests and /debug.
type ReplicaState struct {
	Replica
	// InFlight counts this router's requests on it; External the other
	// routers' (shared state).
	InFlight, External int
}

// inflight is m's requests in flight: this picker's and the other
// pickers' (shared state) (p.mu held).
func (p *Picker) inflight(m *cluster.Member) (own, others int) {
	st, _ := p.rt.Replica(m.ID)
	others = p.rt.ExternalLoad(m.ID).InFlight
	return st.InFlight - others, others
}

// Replicas returns a snapshot of the known replicas, by name.
func (p *Picker) Replicas() []ReplicaState {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []ReplicaState
	for _, m := range p.pool.Members() {
		own, ext := p.inflight(m)
		r := m.Replica
		r.Ready = m.Up()
		out = append(out, ReplicaState{Replica: r, InFlight: own, External: ext})
	}
	slices.SortFunc(out, func(a, b ReplicaState) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Run follows every replica's KV events and load, and checks its engine
// and tokenizer (Config.Keyer), until ctx ends (cluster.Pool.Run);
// replicas added meanwhile get their feeds at once, removed ones lose
// them. It returns when ctx ends and every feed has stopped.
func (p *Picker) Run(ctx context.Context) error {
	if p.gate != nil {
		gctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); p.gate.Run(gctx) }()
		defer func() { stop(); <-done }()
	}
	if err := p.pool.Run(ctx); err != nil {
		return fmt.Errorf("epp: %w", err)
	}
	return nil
}
