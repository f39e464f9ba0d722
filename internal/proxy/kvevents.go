package proxy

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// kvState is the proxy's side of the replicas' KV-event streams: one Index
// for all replicas (each has its own lock), one Subscriber per replica that
// publishes events, and the Sink that applies the router keys to the core.
type kvState struct {
	index   *kvevents.Index
	metrics *kvevents.Metrics
	applied *prometheus.CounterVec // replica, outcome
}

// kvCounters count what one replica's events did to the router.
type kvCounters struct {
	stored, removed, cleared atomic.Uint64 // events applied to the router
	cpu                      atomic.Uint64 // CPU-medium events, not routed on
	unknownParent            atomic.Uint64 // BlockStored the router could not place
}

// newKVState builds the shared index and registers the metrics.
func newKVState(reg prometheus.Registerer) (*kvState, error) {
	k := &kvState{
		index:   kvevents.NewIndex(),
		metrics: kvevents.NewMetrics(),
		applied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_kvevents_router_total",
			Help: "KV events applied to the router by replica and outcome: stored, removed, cleared, cpu_ignored (offloaded blocks, not routed on), unknown_parent (a stored chain the router could not place).",
		}, []string{"replica", "outcome"}),
	}
	if err := k.metrics.Register(reg); err != nil {
		return nil, err
	}
	if err := reg.Register(k.applied); err != nil {
		return nil, err
	}
	return k, nil
}

// addSubscriber sets up b's subscriber (started by Run).
func (p *Proxy) addSubscriber(b *backend, cfg Backend) error {
	replay, err := replayEndpoint(cfg)
	if err != nil {
		return err
	}
	b.kv = &kvCounters{}
	b.sub = kvevents.NewSubscriber(kvevents.SubscriberConfig{
		Replica:        b.name,
		Endpoint:       cfg.KVEvents,
		ReplayEndpoint: replay,
		Topic:          cfg.KVTopic,
		Index:          p.kv.index,
		Sink:           routerSink{p},
		Metrics:        p.kv.metrics,
		Logger:         p.log,
	})
	for _, o := range []string{"stored", "removed", "cleared", "cpu_ignored", "unknown_parent"} {
		p.kv.applied.WithLabelValues(b.name, o)
	}
	return nil
}

// runKV follows every replica's KV-event stream and expires the router's
// unconfirmed speculative entries, until ctx ends.
func (p *Proxy) runKV(ctx context.Context) {
	var wg sync.WaitGroup
	haveKV := false
	for _, b := range p.backends {
		if b.sub == nil {
			continue
		}
		haveKV = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := b.sub.Run(ctx); err != nil {
				p.log.Error("kv events subscriber", "replica", b.name, "err", err)
			}
		}()
	}
	if haveKV {
		// Route and CacheStored expire speculative entries too; this keeps an
		// idle router's view honest.
		p.rt.ExpireSpeculativeEvery(ctx, 500*time.Millisecond, &p.mu)
	}
	wg.Wait()
}

// routerSink applies one replica's router-key changes to the core, under
// the proxy's lock. Only GPU blocks count: a block offloaded to CPU memory
// is not a prefix-cache hit for routing (it is counted).
type routerSink struct{ p *Proxy }

var _ kvevents.Sink = routerSink{}

func (s routerSink) backend(name string) *backend {
	return s.p.byName[name]
}

// Stored implements kvevents.Sink.
func (s routerSink) Stored(replica string, parent blocks.Key, hasParent bool, keys []blocks.Key, medium string) {
	b := s.backend(replica)
	if b == nil {
		return
	}
	if medium != kvevents.MediumGPU {
		b.kv.cpu.Add(1)
		s.p.kv.applied.WithLabelValues(b.name, "cpu_ignored").Inc()
		return
	}
	now := time.Now()
	s.p.mu.Lock()
	err := s.p.rt.CacheStored(b.id, parent, hasParent, keys, now)
	s.p.mu.Unlock()
	switch {
	case err == nil:
		b.kv.stored.Add(1)
		s.p.kv.applied.WithLabelValues(b.name, "stored").Inc()
	case errors.Is(err, prefixtree.ErrUnknownParent):
		// The index holds the parent but the router's tree lost it (its
		// global bound evicted the chain): the blocks cannot be placed.
		b.kv.unknownParent.Add(1)
		s.p.kv.applied.WithLabelValues(b.name, "unknown_parent").Inc()
	default:
		s.p.log.Warn("kv events: router cache stored", "replica", b.name, "err", err)
	}
}

// Removed implements kvevents.Sink.
func (s routerSink) Removed(replica string, keys []blocks.Key, medium string) {
	b := s.backend(replica)
	if b == nil {
		return
	}
	if medium != kvevents.MediumGPU {
		b.kv.cpu.Add(1)
		s.p.kv.applied.WithLabelValues(b.name, "cpu_ignored").Inc()
		return
	}
	s.p.mu.Lock()
	err := s.p.rt.CacheRemoved(b.id, keys)
	s.p.mu.Unlock()
	if err != nil {
		s.p.log.Warn("kv events: router cache removed", "replica", b.name, "err", err)
		return
	}
	b.kv.removed.Add(1)
	s.p.kv.applied.WithLabelValues(b.name, "removed").Inc()
}

// Cleared implements kvevents.Sink.
func (s routerSink) Cleared(replica string) {
	b := s.backend(replica)
	if b == nil {
		return
	}
	s.p.mu.Lock()
	err := s.p.rt.CacheCleared(b.id)
	s.p.mu.Unlock()
	if err != nil {
		s.p.log.Warn("kv events: router cache cleared", "replica", b.name, "err", err)
		return
	}
	b.kv.cleared.Add(1)
	s.p.kv.applied.WithLabelValues(b.name, "cleared").Inc()
}

// CacheReplica is one replica in GET /debug/cache.
type CacheReplica struct {
	Replica string `json:"replica"`
	ID      int    `json:"id"`
	// KVEvents is false for a replica whose cache the router mirrors from
	// its own decisions.
	KVEvents bool   `json:"kv_events"`
	Endpoint string `json:"endpoint,omitempty"`
	// RouterCachedBlocks is the blocks the router's tree holds as cached on
	// the replica (speculative entries included).
	RouterCachedBlocks int `json:"router_cached_blocks"`
	// Stream is the subscriber's state: blocks held by medium (the
	// index), last seq, replays, gaps, restarts, events applied and
	// dropped. Absent without KV events.
	Stream *kvevents.Stats `json:"stream,omitempty"`
	// Router counts the events applied to the router.
	Router *CacheRouterCounts `json:"router,omitempty"`
}

// CacheRouterCounts count what a replica's events did to the router.
type CacheRouterCounts struct {
	Stored        uint64 `json:"stored"`
	Removed       uint64 `json:"removed"`
	Cleared       uint64 `json:"cleared"`
	CPUIgnored    uint64 `json:"cpu_ignored"`
	UnknownParent uint64 `json:"unknown_parent"`
}

// CacheView is the answer of GET /debug/cache.
type CacheView struct {
	// Speculative is the router's unconfirmed speculative blocks, all
	// replicas together.
	Speculative int            `json:"speculative_blocks"`
	Replicas    []CacheReplica `json:"replicas"`
}

// CacheView returns what GET /debug/cache shows.
func (p *Proxy) CacheView() CacheView {
	var v CacheView
	p.mu.Lock()
	p.rt.ExpireSpeculative(time.Now())
	v.Speculative = p.rt.Speculative()
	for _, b := range p.backends {
		v.Replicas = append(v.Replicas, CacheReplica{
			Replica: b.name, ID: b.id, KVEvents: b.sub != nil, Endpoint: p.cfg.Backends[b.id].KVEvents,
			RouterCachedBlocks: p.rt.Tree().CachedBlocks(b.id),
		})
	}
	p.mu.Unlock()
	for i, b := range p.backends {
		if b.sub == nil {
			continue
		}
		st := b.sub.Stats()
		v.Replicas[i].Stream = &st
		v.Replicas[i].Router = &CacheRouterCounts{
			Stored: b.kv.stored.Load(), Removed: b.kv.removed.Load(), Cleared: b.kv.cleared.Load(),
			CPUIgnored: b.kv.cpu.Load(), UnknownParent: b.kv.unknownParent.Load(),
		}
	}
	return v
}

// serveDebugCache answers GET /debug/cache: CacheView as JSON.
func (p *Proxy) serveDebugCache(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, p.CacheView())
}
