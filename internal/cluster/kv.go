package cluster

import (
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// What a KV event did to the router, as the outcome label of
// prefixlb_kvevents_router_total.
const (
	OutcomeStored        = "stored"
	OutcomeRemoved       = "removed"
	OutcomeCleared       = "cleared"
	OutcomeCPUIgnored    = "cpu_ignored"
	OutcomeUnknownParent = "unknown_parent"
	OutcomeTierStored    = "tier_stored"
	OutcomeTierRemoved   = "tier_removed"
)

// Outcomes lists every outcome label, for metrics that start at zero.
var Outcomes = []string{OutcomeStored, OutcomeRemoved, OutcomeCleared, OutcomeCPUIgnored, OutcomeUnknownParent,
	OutcomeTierStored, OutcomeTierRemoved}

// KV is a front door's side of the replicas' KV-event streams: one index
// for all replicas (kvevents.Index, each replica with its own lock), the
// streams' metrics, and the count of what the events did to the router.
type KV struct {
	Index   *kvevents.Index
	Metrics *kvevents.Metrics
	// Applied counts events by replica and outcome.
	Applied *prometheus.CounterVec
}

// NewKV builds the index and registers the metrics on reg.
func NewKV(reg prometheus.Registerer) (*KV, error) {
	k := &KV{
		Index:   kvevents.NewIndex(),
		Metrics: kvevents.NewMetrics(),
		Applied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_kvevents_router_total",
			Help: "KV events applied to the router by replica and outcome: stored, removed, cleared (GPU blocks), tier_stored and tier_removed (blocks of a slower tier, CPU or disk, priced at their load time), cpu_ignored (a slower tier's blocks with tiers off), unknown_parent (a stored chain the router could not place).",
		}, []string{"replica", "outcome"}),
	}
	if err := k.Metrics.Register(reg); err != nil {
		return nil, err
	}
	if err := reg.Register(k.Applied); err != nil {
		return nil, err
	}
	return k, nil
}

// Sink applies the router-key changes of the replicas' KV events to a
// Core, under its lock. GPU blocks go to the prefix tree; blocks of a
// slower tier (another medium: CPU, disk) to the replica's tier set
// (router.CacheStoredTier), where a policy prices them at their load time,
// or, with IgnoreTiers, nowhere (counted cpu_ignored). Events of a replica
// ID does not know are dropped.
type Sink struct {
	Core *Core
	KV   *KV
	// IgnoreTiers drops the blocks of slower tiers, as prefixlb did before
	// it priced them (the tier-blind baseline).
	IgnoreTiers bool
	// ID returns the router ID of the replica called name, or -1; it is
	// called with Core.Mu held.
	ID func(name string) int
	// Applied, when set, is called with Core.Mu held after each event with
	// its outcome (serve counts them per replica for /debug/cache; tests
	// wait on it).
	Applied func(name, outcome string)
	// Log receives the router's refusals (nil: slog.Default()).
	Log *slog.Logger
}

var _ kvevents.Sink = (*Sink)(nil)

// Stored implements kvevents.Sink.
func (s *Sink) Stored(name string, parent blocks.Key, hasParent bool, keys []blocks.Key, medium string) {
	now := time.Now()
	s.Core.Mu.Lock()
	defer s.Core.Mu.Unlock()
	id, tier, ok := s.target(name, medium)
	if !ok {
		return
	}
	if tier {
		s.tierApplied(name, OutcomeTierStored, s.Core.Router.CacheStoredTier(id, medium, keys))
		return
	}
	err := s.Core.Router.CacheStored(id, parent, hasParent, keys, now)
	switch {
	case err == nil:
		s.applied(name, OutcomeStored)
	case errors.Is(err, prefixtree.ErrUnknownParent):
		// The index holds the parent but the router's tree lost it (its
		// global bound evicted the chain): the blocks cannot be placed.
		s.applied(name, OutcomeUnknownParent)
	default:
		s.log().Warn("kv events: router cache stored", "replica", name, "err", err)
	}
}

// Removed implements kvevents.Sink.
func (s *Sink) Removed(name string, keys []blocks.Key, medium string) {
	s.Core.Mu.Lock()
	defer s.Core.Mu.Unlock()
	id, tier, ok := s.target(name, medium)
	if !ok {
		return
	}
	if tier {
		s.tierApplied(name, OutcomeTierRemoved, s.Core.Router.CacheRemovedTier(id, medium, keys))
		return
	}
	if err := s.Core.Router.CacheRemoved(id, keys); err != nil {
		s.log().Warn("kv events: router cache removed", "replica", name, "err", err)
		return
	}
	s.applied(name, OutcomeRemoved)
}

// Cleared implements kvevents.Sink.
func (s *Sink) Cleared(name string) {
	s.Core.Mu.Lock()
	defer s.Core.Mu.Unlock()
	id := s.ID(name)
	if id < 0 {
		return
	}
	if err := s.Core.Router.CacheCleared(id); err != nil {
		s.log().Warn("kv events: router cache cleared", "replica", name, "err", err)
		return
	}
	s.applied(name, OutcomeCleared)
}

// target returns replica name's router ID for an event on medium (Core.Mu
// held), and whether the blocks are a slower tier's (not the GPU's); ok is
// false when there is nothing to apply: a replica ID does not know, or a
// slower tier's blocks with IgnoreTiers (counted as cpu_ignored).
func (s *Sink) target(name, medium string) (id int, tier, ok bool) {
	if id = s.ID(name); id < 0 {
		return id, false, false
	}
	if medium == kvevents.MediumGPU {
		return id, false, true
	}
	if s.IgnoreTiers {
		s.applied(name, OutcomeCPUIgnored)
		return id, true, false
	}
	return id, true, true
}

// tierApplied counts a slower tier's event, or logs the router's refusal.
func (s *Sink) tierApplied(name, outcome string, err error) {
	if err != nil {
		s.log().Warn("kv events: router cache tier", "replica", name, "outcome", outcome, "err", err)
		return
	}
	s.applied(name, outcome)
}

func (s *Sink) applied(name, outcome string) {
	s.KV.Applied.WithLabelValues(name, outcome).Inc()
	if s.Applied != nil {
		s.Applied(name, outcome)
	}
}

func (s *Sink) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}
