package epp

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/router"
)

// detectRetry is how soon a replica that did not answer its detection is
// tried again when there is no ScrapeInterval to follow.
const detectRetry = 5 * time.Second

// The backend kind of each replica (Config.BackendKind), as prefixlb serve
// keeps it: with "auto" it is detected (proxy.DetectBackend: the metric
// names of MetricsURL, then GET /props, /v1/models and the Server header at
// "http://"+Address) when the replica joins and whenever it is ready again;
// with "llamacpp" only its slot count is read then. The router models a
// llama.cpp replica's cache as its slots (router.SetCacheSlots), any other
// as a block cache; the tokenizer check speaks the replica's /tokenize.

// markKindDue makes r due a detection, when its kind needs one, and wakes
// its loop (p.mu held).
func (p *Picker) markKindDue(r *replica) {
	if p.kind != upstream.Auto && p.kind != upstream.LlamaCpp {
		return
	}
	r.kindDue = true
	select {
	case r.kindWake <- struct{}{}:
	default:
	}
}

// detectLoop detects r's backend kind whenever it is due and r is ready:
// at once, when SetReady or a scrape wakes it, and at every retry tick
// while a detection got no answer. It is one of r's feeds.
func (p *Picker) detectLoop(ctx context.Context, r *replica) {
	retry := p.cfg.ScrapeInterval
	if retry <= 0 {
		retry = detectRetry
	}
	client := &http.Client{Timeout: p.cfg.ScrapeTimeout}
	t := time.NewTicker(retry)
	defer t.Stop()
	for {
		p.detect(ctx, client, r)
		select {
		case <-ctx.Done():
			return
		case <-r.kindWake:
		case <-t.C:
		}
	}
}

// detect runs one detection of r if it is due and ready, records the kind
// and gives the router its cache model. A replica that did not answer
// stays due.
func (p *Picker) detect(ctx context.Context, client *http.Client, r *replica) {
	p.mu.Lock()
	if p.byName[r.Name] != r || !r.kindDue || !r.Ready {
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()

	d, err := upstream.Detect(ctx, client, "http://"+r.Address, r.MetricsURL, p.kind)

	p.mu.Lock()
	if ctx.Err() != nil || p.byName[r.Name] != r { // stopping, or r left the pool
		p.mu.Unlock()
		return
	}
	if errors.Is(err, upstream.ErrNoAnswer) {
		p.mu.Unlock()
		p.log.Debug("epp: backend kind: no answer; trying again later", "replica", r.Name, "err", err)
		return
	}
	slots := 0
	if d.Kind == upstream.LlamaCpp {
		slots = d.Slots
	}
	old, oldSlots := r.kind, r.slots
	r.kind, r.slots, r.kindDue = d.Kind, slots, false
	serr := p.rt.SetCacheSlots(r.id, slots)
	if old != d.Kind && p.tok != nil {
		p.markTokenizerDue(r) // the check speaks the engine's /tokenize
	} else if r.tokDue {
		select { // a check that waited for the kind may run now
		case r.tokWake <- struct{}{}:
		default:
		}
	}
	hook := p.onDetect
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("epp: backend kind", "replica", r.Name, "err", err)
	}
	if serr != nil {
		p.log.Error("epp: router cache slots", "replica", r.Name, "slots", slots, "err", serr)
	}
	if old != d.Kind || oldSlots != slots {
		p.log.Info("epp: replica backend kind", "replica", r.Name, "kind", d.Kind, "via", d.Via, "slots", slots)
	}
	if d.Kind == upstream.LlamaCpp && slots == 0 {
		p.log.Warn("epp: llama.cpp replica did not say its slot count (GET /props total_slots, GET /slots): its cache is mirrored as a block cache",
			"replica", r.Name)
	}
	if hook != nil {
		hook(r.Name, d)
	}
}

// initKind sets a replica's kind as configured when it joins (p.mu held):
// vLLM and SGLang are known at once, auto and llama.cpp are due a
// detection.
func (p *Picker) initKind(r *replica) {
	r.kvTokens = -1
	switch p.kind {
	case upstream.Auto:
		r.kind = upstream.Unknown
	default:
		r.kind = p.kind
	}
	_ = p.rt.SetCacheSlots(r.id, 0) // a reused router slot may have had a slot cache
	p.markKindDue(r)
}

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
	for _, r := range p.byName {
		st, _ := p.rt.Replica(r.id)
		ext := p.rt.ExternalLoad(r.id).InFlight
		v, _ := p.rt.CacheView(r.id)
		out = append(out, ReplicaView{
			Name: r.Name, Address: r.Address, Ready: r.Ready, InFlight: st.InFlight - ext, External: ext,
			Kind: r.kind, Slots: r.slots, Waiting: st.Waiting, Running: st.Running, KVUsage: st.KVUsage,
			KVTokens: r.kvTokens, Cache: v, Pricing: p.rt.Pricing(r.id, true),
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
