package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/pprof"
	"runtime"
	"sync"

	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// writeJSON answers v as JSON with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeErrorStatus(w, http.StatusInternalServerError, fmt.Errorf("proxy: encode response: %w", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// admin wraps h with the token check when AdminToken is set: the token
// as a bearer token, or in x-prefixlb-admin-token (trusted, explain.go),
// compared in constant time, length included (tokenMatches).
func (p *Proxy) admin(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if p.cfg.AdminToken != "" {
			if !p.trusted(r.Header) {
				writeError(w, fmt.Errorf("proxy: %s: %w", r.URL.Path, ErrUnauthorized))
				return
			}
		}
		h(w, r)
	}
}

// handlePprof serves Go's profiler (net/http/pprof) under /debug/pprof/ on
// mux, behind the admin token like the other /debug endpoints: the index,
// cpu (profile), trace, allocs, heap, goroutine, mutex, block, threadcreate,
// cmdline and symbol.
//
// The mutex and block profiles record nothing while their rates are 0, as
// serve leaves them: a delta request (?seconds=N) turns them on for its N
// seconds (mutexProfileFraction, blockProfileRate) and off again after.
func (p *Proxy) handlePprof(mux *http.ServeMux) {
	mux.HandleFunc("/debug/pprof/", p.admin(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/debug/pprof/mutex", "/debug/pprof/block":
			if r.FormValue("seconds") != "" {
				defer profileRates.on()()
			}
		}
		pprof.Index(w, r)
	}))
	mux.HandleFunc("/debug/pprof/cmdline", p.admin(pprof.Cmdline))
	mux.HandleFunc("/debug/pprof/profile", p.admin(pprof.Profile))
	mux.HandleFunc("/debug/pprof/symbol", p.admin(pprof.Symbol))
	mux.HandleFunc("/debug/pprof/trace", p.admin(pprof.Trace))
}

// The sampling of the mutex and block profiles while a delta profile of
// either is being taken: one contention event in mutexProfileFraction,
// and one blocking event per blockProfileRate nanoseconds blocked.
const (
	mutexProfileFraction = 10
	blockProfileRate     = 10000
)

// profileRates turns the mutex and block profiles on while at least one
// delta profile of them is being taken.
var profileRates rateUsers

type rateUsers struct {
	mu sync.Mutex
	n  int
}

// on turns the profiles on (the first user) and returns the function that
// turns them off (after the last).
func (u *rateUsers) on() func() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.n == 0 {
		runtime.SetMutexProfileFraction(mutexProfileFraction)
		runtime.SetBlockProfileRate(blockProfileRate)
	}
	u.n++
	return func() {
		u.mu.Lock()
		defer u.mu.Unlock()
		if u.n--; u.n == 0 {
			runtime.SetMutexProfileFraction(0)
			runtime.SetBlockProfileRate(0)
		}
	}
}

// serveHealth answers 200 when at least one replica is in routing, else 503.
func (p *Proxy) serveHealth(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	n, all := p.rt.UpCount(), p.pool.Len()
	p.mu.Unlock()
	status, word := http.StatusOK, "ok"
	if n == 0 {
		status, word = http.StatusServiceUnavailable, "no replica up"
	}
	writeJSON(w, status, map[string]any{"status": word, "replicas_up": n, "replicas": all})
}

// serveModels answers the union of the up replicas' /v1/models lists (each
// model once, by id, in replica order).
func (p *Proxy) serveModels(w http.ResponseWriter, r *http.Request) {
	data, err := p.models(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// models is the union of the up replicas' /v1/models lists, each model
// once by id, in replica order; an error when no replica answered.
func (p *Proxy) models(ctx context.Context) ([]json.RawMessage, error) {
	type answer struct {
		models []json.RawMessage
		err    error
	}
	p.mu.Lock()
	var up []*backend
	for _, b := range p.backendsLocked() {
		if b.Up() {
			up = append(up, b)
		}
	}
	p.mu.Unlock()
	answers := make([]answer, len(up))
	var wg sync.WaitGroup
	for i, b := range up {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i].err = p.get(ctx, b, "/v1/models", func(body io.Reader) error {
				var list struct {
					Data []json.RawMessage `json:"data"`
				}
				if err := json.NewDecoder(io.LimitReader(body, maxErrorBody)).Decode(&list); err != nil {
					return fmt.Errorf("decode model list: %w", err)
				}
				answers[i].models = list.Data
				return nil
			})
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	data := []json.RawMessage{}
	var errs []error
	answered := 0
	for _, a := range answers {
		if a.err != nil {
			errs = append(errs, a.err)
			continue
		}
		answered++
		for _, m := range a.models {
			var id struct {
				ID string `json:"id"`
			}
			if json.Unmarshal(m, &id) != nil || id.ID == "" || seen[id.ID] {
				continue
			}
			seen[id.ID] = true
			data = append(data, m)
		}
	}
	if answered == 0 {
		err := fmt.Errorf("proxy: list models: %w", policy.ErrNoReplica)
		if len(errs) > 0 {
			err = fmt.Errorf("proxy: list models: %w: %w", ErrUpstream, errors.Join(errs...))
		}
		return nil, err
	}
	return data, nil
}

// RouteExplanation is POST /debug/route's answer: the decision the policy
// would make for a request body now, without forwarding or committing it.
type RouteExplanation struct {
	Replica       string               `json:"replica"`
	ReplicaID     int                  `json:"replica_id"`
	Policy        string               `json:"policy"`
	Branch        string               `json:"branch"`
	MatchedTokens int                  `json:"matched_tokens"`
	PromptTokens  int                  `json:"prompt_tokens"`
	Keys          int                  `json:"keys"`
	Candidates    []CandidateExplained `json:"candidates"`
	Explain       string               `json:"explain"`
	// ExplainTerms is e2's cost of each candidate term by term
	// (policy.Decision.ExplainTerms; each candidate's terms too), as
	// prefixlb epp --explain sends it in x-prefixlb-route-terms.
	ExplainTerms string `json:"explain_terms,omitempty"`
}

// CandidateExplained is one candidate of a RouteExplanation, with its name.
type CandidateExplained struct {
	Name string `json:"name"`
	policy.Candidate
}

// serveDebugRoute answers the decision for the request body (a completions
// body, or a chat body when it has "messages").
func (p *Proxy) serveDebugRoute(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r, p.cfg.MaxBodyBytes)
	if err != nil {
		writeError(w, err)
		return
	}
	kind := openai.KindCompletion
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	if json.Unmarshal(body, &probe) == nil && probe.Messages != nil {
		kind = openai.KindChat
	}
	req, err := openai.ParseRequest(kind, body)
	if err != nil {
		writeError(w, err)
		return
	}
	id, err := p.tenants.Identify(r.Header.Get, r.RemoteAddr)
	if err != nil {
		writeError(w, fmt.Errorf("proxy: %w: %w", ErrUnauthorized, err))
		return
	}
	if _, err := p.isolate(req, body, id.Tenant); err != nil { // keyed as serving it would key it
		writeError(w, err)
		return
	}
	keys, tokens, err := p.pool.Key(req)
	if err != nil {
		writeError(w, fmt.Errorf("proxy: %w", err))
		return
	}
	preq := policy.Request{ID: p.nextID.Add(1), Keys: keys, PromptTokens: tokens, Estimated: req.TokensEstimated, OutputTokens: req.MaxTokens,
		Session: r.Header.Get(HeaderSession), Explain: true, Adapter: req.Adapter}
	if preq.Session == "" {
		preq.Session = req.User
	}
	d, err := p.predict(preq)
	if err != nil {
		writeError(w, fmt.Errorf("proxy: route: %w", err))
		return
	}
	names := p.names()
	out := RouteExplanation{
		Replica: names[d.Replica], ReplicaID: d.Replica, Policy: p.policy,
		Branch: d.Branch, MatchedTokens: d.MatchedTokens, PromptTokens: tokens, Keys: len(keys),
		Candidates: []CandidateExplained{}, Explain: d.Explain(), ExplainTerms: d.ExplainTerms(),
	}
	for _, c := range d.Candidates {
		name := ""
		if c.Replica >= 0 && c.Replica < len(names) {
			name = names[c.Replica]
		}
		out.Candidates = append(out.Candidates, CandidateExplained{Name: name, Candidate: c})
	}
	writeJSON(w, http.StatusOK, out)
}

// ReplicaStatus is one replica in GET /debug/replicas.
type ReplicaStatus struct {
	Name     string  `json:"name"`
	URL      string  `json:"url"`
	Up       bool    `json:"up"`
	InFlight int     `json:"in_flight"`
	Waiting  int     `json:"waiting"`
	Running  int     `json:"running"`
	KVUsage  float64 `json:"kv_usage"`
	// KVTokens is the engine's KV-cache tokens as last scraped (llama.cpp;
	// -1 unknown).
	KVTokens int `json:"kv_cache_tokens"`
	// KVCapacityTokens is the replica's KV cache in tokens as the router
	// prices it, KVCapacitySource where it came from: the engine
	// (engine:vllm-metrics, engine:sglang-metrics,
	// engine:sglang-server-info, engine:llamacpp-props,
	// engine:llamacpp-slots) or, when it did not say, "profile".
	KVCapacityTokens int    `json:"kv_capacity_tokens"`
	KVCapacitySource string `json:"kv_capacity_source"`
	// Kind is the replica's backend kind (BackendUnknown until detected);
	// Slots a slot cache's slot count (0: a block cache).
	Kind  upstream.Kind `json:"kind"`
	Slots int           `json:"slots"`
	// KVEvents is where the replica's KV events come from: its socket,
	// "listen:ENDPOINT" for one whose engine may dial the router's
	// listener (Config.KVEventsListen), "" for none. Cache.Events says
	// whether the router takes its cache from them yet.
	KVEvents string `json:"kv_events,omitempty"`
	// Cache is the router's view of the replica's cache and how well it
	// has matched the replica's reports.
	Cache router.CacheView `json:"cache"`
	// Pricing is the replica's cost model: profile, calibrated, speed and
	// calibration.
	router.Pricing
}

// serveDebugReplicas answers the replicas' state as the router sees it.
func (p *Proxy) serveDebugReplicas(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"policy": p.policy, "keying": p.pool.Keying(), "replicas": p.Replicas()})
}

// Replicas returns a snapshot of the replicas as the router sees them, by
// router ID.
func (p *Proxy) Replicas() []ReplicaStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []ReplicaStatus
	for _, b := range p.backendsLocked() {
		rp, _ := p.rt.Replica(b.ID)
		v, _ := p.rt.CacheView(b.ID)
		st := p.pool.StateOf(b.Member)
		out = append(out, ReplicaStatus{Name: b.Name, URL: st.URL, Up: b.Up(), InFlight: rp.InFlight,
			Waiting: rp.Waiting, Running: rp.Running, KVUsage: rp.KVUsage, KVTokens: st.KVTokens,
			KVCapacityTokens: st.KVCapacity, KVCapacitySource: st.KVCapacitySource, Kind: st.Kind, Slots: st.Slots, KVEvents: st.KVEvents, Cache: v, Pricing: p.rt.Pricing(b.ID, true)})
	}
	return out
}

// names returns each router ID's replica name ("" for a slot no replica
// holds now).
func (p *Proxy) names() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, len(p.rt.Replicas()))
	for _, b := range p.backendsLocked() {
		out[b.ID] = b.Name
	}
	return out
}
