package epp

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"

	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// ReplicaView is one replica in GET /debug/replicas: its state, backend
// kind and the router's view of its cache.
type ReplicaView struct {
	Name    string `json:"name"`
	Address string `json:"address"`
	Ready   bool   `json:"ready"`
	// InFlight counts this picker's requests on it; External the other
	// pickers' (shared state).
	InFlight int `json:"in_flight"`
	External int `json:"external"`
	// Kind is its backend kind (proxy.BackendUnknown until detected);
	// Slots its slot count for a slot cache (0: a block cache).
	Kind  upstream.Kind `json:"kind"`
	Slots int           `json:"slots"`
	// Waiting, Running and KVUsage are the engine's load as last scraped
	// (-1 unknown); KVTokens its KV-cache tokens (llama.cpp; -1 unknown).
	Waiting  int     `json:"waiting"`
	Running  int     `json:"running"`
	KVUsage  float64 `json:"kv_usage"`
	KVTokens int     `json:"kv_cache_tokens"`
	// KVCapacityTokens is its KV cache in tokens as the router prices it,
	// KVCapacitySource where it came from (the engine's metrics page or
	// server info, else "profile"), as serve's /debug/replicas says.
	KVCapacityTokens int    `json:"kv_capacity_tokens"`
	KVCapacitySource string `json:"kv_capacity_source"`
	// Cache is the router's view of its cache and how well it has matched
	// the replica's reports.
	Cache router.CacheView `json:"cache"`
	// Pricing is the replica's cost model, as prefixlb serve's
	// /debug/replicas gives it.
	router.Pricing
}

// ReplicaViews returns a snapshot of the known replicas with their kinds
// and cache views, by name.
func (p *Picker) ReplicaViews() []ReplicaView {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []ReplicaView
	for _, m := range p.pool.Members() {
		st, _ := p.rt.Replica(m.ID)
		own, ext := p.inflight(m)
		v, _ := p.rt.CacheView(m.ID)
		ps := p.pool.StateOf(m)
		out = append(out, ReplicaView{
			Name: m.Name, Address: m.Address, Ready: m.Up(), InFlight: own, External: ext,
			Kind: ps.Kind, Slots: ps.Slots, Waiting: st.Waiting, Running: st.Running, KVUsage: st.KVUsage,
			KVTokens: ps.KVTokens, KVCapacityTokens: ps.KVCapacity, KVCapacitySource: ps.KVCapacitySource, Cache: v, Pricing: p.rt.Pricing(m.ID, true),
		})
	}
	slices.SortFunc(out, func(a, b ReplicaView) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// DebugHandler serves GET /debug/replicas: the replicas as the picker sees
// them (ReplicaViews), as JSON. It says nothing that /metrics does not
// (names, addresses, counts), and is served next to it.
func (p *Picker) DebugHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/replicas", func(w http.ResponseWriter, r *http.Request) {
		b, err := json.Marshal(map[string]any{"policy": p.policy, "replicas": p.ReplicaViews()})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(append(b, '\n'))
	})
	return mux
}
