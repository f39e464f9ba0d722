package proxy

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/kvevents"
)

// kvCounters count what one replica's events did to the router.
type kvCounters struct {
	stored, removed, cleared atomic.Uint64 // events applied to the router
	cpu                      atomic.Uint64 // CPU-medium events, not routed on
	unknownParent            atomic.Uint64 // BlockStored the router could not place
}

// add counts one event's outcome (cluster.Sink's Applied).
func (k *kvCounters) add(outcome string) {
	switch outcome {
	case cluster.OutcomeStored:
		k.stored.Add(1)
	case cluster.OutcomeRemoved:
		k.removed.Add(1)
	case cluster.OutcomeCleared:
		k.cleared.Add(1)
	case cluster.OutcomeCPUIgnored:
		k.cpu.Add(1)
	case cluster.OutcomeUnknownParent:
		k.unknownParent.Add(1)
	}
}

// kvSink is the core's KV sink over the proxy's fixed set of backends.
func (p *Proxy) kvSink() *cluster.Sink {
	return &cluster.Sink{Core: p.core, KV: p.kv, Log: p.log,
		ID: func(name string) int {
			if b := p.byName[name]; b != nil && b.kv != nil {
				return b.id
			}
			return -1
		},
		Applied: func(name, outcome string) { p.byName[name].kv.add(outcome) },
	}
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
		Index:          p.kv.Index,
		Sink:           p.sink,
		Metrics:        p.kv.Metrics,
		Logger:         p.log,
	})
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
		p.core.ExpireSpeculative(ctx, 500*time.Millisecond)
	}
	wg.Wait()
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
