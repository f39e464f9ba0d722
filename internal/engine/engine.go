// Package engine serves the replica model (internal/replica) behind vLLM's
// OpenAI-compatible HTTP API, in real time: the `prefixlb engine` command, and
// the replicas `prefixlb demo` and the router's tests start in-process.
//
// One goroutine, Run's, owns the replica. It runs an iteration (Step), waits
// until the iteration's modelled end on the Clock (Config.TimeScale times
// sooner), hands every request its new tokens, and starts the next iteration
// with the requests and cancellations that arrived meanwhile, as a real
// engine's scheduler does between forward passes. HTTP handlers never touch
// the replica: they queue work for Run and wait for their request's progress,
// which Run publishes without ever blocking on a client.
//
// What a client sees is vLLM's API (INTERFACES.md §1–2): /v1/completions and
// /v1/chat/completions, streamed (SSE) or not, with usage including
// prompt_tokens_details.cached_tokens (the prefix-cache hit of the request's
// admission); /v1/models, /health, /tokenize and /metrics with vLLM's metric
// names. The model generates no real text: every request produces exactly
// max_tokens tokens (as if ignore_eos were set), finish_reason "length", and
// token k is a word chosen by a hash of the prompt and k, so the same request
// always gets the same text.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// Defaults filled in by Config.Default.
const (
	// DefaultModel is the model name served when Config.Model is empty.
	DefaultModel = "prefixlb-sim"
	// DefaultMaxModelLen is the longest prompt plus output accepted, in
	// tokens, like vLLM's --max-model-len (131072 is Llama 3.1's context).
	DefaultMaxModelLen = 131072
	// DefaultMaxBodyBytes bounds a request body: a full 131072-token prompt
	// sent as token ids is about 1 MiB of JSON.
	DefaultMaxBodyBytes = 16 << 20
	// DefaultMaxTokens is the output length of a request that gives no
	// max_tokens (vLLM's default for completions).
	DefaultMaxTokens = 16
	// DefaultKVLinkGbps is the bandwidth of the link pulled KV comes in
	// over: one 400 Gb/s ConnectX-7 port, as `prefixlb sim --kv-link-gbps`
	// assumes.
	DefaultKVLinkGbps = 400
	// DefaultKVLinkLatency is what each pull pays once on top of its bytes
	// (an assumption, as `prefixlb sim --kv-link-latency`).
	DefaultKVLinkLatency = time.Millisecond
)

// Errors of the engine.
var (
	// ErrInvalidConfig is wrapped by every error Config.Validate returns.
	ErrInvalidConfig = errors.New("engine: invalid config")
	// ErrStopped: Run has returned (or the request was still waiting when it
	// did); the engine serves no more requests.
	ErrStopped = errors.New("engine: stopped")
	// ErrRunning: Run was called a second time.
	ErrRunning = errors.New("engine: Run called twice")
	// ErrBusy: the prefix cache cannot be reset while requests are running.
	ErrBusy = errors.New("engine: requests are running")
)

// Clock is the engine's source of time. Run reads Now at each iteration and
// waits on After for the iteration to end; timestamps in responses and
// metrics come from Now.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// After returns a channel that receives the time once d has passed.
	After(d time.Duration) <-chan time.Time
}

// RealClock is the wall clock (package time).
type RealClock struct{}

// Now returns time.Now().
func (RealClock) Now() time.Time { return time.Now() }

// After returns time.After(d).
func (RealClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

var _ Clock = RealClock{}

// Config configures an Engine. Fill what you need and pass it to New, which
// fills the rest (Default) and validates it.
type Config struct {
	// Replica configures the modelled GPU: Replica.Profile is required; its
	// zero fields take replica's defaults.
	Replica replica.Config
	// Model is the model name /v1/models lists and responses carry.
	// Default DefaultModel.
	Model string
	// StrictModel makes a request that names another model fail with 404,
	// as vLLM does. By default any model name is accepted, so that a client
	// configured for the real model can talk to the engine unchanged.
	StrictModel bool
	// LoRAModules are the LoRA adapters the engine serves under their own
	// model names (vLLM's --lora-modules): a request naming one runs with
	// that adapter (replica.Request.Adapter; Replica.MaxLoras models the
	// slots), its blocks are keyed and published apart (blocks.ChainSeed;
	// BlockStored's lora_name), and /v1/models lists it with the base model
	// as its parent, as vLLM does.
	LoRAModules []string
	// LoRAAdapterBytes is each adapter's size, which a load copies to the
	// GPU (0: only the fixed cost).
	LoRAAdapterBytes int64
	// TimeScale divides every modelled duration: at 10 an iteration the
	// profile prices at 50 ms takes 5 ms of real time. Latencies in metrics
	// are real (scaled) time. Default 1.
	TimeScale float64
	// MaxModelLen is the most prompt plus output tokens a request may ask
	// for (vLLM's --max-model-len); longer requests fail with 400.
	// Default DefaultMaxModelLen.
	MaxModelLen int
	// MaxBodyBytes bounds a request body; a larger one fails with 413.
	// Default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// DefaultMaxTokens is the output length of a request without
	// max_tokens (chat requests included, where vLLM would fill the
	// context). Default DefaultMaxTokens.
	DefaultMaxTokens int
	// Tokenizer turns text prompts and rendered chats into token ids.
	// Default WordTokenizer.
	Tokenizer Tokenizer
	// RenderChat renders chat messages into the text the Tokenizer sees.
	// Default RenderChat.
	RenderChat func([]ChatMessage) string
	// ChatEncoder, when set, replaces RenderChat and Tokenizer for chats
	// (chat completions, and /tokenize with messages): it renders them with
	// a model's chat template and tokenizes the result, as vLLM does. It
	// gets the messages with their names, tool calls and reasoning, and the
	// body's tools, chat_template_kwargs and add_generation_prompt (default
	// true). A *tokenize.Tokenizer or *tokenize.PrefixCache fits; give the
	// same tokenizer as Tokenizer. Default nil.
	ChatEncoder ChatEncoder
	// Clock is the engine's time source. Default RealClock.
	Clock Clock
	// OnKVEvent, when set, receives every BlocksStored, BlocksRemoved and
	// AllCleared event of the replica, in order, with At on Clock's time
	// (not the modelled time). It is called from Run's goroutine, so it sees
	// one event at a time and delays the engine by as long as it takes: hand
	// the event off rather than doing I/O in it. The event's Keys must not be
	// modified; they may be kept. A KV-event publisher (vLLM's ZMQ stream)
	// plugs in here.
	OnKVEvent func(replica.Event)
	// KVPublisher, when set, receives the replica's cache events as vLLM's
	// KV events (BlockStored with token ids, BlockRemoved, AllBlocksCleared;
	// engine block hashes are the chain keys), one batch per delivery: at
	// most two per iteration, the evictions at its start and the stores at
	// its end. A *kvevents.Publisher is also run by Run: bound before the
	// first iteration (a bind error is Run's) and closed when Run returns,
	// so a new engine may bind the same endpoints afterwards.
	KVPublisher KVPublisher
	// Logger receives the engine's rare log lines. Default slog.Default().
	Logger *slog.Logger

	// EngineID names the engine in the kv_transfer_params of its prefill
	// legs (vLLM's remote_engine_id, --kv-transfer-config's engine_id).
	// Default a random UUID.
	EngineID string
	// KVLinkGbps is the bandwidth of the link a decode leg's KV is pulled
	// over, in Gb/s (pd.go). Default DefaultKVLinkGbps.
	KVLinkGbps float64
	// KVLinkLatency is paid once by every pull, after its last byte.
	// Default DefaultKVLinkLatency; negative means none.
	KVLinkLatency time.Duration
	// KVAdvertise is the "host:port" a prefill leg's kv_transfer_params
	// name as remote_host and remote_port. Default "": the local address
	// the request came in on (the address the engine listens on, as a
	// client reaches it).
	KVAdvertise string
}

// DefaultConfig returns a Config with every default filled in and no
// Replica.Profile.
func DefaultConfig() Config {
	var c Config
	c.Default()
	return c
}

// Default fills the zero fields that have a default, Replica's included.
func (c *Config) Default() {
	c.Replica.Default()
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = DefaultMaxModelLen
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.DefaultMaxTokens == 0 {
		c.DefaultMaxTokens = DefaultMaxTokens
	}
	if c.Tokenizer == nil {
		c.Tokenizer = WordTokenizer{}
	}
	if c.RenderChat == nil {
		c.RenderChat = RenderChat
	}
	if c.Clock == nil {
		c.Clock = RealClock{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.EngineID == "" {
		c.EngineID = newEngineID()
	}
	if c.KVLinkGbps == 0 {
		c.KVLinkGbps = DefaultKVLinkGbps
	}
	if c.KVLinkLatency == 0 {
		c.KVLinkLatency = DefaultKVLinkLatency
	}
}

// Validate reports the first rule the config breaks, as an error wrapping
// ErrInvalidConfig that names the field (replica.ErrInvalidConfig for the
// Replica fields). It checks the config as given: call Default first.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.Model == "":
		return bad("Model is empty")
	case !(c.TimeScale > 0) || math.IsInf(c.TimeScale, 0):
		return bad("TimeScale must be positive and finite, got %v", c.TimeScale)
	case c.MaxModelLen < 2:
		return bad("MaxModelLen must be at least 2, got %d", c.MaxModelLen)
	case c.MaxBodyBytes < 1:
		return bad("MaxBodyBytes must be positive, got %d", c.MaxBodyBytes)
	case c.DefaultMaxTokens < 1:
		return bad("DefaultMaxTokens must be at least 1, got %d", c.DefaultMaxTokens)
	case c.Tokenizer == nil:
		return bad("Tokenizer is nil")
	case c.RenderChat == nil:
		return bad("RenderChat is nil")
	case c.Clock == nil:
		return bad("Clock is nil")
	case c.Logger == nil:
		return bad("Logger is nil")
	case c.EngineID == "":
		return bad("EngineID is empty")
	case !(c.KVLinkGbps > 0) || math.IsInf(c.KVLinkGbps, 0):
		return bad("KVLinkGbps must be positive and finite, got %v", c.KVLinkGbps)
	}
	if c.KVAdvertise != "" {
		if _, _, err := splitHostPort(c.KVAdvertise); err != nil {
			return bad("KVAdvertise: %v", err)
		}
	}
	if err := c.Replica.Validate(); err != nil {
		return fmt.Errorf("%w: Replica: %w", ErrInvalidConfig, err)
	}
	if c.Replica.Role == replica.RoleDecode && costmodel.KVBytesOf(c.Replica.Profile) <= 0 {
		return bad("Replica.Role %q needs the profile's KV bytes per token to model the pull of the prefill's KV, and profile %q gives none (a roofline profile does; costmodel.KVBytesOf)",
			replica.RoleDecode, c.Replica.Profile.Name())
	}
	return nil
}

// Engine is one modelled replica behind vLLM's HTTP API. Create it with New,
// serve Handler, and call Run to start the model; requests wait until Run
// starts and fail with 503 once it has returned. Its methods are safe for
// concurrent use.
type Engine struct {
	cfg         Config
	rep         *replica.Replica // owned by Run's goroutine
	totalBlocks int
	// kvBytesPerToken prices a pull (costmodel.KVBytesOf); 0: the engine
	// cannot pull and computes decode legs' prompts itself.
	kvBytesPerToken float64
	created         time.Time
	handler         http.Handler
	met             metrics
	ids             atomic.Uint64 // last request ID handed out

	mu      sync.Mutex // guards ops, started and stopped
	ops     []op       // work queued for Run, in arrival order
	started bool
	stopped bool
	wake    chan struct{} // capacity 1; signalled when ops grows

	statsMu sync.Mutex    // guards stats, changed and lora
	stats   replica.Stats // the replica's state as of Run's last publish
	changed chan struct{} // closed (and replaced) when stats is published
	lora    loraInfo      // its adapters as of that publish (LoRAModules)
}

// loraInfo is what vLLM's vllm:lora_requests_info reports: the adapters the
// running requests use and those of the waiting ones, as of at.
type loraInfo struct {
	running, waiting []string
	at               time.Time
}

// New returns an engine with an idle replica. It starts nothing: serve
// Handler and call Run.
func New(cfg Config) (*Engine, error) {
	cfg.Default()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rep, err := replica.New(cfg.Replica)
	if err != nil {
		return nil, fmt.Errorf("engine: new replica: %w", err)
	}
	cfg.Replica = rep.Config()
	e := &Engine{
		cfg:     cfg,
		rep:     rep,
		created: cfg.Clock.Now(),
		wake:    make(chan struct{}, 1),
		changed: make(chan struct{}),
	}
	e.stats = rep.Stats()
	e.lora.at = e.created
	e.totalBlocks = e.stats.TotalBlocks
	if cfg.Replica.Slots == 0 { // llama.cpp's slots receive no KV
		e.kvBytesPerToken = costmodel.KVBytesOf(cfg.Replica.Profile)
	}
	e.met.init()
	e.handler = e.routes()
	return e, nil
}

// Config returns the engine's configuration, defaults filled in.
func (e *Engine) Config() Config { return e.cfg }

// Handler returns the HTTP API: POST /v1/completions, POST
// /v1/chat/completions, GET /v1/models, GET /health (200 while Run runs, 503
// otherwise), POST /tokenize, GET /metrics and POST /reset_prefix_cache.
func (e *Engine) Handler() http.Handler { return e.handler }

// Stats returns the replica's state as Run last published it: while an
// iteration runs, Running counts every request in it (those finishing at its
// end included) and the counters are as of its end.
func (e *Engine) Stats() replica.Stats {
	e.statsMu.Lock()
	defer e.statsMu.Unlock()
	return e.stats
}

// waitStats blocks until cond holds for the published stats or ctx is done.
func (e *Engine) waitStats(ctx context.Context, cond func(replica.Stats) bool) error {
	for {
		e.statsMu.Lock()
		st, ch := e.stats, e.changed
		e.statsMu.Unlock()
		if cond(st) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("engine: wait for stats: %w (last %+v)", ctx.Err(), st)
		}
	}
}

// publish makes st, and with LoRA modules the replica's running and
// waiting adapters, what Stats and /metrics report. Only Run's goroutine,
// which owns e.rep, calls it.
func (e *Engine) publish(st replica.Stats) {
	var lora loraInfo
	if len(e.cfg.LoRAModules) > 0 {
		lora = loraInfo{e.rep.RunningAdapters(nil), e.rep.WaitingAdapters(nil), e.cfg.Clock.Now()}
	}
	e.statsMu.Lock()
	e.stats = st
	e.lora = lora
	close(e.changed)
	e.changed = make(chan struct{})
	e.statsMu.Unlock()
}

// opKind says what an op asks of Run.
type opKind uint8

const (
	opSubmit opKind = iota + 1
	opCancel
	opReset
	opPrefix
	opOffloaded
)

// op is work a handler queues for Run's goroutine.
type op struct {
	kind  opKind
	st    *stream      // opSubmit
	id    uint64       // opCancel
	reply chan error   // opReset; capacity 1
	keys  []blocks.Key // opPrefix, opOffloaded
	n     chan int     // opPrefix, opOffloaded; capacity 1
}

// enqueue hands o to Run. It fails with ErrStopped once Run has returned.
func (e *Engine) enqueue(o op) error {
	e.mu.Lock()
	if e.stopped {
		e.mu.Unlock()
		return ErrStopped
	}
	e.ops = append(e.ops, o)
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return nil
}

// running reports whether Run is serving.
func (e *Engine) running() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.started && !e.stopped
}

// resetPrefixCache empties the replica's prefix cache between iterations.
func (e *Engine) resetPrefixCache(ctx context.Context) error {
	reply := make(chan error, 1)
	if err := e.enqueue(op{kind: opReset, reply: reply}); err != nil {
		return err
	}
	select {
	case err := <-reply:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// CachedPrefix returns how many leading keys of a chain the replica's prefix
// cache holds, as of the end of the current iteration (Run answers between
// iterations). It fails with ErrStopped once Run has returned.
func (e *Engine) CachedPrefix(ctx context.Context, keys []blocks.Key) (int, error) {
	return e.prefixOp(ctx, opPrefix, keys)
}

// OffloadedPrefix returns how many leading keys of a chain the replica's
// CPU offload tier holds (Config.Replica.CPUOffloadTokens; 0 without one),
// as CachedPrefix does for the GPU prefix cache.
func (e *Engine) OffloadedPrefix(ctx context.Context, keys []blocks.Key) (int, error) {
	return e.prefixOp(ctx, opOffloaded, keys)
}

// prefixOp asks the run loop how many leading keys one of the replica's
// caches holds (kind opPrefix or opOffloaded).
func (e *Engine) prefixOp(ctx context.Context, kind opKind, keys []blocks.Key) (int, error) {
	n := make(chan int, 1)
	if err := e.enqueue(op{kind: kind, keys: keys, n: n}); err != nil {
		return 0, err
	}
	select {
	case v := <-n:
		if v < 0 {
			return 0, ErrStopped
		}
		return v, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// progress is what a handler knows of its request.
type progress struct {
	hit       int   // cached prompt tokens at the first admission
	generated int   // output tokens produced so far
	finished  bool  // all tokens produced
	err       error // the request failed (the engine stopped)
}

// stream is one request in flight, shared between its handler and Run.
type stream struct {
	req     replica.Request
	tokens  []uint32      // the prompt's token ids (for KV events)
	arrival time.Time     // when the handler submitted it, on the Clock
	notify  chan struct{} // capacity 1; signalled when p changes

	last time.Time // Run only: when the last token came

	mu sync.Mutex // guards p
	p  progress
}

func newStream(req replica.Request, now time.Time) *stream {
	return &stream{req: req, arrival: now, notify: make(chan struct{}, 1)}
}

// update changes the progress and wakes the handler; it never blocks.
func (s *stream) update(f func(*progress)) {
	s.mu.Lock()
	f(&s.p)
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

func (s *stream) progress() progress {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.p
}

// Run runs the replica in real time until ctx is done, then fails the
// requests still in flight with ErrStopped and returns nil. It returns
// ErrRunning if called again.
func (e *Engine) Run(ctx context.Context) error {
	e.mu.Lock()
	if e.started {
		e.mu.Unlock()
		return fmt.Errorf("engine: run: %w", ErrRunning)
	}
	e.started = true
	e.mu.Unlock()
	d := &driver{
		e:     e,
		rep:   e.rep,
		clock: e.cfg.Clock,
		scale: e.cfg.TimeScale,
		live:  make(map[uint64]*stream),
	}
	d.base = d.clock.Now()
	if e.kvBytesPerToken > 0 {
		d.link = newKVLink(e.cfg.KVLinkGbps, e.cfg.KVLinkLatency)
	}
	if e.cfg.KVPublisher != nil {
		d.kv = newKVAdapter(e, e.cfg.KVPublisher)
	}
	if r, ok := e.cfg.KVPublisher.(kvRunner); ok {
		pctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(pctx) }()
		<-r.Ready()
		if r.Endpoint() == "" {
			cancel()
			err := <-done
			d.stop()
			return fmt.Errorf("engine: run: kv events: %w", err)
		}
		defer func() {
			cancel()
			if err := <-done; err != nil {
				e.cfg.Logger.Warn("engine: kv events publisher stopped", "err", err)
			}
		}()
	}
	defer d.stop()
	d.loop(ctx)
	return nil
}

// kvRunner is a KVPublisher that Run runs (*kvevents.Publisher).
type kvRunner interface {
	Run(ctx context.Context) error
	Ready() <-chan struct{}
	Endpoint() string
}

// driver is the state of Run's goroutine.
type driver struct {
	e     *Engine
	rep   *replica.Replica
	clock Clock
	scale float64
	base  time.Time          // real time at which modelled time = real time
	live  map[uint64]*stream // submitted, neither finished nor cancelled
	evbuf []replica.Event
	ops   []op
	kv    *kvAdapter // nil without a KVPublisher
	ended []*stream  // scratch: requests finished in one deliver
	// link carries decode legs' pulled KV (pd.go); nil when the engine
	// cannot pull (Engine.kvBytesPerToken 0).
	link   *kvLink
	landed []*pull // scratch: the pulls one land hands over
}

// modelled maps real time to the replica's modelled time, which runs
// TimeScale times faster from base.
func (d *driver) modelled(t time.Time) time.Time {
	if d.scale == 1 {
		return t
	}
	return d.base.Add(time.Duration(float64(t.Sub(d.base)) * d.scale))
}

// real maps a modelled duration to real time.
func (d *driver) real(dur time.Duration) time.Duration {
	if d.scale == 1 {
		return dur
	}
	return time.Duration(float64(dur) / d.scale)
}

func (d *driver) loop(ctx context.Context) {
	for ctx.Err() == nil {
		d.applyOps()
		d.land()
		start := d.clock.Now()
		mStart := d.modelled(start)
		mEnd, evs, busy := d.rep.Step(mStart, d.evbuf[:0])
		d.startPulls(evs)
		if !busy {
			// Nothing to compute, though Step may have admitted decode
			// legs that now await their KV (Admitted, KVPull, and the
			// evictions that made room for them).
			d.deliver(evs, start)
			clear(evs)
			d.evbuf = evs[:0]
			d.e.publish(d.rep.Stats())
			d.idle(ctx)
			continue
		}
		// Events dated at the start (admissions, preemptions, evictions)
		// come first; the rest are dated at the end.
		split := len(evs)
		finishing := 0
		for i, ev := range evs {
			if split == len(evs) && ev.At.After(mStart) {
				split = i
			}
			if ev.Kind == replica.Finished {
				finishing++
			}
		}
		// During the iteration the requests finishing at its end still run.
		st := d.rep.Stats()
		st.Running += finishing
		d.e.publish(st)
		d.deliver(evs[:split], start)
		if wait := d.real(mEnd.Sub(mStart)); wait > 0 {
			select {
			case <-ctx.Done():
				clear(evs)
				return
			case <-d.clock.After(wait):
			}
		}
		d.deliver(evs[split:], d.clock.Now())
		d.e.publish(d.rep.Stats())
		clear(evs) // drop references to requests' keys
		d.evbuf = evs[:0]
	}
}

// idle waits, with nothing to compute, for new work, for the next pull to
// arrive, or for ctx to end.
func (d *driver) idle(ctx context.Context) {
	var arrival <-chan time.Time
	if d.link != nil {
		if at, ok := d.link.next(); ok {
			// Rounded up, and a nanosecond more, so that the modelled
			// time has reached the arrival when the wait ends.
			wait := at.Sub(d.modelled(d.clock.Now()))
			arrival = d.clock.After(max(time.Duration(math.Ceil(float64(wait)/d.scale))+1, 0))
		}
	}
	select {
	case <-ctx.Done():
	case <-d.e.wake:
	case <-arrival:
	}
}

// startPulls puts on the link the pulls that Step's KVPull events ask for:
// N blocks of the block size, at the profile's KV bytes per token, from the
// event's (modelled) time.
func (d *driver) startPulls(evs []replica.Event) {
	for _, ev := range evs {
		if ev.Kind != replica.KVPull {
			continue
		}
		bytes := float64(ev.N*d.e.cfg.Replica.BlockSize) * d.e.kvBytesPerToken
		d.link.start(ev.RequestID, ev.N, bytes, ev.At)
	}
}

// land hands the replica the pulls that have arrived by now (KVArrived),
// delivering the BlocksStored events of the blocks they brought.
func (d *driver) land() {
	if d.link == nil || d.link.inFlight() == 0 {
		return
	}
	now := d.clock.Now()
	mNow := d.modelled(now)
	d.landed = d.link.arrived(mNow, d.landed[:0])
	for i, p := range d.landed {
		d.landed[i] = nil
		evs, err := d.rep.KVArrived(p.id, mNow)
		if err != nil { // cannot happen: a cancelled request's pull is dropped
			d.e.cfg.Logger.Error("engine: kv pull arrived", "err", err)
			continue
		}
		d.e.met.pulled(d.real(p.done.Sub(p.start)), p.blocks, p.bytes)
		d.deliver(evs, now)
	}
}

// applyOps runs the work handlers queued since the last iteration.
func (d *driver) applyOps() {
	d.e.mu.Lock()
	d.ops, d.e.ops = d.e.ops, d.ops[:0]
	d.e.mu.Unlock()
	if len(d.ops) == 0 {
		return
	}
	now := d.clock.Now()
	mNow := d.modelled(now)
	for i, o := range d.ops {
		switch o.kind {
		case opSubmit:
			if err := d.rep.Submit(&o.st.req, mNow); err != nil {
				o.st.update(func(p *progress) { p.err = fmt.Errorf("engine: submit: %w", err) })
				break
			}
			d.live[o.st.req.ID] = o.st
			if d.kv != nil {
				d.kv.hold(o.st)
			}
		case opCancel:
			if s := d.live[o.id]; s != nil {
				d.rep.Cancel(o.id, mNow)
				if s.req.RemoteKV && d.link != nil {
					d.link.cancel(o.id, mNow)
				}
				delete(d.live, o.id)
				if d.kv != nil {
					d.kv.release(s)
				}
			}
		case opReset:
			evs, ok := d.rep.ResetPrefixCache(mNow)
			if !ok {
				o.reply <- ErrBusy
				break
			}
			d.deliver(evs, now)
			o.reply <- nil
		case opPrefix:
			o.n <- d.rep.CachedPrefix(o.keys)
		case opOffloaded:
			o.n <- d.rep.OffloadedPrefix(o.keys)
		}
		d.ops[i] = op{}
	}
	d.ops = d.ops[:0]
}

// deliver hands events that happened at now (real time) to their requests,
// the metrics and the KV-event hook.
func (d *driver) deliver(evs []replica.Event, now time.Time) {
	m := &d.e.met
	for _, ev := range evs {
		switch ev.Kind {
		case replica.BlocksStored, replica.BlocksRemoved, replica.AllCleared:
			if d.e.cfg.OnKVEvent != nil {
				ev.At = now
				d.e.cfg.OnKVEvent(ev)
			}
			if d.kv != nil {
				d.kv.addEvent(ev)
			}
			continue
		}
		s := d.live[ev.RequestID]
		if s == nil {
			continue
		}
		switch ev.Kind {
		case replica.Admitted:
			if !ev.Resumed {
				// Tokens loaded from the CPU offload tier count as
				// cached, as vLLM's num_cached_tokens counts a
				// connector's external tokens.
				hit := ev.HitTokens + ev.TierTokens
				s.update(func(p *progress) { p.hit = hit })
			}
		case replica.FirstToken, replica.Token:
			if ev.Kind == replica.FirstToken {
				m.firstToken(now.Sub(s.arrival), s.req.PromptTokens)
			} else {
				m.token(now.Sub(s.last))
			}
			s.last = now
			n := ev.N
			s.update(func(p *progress) { p.generated = n })
		case replica.Finished:
			m.finished(now.Sub(s.arrival))
			delete(d.live, ev.RequestID)
			s.update(func(p *progress) { p.finished = true })
			if d.kv != nil {
				d.ended = append(d.ended, s)
			}
		}
	}
	if d.kv != nil {
		d.kv.flush(now)
		// Token ids are released only after the batch, which may hold
		// stores that came after the request's Finished.
		for i, s := range d.ended {
			d.kv.release(s)
			d.ended[i] = nil
		}
		d.ended = d.ended[:0]
	}
}

// stop ends Run: no more work is accepted, and every request queued or in
// flight fails with ErrStopped.
func (d *driver) stop() {
	d.e.mu.Lock()
	d.e.stopped = true
	pending := d.e.ops
	d.e.ops = nil
	d.e.mu.Unlock()
	fail := func(p *progress) { p.err = ErrStopped }
	for _, o := range pending {
		switch o.kind {
		case opSubmit:
			o.st.update(fail)
		case opReset:
			o.reply <- ErrStopped
		case opPrefix, opOffloaded:
			o.n <- -1
		}
	}
	for id, s := range d.live {
		s.update(fail)
		delete(d.live, id)
	}
	d.e.publish(d.rep.Stats())
}
