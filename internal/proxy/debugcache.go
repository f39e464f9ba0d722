package proxy

import (
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/kvevents"
)

// CacheReplica is one replica in GET /debug/cache.
type CacheReplica struct {
	Replica string `json:"replica"`
	ID      int    `json:"id"`
	// KVEvents is false for a replica whose cache the router mirrors from
	// its own decisions.
	KVEvents bool `json:"kv_events"`
	// Endpoint is where its events come from: the replica's socket, or
	// "listen:ENDPOINT" for one whose engine may dial the router's
	// listener (Config.KVEventsListen).
	Endpoint string `json:"endpoint,omitempty"`
	// RouterCachedBlocks is the blocks the router's tree holds as cached on
	// the replica (speculative entries included).
	RouterCachedBlocks int `json:"router_cached_blocks"`
	// RouterTierBlocks is the blocks the router holds as cached in the
	// replica's slower tiers (CPU, disk).
	RouterTierBlocks int `json:"router_tier_blocks"`
	// Stream is the subscriber's state: blocks held by medium (the
	// index), last seq, replays, gaps, restarts, events applied and
	// dropped. Absent without KV events.
	Stream *kvevents.Stats `json:"stream,omitempty"`
	// Router counts the events applied to the router.
	Router *CacheRouterCounts `json:"router,omitempty"`
}

// CacheRouterCounts count what a replica's events did to the router.
type CacheRouterCounts struct {
	Stored     uint64 `json:"stored"`
	Removed    uint64 `json:"removed"`
	Cleared    uint64 `json:"cleared"`
	CPUIgnored uint64 `json:"cpu_ignored"`
	// TierStored and TierRemoved count events of slower cache tiers (CPU,
	// disk), which the router prices at their load time.
	TierStored    uint64 `json:"tier_stored"`
	TierRemoved   uint64 `json:"tier_removed"`
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
	v := CacheView{Replicas: []CacheReplica{}}
	p.mu.Lock()
	p.rt.ExpireSpeculative(time.Now())
	v.Speculative = p.rt.Speculative()
	members := append([]*backend(nil), p.backendsLocked()...)
	for _, b := range members {
		// Events is the router's: a replica fed by the listener is
		// mirrored until its first batch arrives.
		cv, _ := p.rt.CacheView(b.ID)
		v.Replicas = append(v.Replicas, CacheReplica{
			Replica: b.Name, ID: b.ID, KVEvents: cv.Events, Endpoint: p.pool.StateOf(b.Member).KVEvents,
			RouterCachedBlocks: p.rt.Tree().CachedBlocks(b.ID), RouterTierBlocks: p.rt.TierBlocks(b.ID),
		})
	}
	p.mu.Unlock()
	for i, b := range members {
		st, ok := p.pool.KVStateOf(b.Member)
		if !ok {
			continue
		}
		v.Replicas[i].Stream = &st.Stream
		v.Replicas[i].Router = &CacheRouterCounts{Stored: st.Stored, Removed: st.Removed, Cleared: st.Cleared,
			CPUIgnored: st.CPUIgnored, UnknownParent: st.UnknownParent, TierStored: st.TierStored, TierRemoved: st.TierRemoved}
	}
	return v
}

// serveDebugCache answers GET /debug/cache: CacheView as JSON.
func (p *Proxy) serveDebugCache(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, p.CacheView())
}

// backendsLocked returns the replicas in the pool by router ID (Mu held):
// a scratch slice, valid until the next call.
func (p *Proxy) backendsLocked() []*backend {
	ms := p.pool.Members()
	p.scratch = p.scratch[:0]
	for _, m := range ms {
		p.scratch = append(p.scratch, m.Front.(*backend))
	}
	return p.scratch
}
