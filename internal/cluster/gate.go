package cluster

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// Request headers that class a request for the router-side queue (both
// front doors read them). Only a trusted peer may set them
// (tenant.Resolver.TrustedPeer); from anyone else they are ignored.
const (
	// PriorityHeader is the request's priority, an integer (higher first),
	// over its class's.
	PriorityHeader = tenant.PriorityHeader
	// TenantHeader names the request's tenant when no configured tenant's
	// API key does (tenant.Resolver.Resolve).
	TenantHeader = tenant.Header
	// SLOHeader is the request's TTFT SLO, a Go duration ("2s", "500ms"),
	// over its class's: its deadline is its arrival plus that, raised to
	// Admission.MinTTFTSLO.
	SLOHeader = tenant.SLOHeader
)

// maxPriority bounds a header's priority (each distinct priority is a band
// of the queue while it has requests).
const maxPriority = 1000

// Class is a class of requests: the priority and TTFT SLO given to the
// requests of a model and/or a tenant (YAML queue.classes).
type Class struct {
	// Model and Tenant select the requests ("" matches any); the first
	// class that matches applies.
	Model  string `json:"model,omitempty"`
	Tenant string `json:"tenant,omitempty"`
	// Priority orders the queue (higher first).
	Priority int `json:"priority"`
	// TTFTSLO is the time to first token the class is promised, a Go
	// duration ("" or "0s": none).
	TTFTSLO string `json:"ttft_slo,omitempty"`
	// Weight is the tenant's weight in the fair share (0: 1).
	Weight float64 `json:"weight,omitempty"`

	slo time.Duration
}

// QueueConfig configures a front door's router-side queue.
type QueueConfig struct {
	// On puts the queue in front of the router (default true).
	On bool
	// Admission is the queue and its saturation thresholds.
	Admission admission.Config
	// Classes give requests a priority and a TTFT SLO by model and tenant.
	Classes []Class
	// Interval is how often a waiting queue is re-judged (timeouts,
	// deadlines, capacity freed by a load scrape); a finish or a first
	// token re-judges it at once (0: 10ms).
	Interval time.Duration
	// Tenants are the configured tenants' names (tenant.Config.Names):
	// the metrics label a tenant by its name when it is one of these, a
	// class's or a weight's, and every other as tenant.Other.
	Tenants []string
}

// DefaultQueueConfig is the queue on, with admission's defaults.
func DefaultQueueConfig() QueueConfig {
	return QueueConfig{On: true, Admission: admission.Default(), Interval: 10 * time.Millisecond}
}

// Validate reports the first invalid field and resolves the classes' SLOs.
func (c *QueueConfig) Validate() error {
	if c.Interval < 0 {
		return fmt.Errorf("queue: interval must be ≥ 0, got %v", c.Interval)
	}
	for i := range c.Classes {
		cl := &c.Classes[i]
		if cl.TTFTSLO != "" {
			d, err := time.ParseDuration(cl.TTFTSLO)
			if err != nil || d < 0 {
				return fmt.Errorf("queue: classes[%d].ttft_slo: want a duration ≥ 0, got %q", i, cl.TTFTSLO)
			}
			cl.slo = d
		}
		if cl.Weight < 0 || math.IsNaN(cl.Weight) || math.IsInf(cl.Weight, 0) {
			return fmt.Errorf("queue: classes[%d].weight must be ≥ 0, got %v", i, cl.Weight)
		}
		if cl.Weight > 0 && cl.Tenant != "" {
			if c.Admission.Weights == nil {
				c.Admission.Weights = map[string]float64{}
			}
			c.Admission.Weights[cl.Tenant] = cl.Weight
		}
	}
	if err := c.Admission.Validate(); err != nil {
		return fmt.Errorf("queue: %w", err)
	}
	return nil
}

// ErrBadClass is returned for a malformed class header.
var ErrBadClass = errors.New("bad queue header")

// Classify fills t's Tenant (id's), Priority and Deadline from its model
// and, when id is trusted, the request's headers (get), over the first
// matching class. An SLO header is raised to Admission.MinTTFTSLO. arrival
// must be set. A malformed header of a trusted request is an error
// wrapping ErrBadClass; an untrusted request's headers are not read.
func (c *QueueConfig) Classify(t *admission.Ticket, model string, id *tenant.Identity, get func(string) string) error {
	t.Tenant = id.Tenant
	var slo time.Duration
	for i := range c.Classes {
		cl := &c.Classes[i]
		if (cl.Model == "" || cl.Model == model) && (cl.Tenant == "" || cl.Tenant == t.Tenant) {
			t.Priority, slo = cl.Priority, cl.slo
			break
		}
	}
	if !id.Trusted {
		if slo > 0 {
			t.Deadline = t.Arrival.Add(slo)
		}
		return nil
	}
	if v := get(PriorityHeader); v != "" {
		p, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || p < -maxPriority || p > maxPriority {
			return fmt.Errorf("%w: %s must be an integer in [%d, %d], got %q", ErrBadClass, PriorityHeader, -maxPriority, maxPriority, v)
		}
		t.Priority = p
	}
	if v := get(SLOHeader); v != "" {
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d <= 0 {
			return fmt.Errorf("%w: %s must be a duration > 0, got %q", ErrBadClass, SLOHeader, v)
		}
		slo = max(d, c.Admission.MinTTFTSLO)
	}
	if slo > 0 {
		t.Deadline = t.Arrival.Add(slo)
	}
	return nil
}

// TenantOf is the anonymous tenant of a request's API key
// (tenant.Anonymous: "key-" and 12 hex digits of its SHA-256, "" without
// a key). It no longer reads TenantHeader, which any client could set: a
// request's tenant is Tenants.Identify's Identity.Tenant, which is this
// for a request that is no configured tenant's and no trusted gateway's.
func TenantOf(get func(string) string) string { return tenant.Anonymous(get) }

// Waiter is one request in a Gate: its ticket, and what to do under the
// core's lock when it leaves the queue to be routed.
type Waiter struct {
	// Ticket is the request as the queue knows it (ID unique among the
	// gate's waiters).
	Ticket admission.Ticket
	// Dispatch routes the request; the gate calls it under Core.Mu at the
	// moment the queue lets it through, so that the policy decides with
	// the cluster as it is then.
	Dispatch func(now time.Time)
	// Request is the request as the router prices it (nil: unknown): a
	// request that waits with a deadline is shed when even its own
	// prefill at the least loaded replica would miss it
	// (Router.PrefillEstimate).
	Request *policy.Request
	// Room, when Dispatch runs for a request that waited, lists the
	// replicas with room (admission.Queue.Room: GIE's saturation Filter);
	// Dispatch routes among them only (router.Constraint.Only). nil for a
	// request let straight through: any replica.
	Room []int

	done chan struct{}
	shed bool
}

// Shed reports whether the request was shed (Ticket.Reason says why).
func (w *Waiter) Shed() bool { return w.shed }

// Gate is the router-side queue of a Core: an admission.Queue under the
// core's lock, each waiting request parked on a channel, dispatched (routed
// through its Dispatch) as capacity frees. Create it with NewGate; call
// Kick under Core.Mu after anything that may free capacity, and run Run.
type Gate struct {
	core *Core
	cfg  QueueConfig
	q    *admission.Queue // guarded by core.Mu
	// waiters maps a waiting ticket's ID to its waiter (guarded by
	// core.Mu).
	waiters map[uint64]*Waiter
	n       atomic.Int64 // q.Len(), readable without the lock
	m       *GateMetrics
	shedFn  func(*admission.Ticket)
	est     admission.DecodeAware
	// arriving is the waiter ArriveLocked is offering (its Request prices
	// its Service).
	arriving *Waiter
}

// NewGate returns the gate of core (cfg validated), its metrics in m (nil:
// none).
func NewGate(core *Core, cfg QueueConfig, m *GateMetrics) (*Gate, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	q, err := admission.New(cfg.Admission)
	if err != nil {
		return nil, err
	}
	if cfg.Interval == 0 {
		cfg.Interval = 10 * time.Millisecond
	}
	g := &Gate{core: core, cfg: cfg, q: q, waiters: map[uint64]*Waiter{}, m: m}
	m.know(&cfg)
	g.shedFn = g.shedLocked
	g.est = admission.DecodeAware{Profile: core.Router.PricedProfile, Reps: core.Router.Load, Prefill: g.prefill}
	q.SetEstimator(&g.est)
	return g, nil
}

// prefill is the arriving request's own prefill on replica i.
func (g *Gate) prefill(t *admission.Ticket, i int) time.Duration {
	w := g.arriving
	if w == nil || &w.Ticket != t || w.Request == nil {
		return 0
	}
	return g.core.Router.PrefillEstimate(w.Request, i)
}

// Config returns the gate's configuration.
func (g *Gate) Config() *QueueConfig { return &g.cfg }

// ArriveLocked offers w to the queue, under Core.Mu: admission.Pass (route
// it now, as without a queue), Queued (Wait for it, after releasing the
// lock) or Shed.
func (g *Gate) ArriveLocked(w *Waiter, now time.Time) admission.Verdict {
	g.arriving = w
	v, displaced := g.q.Arrive(&w.Ticket, g.core.Router.Load(), now)
	g.arriving = nil
	if displaced != nil {
		g.shedLocked(displaced)
	}
	switch v {
	case admission.Pass:
		g.m.passed()
	case admission.Shed:
		w.shed = true
		g.m.shed(&w.Ticket, now, false)
	case admission.Queued:
		w.done = make(chan struct{})
		g.waiters[w.Ticket.ID] = w
		g.n.Store(int64(g.q.Len()))
		g.m.enqueued(&w.Ticket)
	}
	return v
}

// Wait blocks until w, queued, is dispatched (nil: its Dispatch ran) or
// shed (an error wrapping ErrShed), or ctx ends: then it leaves the queue
// at once and Wait returns ctx's error, unless it was dispatched meanwhile
// (nil: the caller owns the routed request and must end it).
func (g *Gate) Wait(ctx context.Context, w *Waiter) error {
	select {
	case <-w.done:
	case <-ctx.Done():
		g.core.Mu.Lock()
		if g.q.Cancel(&w.Ticket) {
			delete(g.waiters, w.Ticket.ID)
			g.n.Store(int64(g.q.Len()))
			g.m.cancelled(&w.Ticket)
			g.core.Mu.Unlock()
			return ctx.Err()
		}
		g.core.Mu.Unlock()
		<-w.done // dispatched or shed under the lock: done is closed
	}
	if w.shed {
		return &ShedError{Reason: w.Ticket.Reason}
	}
	return nil
}

// ShedError is a request the queue shed.
type ShedError struct{ Reason admission.Reason }

func (e *ShedError) Error() string { return "queue: request shed: " + e.Reason.String() }

// Is makes a ShedError match ErrShed.
func (e *ShedError) Is(target error) bool { return target == ErrShed }

// ErrShed is matched by every ShedError.
var ErrShed = errors.New("queue: request shed")

// KickLocked, under Core.Mu, sheds what is due and dispatches what the
// pool has room for. It is cheap when nothing waits.
func (g *Gate) KickLocked(now time.Time) {
	if g.q.Len() == 0 {
		return
	}
	for t := g.q.Next(g.core.Router.Load(), now, g.shedFn); t != nil; t = g.q.Next(g.core.Router.Load(), now, g.shedFn) {
		w := g.waiters[t.ID]
		delete(g.waiters, t.ID)
		g.m.dispatched(t, now)
		w.Room = g.q.Room(g.core.Router.Load(), nil)
		w.Dispatch(now)
		close(w.done)
	}
	g.n.Store(int64(g.q.Len()))
}

// shedLocked ends a waiting request the queue shed.
func (g *Gate) shedLocked(t *admission.Ticket) {
	w := g.waiters[t.ID]
	delete(g.waiters, t.ID)
	g.m.shed(t, time.Time{}, true)
	if w != nil {
		w.shed = true
		close(w.done)
	}
	g.n.Store(int64(g.q.Len()))
}

// Len is the number of requests waiting (no lock).
func (g *Gate) Len() int { return int(g.n.Load()) }

// Run re-judges a waiting queue every Interval until ctx ends (timeouts,
// deadlines, capacity a load scrape or a replica's return freed).
// Every SweepInterval it also deletes the metric series of tenants and
// priorities that have had no request in the queue for SeriesTTL.
func (g *Gate) Run(ctx context.Context) {
	t := time.NewTicker(g.cfg.Interval)
	defer t.Stop()
	swept := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if now.Sub(swept) >= SweepInterval {
				swept = now
				g.core.Mu.Lock()
				g.m.sweepLocked(now)
				g.core.Mu.Unlock()
			}
			if g.n.Load() == 0 {
				continue
			}
			g.core.Mu.Lock()
			g.KickLocked(now)
			g.core.Mu.Unlock()
		}
	}
}

// GateState is the queue for a debug view.
type GateState struct {
	Waiting int              `json:"waiting"`
	Stats   admission.Stats  `json:"stats"`
	Flows   []admission.Flow `json:"flows"`
	Config  admission.Config `json:"config"`
	Classes []Class          `json:"classes,omitempty"`
	Shed    map[string]int64 `json:"shed"`
	Pool    admission.Pool   `json:"pool"`
	// Threshold is the predicted-wait threshold in force: the configured
	// one, lowered by the SLO fraction (admission.Queue.Threshold).
	Threshold time.Duration `json:"predicted_wait_threshold"`
}

// StateLocked is the queue now, under Core.Mu.
func (g *Gate) StateLocked() GateState {
	st := g.q.Stats()
	s := GateState{Waiting: g.q.Len(), Stats: st, Flows: g.q.Flows(nil), Config: g.cfg.Admission, Classes: g.cfg.Classes,
		Shed: map[string]int64{}, Pool: g.q.Judge(g.core.Router.Load()), Threshold: g.q.Threshold()}
	for _, r := range admission.Reasons() {
		s.Shed[r.String()] = st.Shed[r]
	}
	return s
}

// SeriesTTL is how long the queue's metric series of a tenant and a
// priority outlive their last request in the queue: then they are
// deleted, so that the series a departed tenant or a priority no longer
// used leaves do not pile up. SweepInterval is how often Gate.Run looks.
const (
	SeriesTTL     = 5 * time.Minute
	SweepInterval = time.Minute
)

// GateMetrics are the queue's Prometheus metrics. Their tenant label is a
// configured tenant's name, a class's or a weight's, else tenant.Other:
// clients cannot make series by sending names or API keys. Its methods are
// called under the core's Mu.
type GateMetrics struct {
	length     *prometheus.GaugeVec
	wait       *prometheus.HistogramVec
	shedC      *prometheus.CounterVec
	dispatchC  *prometheus.CounterVec
	passedC    prometheus.Counter
	cancelledC prometheus.Counter

	// known are the tenants labelled by name (set by NewGate).
	known map[string]bool
	// series is each (priority, tenant label) pair with series, and when a
	// request of it was last queued or dispatched (guarded by Core.Mu).
	series map[seriesKey]*seriesState
}

type seriesKey struct {
	prio   int
	tenant string // the label
}

type seriesState struct {
	waiting int
	last    time.Time
}

// NewGateMetrics registers the queue's metrics on reg:
//
//	prefixlb_queue_length{priority,tenant}            requests waiting
//	prefixlb_queue_wait_seconds{priority,tenant}      wait of dispatched requests
//	prefixlb_queue_shed_total{reason}                 shed requests
//	prefixlb_queue_dispatched_total{tenant}           requests let through after waiting
//	prefixlb_queue_passed_total                       requests let through at once
//	prefixlb_queue_cancelled_total                    clients that left while waiting
//
// tenant is a configured tenant's name or "other"; the series of a
// priority and tenant are deleted SeriesTTL after their last request.
func NewGateMetrics(reg prometheus.Registerer) (*GateMetrics, error) {
	m := &GateMetrics{
		length: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "prefixlb_queue_length",
			Help: "Requests waiting in the router-side queue, by priority and tenant (configured tenants by name, every other as other)."}, []string{"priority", "tenant"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "prefixlb_queue_wait_seconds",
			Help:    "Time dispatched requests waited in the router-side queue, by priority and tenant.",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60}}, []string{"priority", "tenant"}),
		shedC: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "prefixlb_queue_shed_total",
			Help: "Requests the router-side queue shed, by reason."}, []string{"reason"}),
		dispatchC: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "prefixlb_queue_dispatched_total",
			Help: "Requests dispatched from the router-side queue after waiting, by tenant."}, []string{"tenant"}),
		passedC: prometheus.NewCounter(prometheus.CounterOpts{Name: "prefixlb_queue_passed_total",
			Help: "Requests the router-side queue let through at once (pool not saturated)."}),
		cancelledC: prometheus.NewCounter(prometheus.CounterOpts{Name: "prefixlb_queue_cancelled_total",
			Help: "Requests whose client left while they waited in the router-side queue."}),
		series: map[seriesKey]*seriesState{},
	}
	for _, c := range []prometheus.Collector{m.length, m.wait, m.shedC, m.dispatchC, m.passedC, m.cancelledC} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, r := range admission.Reasons() {
		m.shedC.WithLabelValues(r.String())
	}
	return m, nil
}

// know sets the tenants labelled by name: cfg's configured tenants, and
// those its classes and weights name.
func (m *GateMetrics) know(cfg *QueueConfig) {
	if m == nil {
		return
	}
	m.known = map[string]bool{}
	for _, t := range cfg.Tenants {
		m.known[t] = true
	}
	for _, cl := range cfg.Classes {
		if cl.Tenant != "" {
			m.known[cl.Tenant] = true
		}
	}
	for t := range cfg.Admission.Weights {
		m.known[t] = true
	}
}

// label is tenant t's label.
func (m *GateMetrics) label(t string) string {
	if m.known[t] {
		return t
	}
	return tenant.Other
}

// seriesOf is ticket t's series state, made if needed.
func (m *GateMetrics) seriesOf(t *admission.Ticket) (seriesKey, *seriesState) {
	k := seriesKey{t.Priority, m.label(t.Tenant)}
	s := m.series[k]
	if s == nil {
		s = &seriesState{}
		m.series[k] = s
	}
	return k, s
}

func (m *GateMetrics) passed() {
	if m != nil {
		m.passedC.Inc()
	}
}

func (m *GateMetrics) enqueued(t *admission.Ticket) {
	if m == nil {
		return
	}
	k, s := m.seriesOf(t)
	s.waiting++
	if t.Arrival.After(s.last) {
		s.last = t.Arrival
	}
	m.length.WithLabelValues(strconv.Itoa(k.prio), k.tenant).Inc()
}

func (m *GateMetrics) left(t *admission.Ticket) (seriesKey, *seriesState) {
	k, s := m.seriesOf(t)
	s.waiting--
	m.length.WithLabelValues(strconv.Itoa(k.prio), k.tenant).Dec()
	return k, s
}

func (m *GateMetrics) dispatched(t *admission.Ticket, now time.Time) {
	if m == nil {
		return
	}
	k, s := m.left(t)
	if now.After(s.last) {
		s.last = now
	}
	m.wait.WithLabelValues(strconv.Itoa(k.prio), k.tenant).Observe(now.Sub(t.Arrival).Seconds())
	m.dispatchC.WithLabelValues(k.tenant).Inc()
}

func (m *GateMetrics) shed(t *admission.Ticket, _ time.Time, waited bool) {
	if m == nil {
		return
	}
	if waited {
		m.left(t)
	}
	m.shedC.WithLabelValues(t.Reason.String()).Inc()
}

func (m *GateMetrics) cancelled(t *admission.Ticket) {
	if m != nil {
		m.left(t)
		m.cancelledC.Inc()
	}
}

// sweepLocked deletes the series of every priority and tenant with no
// request waiting and none queued or dispatched since SeriesTTL before now,
// and a tenant's dispatched counter once it has no series left.
func (m *GateMetrics) sweepLocked(now time.Time) {
	if m == nil {
		return
	}
	live := map[string]bool{}
	var gone []seriesKey
	for k, s := range m.series {
		if s.waiting <= 0 && now.Sub(s.last) >= SeriesTTL {
			gone = append(gone, k)
		} else {
			live[k.tenant] = true
		}
	}
	for _, k := range gone {
		p := strconv.Itoa(k.prio)
		m.length.DeleteLabelValues(p, k.tenant)
		m.wait.DeleteLabelValues(p, k.tenant)
		delete(m.series, k)
		if !live[k.tenant] {
			m.dispatchC.DeleteLabelValues(k.tenant)
		}
	}
}
