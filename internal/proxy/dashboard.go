package proxy

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/dashboard"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
	"github.com/prefixlb/prefixlb/internal/router"
)

// Sizes of what the proxy keeps for the dashboard (/ui).
const (
	// dashRingSize is how many recent decisions the proxy keeps: the
	// dashboard's branch rates and recent list come from them.
	dashRingSize = 1024
	// dashRecent is how many of them a snapshot lists.
	dashRecent = 25
	// dashPrefixes is how many hottest prefixes a snapshot lists.
	dashPrefixes = 16
	// dashRateWindow is the span the branch rates are measured over (or
	// the ring's span, when it is shorter at high rates).
	dashRateWindow = 10 * time.Second
)

// dashEntry is one committed decision as the dashboard shows it.
type dashEntry struct {
	at     time.Time
	prompt int
	d      policy.Decision // Candidates is the policy's own fresh slice: never changed after Route
}

// dashRing is a bounded ring of the latest decisions, under its own lock:
// route records a decision after releasing the core's, and Snapshot reads
// the ring while holding both (the core's first). record costs one copy of
// a Decision and allocates nothing.
type dashRing struct {
	mu    sync.Mutex // guards the rest
	buf   [dashRingSize]dashEntry
	n     int // entries ever recorded
	first time.Time
}

// record keeps d, made at now for a prompt of prompt tokens.
func (g *dashRing) record(now time.Time, prompt int, d *policy.Decision) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n == 0 {
		g.first = now
	}
	g.buf[g.n%dashRingSize] = dashEntry{at: now, prompt: prompt, d: *d}
	g.n++
}

// each calls fn on the kept entries, newest first, until fn returns false.
// Call it under g.mu.
func (g *dashRing) each(fn func(e *dashEntry) bool) {
	for i := g.n - 1; i >= 0 && i >= g.n-dashRingSize; i-- {
		if !fn(&g.buf[i%dashRingSize]) {
			return
		}
	}
}

var _ dashboard.Source = (*Proxy)(nil)

// dashboardHandler serves the dashboard (/ui, /ui/, /ui/state.json), behind
// the admin token when one is configured. A browser cannot send a bearer
// header when it opens a page, so the token may also come as ?token=...;
// the page then sends it to state.json as a header.
func (p *Proxy) dashboardHandler() http.Handler {
	guarded := p.admin(dashboard.Handler(p).ServeHTTP)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok := r.URL.Query().Get("token"); tok != "" && r.Header.Get("Authorization") == "" {
			r = r.Clone(r.Context())
			r.Header.Set("Authorization", "Bearer "+tok)
		}
		guarded(w, r)
	})
}

// hotPrefix is a prefix unit copied out of the tree under the lock.
type hotPrefix struct {
	id               string
	tokens, requests int
	assigned, cached []int
}

// Snapshot implements dashboard.Source: it copies the router's state under
// p.mu (no I/O, no encoding) and formats it after releasing the lock.
func (p *Proxy) Snapshot() dashboard.Snapshot {
	now := time.Now()
	var (
		hot      []hotPrefix
		recent   = make([]dashEntry, 0, dashRecent)
		branches []branchCount // few: a slice beats a map under the lock
		hits     []struct{ matched, prompt int }
		inRate   int
		oldest   time.Time
	)
	p.mu.Lock()
	reps := p.rt.Replicas()
	names := make([]string, len(reps)) // "": a slot no replica holds now
	up := make([]bool, len(reps))
	kinds := make([]upstream.Kind, len(reps))
	roles := make([]string, len(reps))
	for _, b := range p.backendsLocked() {
		names[b.ID], up[b.ID], kinds[b.ID], roles[b.ID] = b.Name, b.Up(), b.Kind(), b.PDRole().String()
	}
	stats := p.rt.Stats()
	inflight := p.rt.InFlight()
	tree := p.rt.Tree()
	bt := tree.BlockTokens()
	cachedBlocks := make([]int, len(reps))
	views := make([]router.CacheView, len(reps))
	speeds := make([]router.Pricing, len(reps))
	for i := range reps {
		cachedBlocks[i] = tree.CachedBlocks(i)
		views[i], _ = p.rt.CacheView(i)
		speeds[i] = p.rt.Pricing(i, false)
	}
	e2, _ := p.rt.Policy().(*policy.E2)
	window := make([][2]float64, len(reps)) // load, hit ratio
	var e2Window time.Duration
	if e2 != nil {
		for i := range reps {
			window[i][0], window[i][1] = e2.Window(i)
		}
		e2Window = e2.Config().Window
		e2.Prefixes(func(n *prefixtree.Node, count int) {
			hot = keepHot(hot, n, count, len(reps), bt)
		})
	} else {
		hits = make([]struct{ matched, prompt int }, len(reps))
	}
	cut := now.Add(-dashRateWindow)
	p.dash.mu.Lock()
	first := p.dash.first
	p.dash.each(func(e *dashEntry) bool {
		if len(recent) < dashRecent {
			recent = append(recent, *e)
		}
		if !e.at.Before(cut) {
			branches = countBranch(branches, e.d.Branch)
			inRate++
			oldest = e.at
		}
		if hits != nil && e.d.Replica >= 0 && e.d.Replica < len(hits) {
			hits[e.d.Replica].matched += e.d.MatchedTokens
			hits[e.d.Replica].prompt += e.prompt
		}
		return len(recent) < dashRecent || !e.at.Before(cut) || hits != nil
	})
	ringFull := p.dash.n >= dashRingSize
	p.dash.mu.Unlock()
	var queue *cluster.GateState
	if p.gate != nil {
		st := p.gate.StateLocked()
		queue = &st
	}
	p.mu.Unlock()

	s := dashboard.Snapshot{Time: now, Policy: p.policy, Branches: map[string]float64{}, Queue: dashQueue(queue, now)}
	for i, rp := range reps {
		if names[i] == "" {
			continue
		}
		r := dashboard.Replica{
			Name: names[i], Up: up[i], InFlight: rp.InFlight, Waiting: rp.Waiting, Running: rp.Running,
			KVUsage: rp.KVUsage, LoadSeconds: window[i][0], HitRatio: window[i][1],
			PendingPrefillS: rp.PendingPrefill.Seconds(), CachedBlocks: cachedBlocks[i],
			Kind: string(kinds[i]), Slots: views[i].Slots, Role: roles[i], Transfers: rp.Transfers, PredictionErrorTokens: views[i].ErrorTokens,
			CapacityTokens: views[i].CapacityTokens, Corrections: views[i].Corrections,
		}
		fillSpeed(&r, &speeds[i])
		if hits != nil && hits[i].prompt > 0 {
			r.HitRatio = float64(hits[i].matched) / float64(hits[i].prompt)
		}
		s.Replicas = append(s.Replicas, r)
	}
	// Rates over the window, or over what the ring holds when it wrapped
	// inside the window.
	span := dashRateWindow
	if ringFull && inRate >= dashRingSize {
		span = now.Sub(oldest)
	} else if !first.IsZero() && now.Sub(first) < span {
		span = now.Sub(first)
	}
	span = max(span, time.Second)
	s.RateWindowS = span.Seconds()
	for _, b := range branches {
		s.Branches[b.name] += float64(b.n) / span.Seconds()
		s.DecisionsPerS += float64(b.n) / span.Seconds()
	}
	// Prefix rates over E2's window, or the time since the first decision.
	pspan := e2Window
	if !first.IsZero() && now.Sub(first) < pspan {
		pspan = now.Sub(first)
	}
	pspan = max(pspan, time.Second)
	for _, h := range hot {
		pr := dashboard.Prefix{ID: h.id, Tokens: h.tokens, Requests: h.requests,
			RequestsPerS: float64(h.requests) / pspan.Seconds()}
		for _, r := range h.assigned {
			pr.Assigned = append(pr.Assigned, names[r])
		}
		for _, r := range h.cached {
			pr.CachedOn = append(pr.CachedOn, names[r])
		}
		s.Prefixes = append(s.Prefixes, pr)
	}
	s.CachePrediction = dashboard.CachePrediction{
		PredictedTokens: stats.PredictedTokens, ReportedTokens: stats.ReportedTokens, Checked: stats.PredictionsChecked,
	}
	if stats.PredictionsChecked > 0 {
		s.CachePrediction.ExactRatio = float64(stats.PredictionsExact) / float64(stats.PredictionsChecked)
	}
	s.Totals = dashboard.Totals{Routed: stats.Routed, Finished: stats.Finished, Failed: stats.Failed, InFlight: inflight}
	for i := range recent {
		e := &recent[i]
		name := ""
		if e.d.Replica >= 0 && e.d.Replica < len(names) {
			name = names[e.d.Replica]
		}
		s.Recent = append(s.Recent, dashboard.Decision{Time: e.at, Replica: name, Branch: e.d.Branch,
			MatchedTokens: e.d.MatchedTokens, PromptTokens: e.prompt, Explain: e.d.Explain()})
	}
	return s
}

// fillSpeed sets r's profile and speed fields from sp.
func fillSpeed(r *dashboard.Replica, sp *router.Pricing) {
	f := &sp.Speed
	r.Profile, r.Calibrated = sp.Profile, sp.Calibrated
	r.PrefillSPer1K, r.ProfilePrefillSPer1K = f.PrefillSecondsPer1K, f.PriorPrefillSecondsPer1K
	r.DecodeStepS, r.ProfileDecodeStepS = f.DecodeStepSeconds, f.PriorDecodeStepSeconds
	if sp.Calibrated {
		r.PrefillError, r.DecodeError = f.PrefillError, f.DecodeError
		r.CalibrationSamples = f.PrefillSamples + f.DecodeSamples
	}
}

// branchCount counts the decisions of one branch.
type branchCount struct {
	name string
	n    int
}

// countBranch adds one decision of branch name to bs.
func countBranch(bs []branchCount, name string) []branchCount {
	for i := range bs {
		if bs[i].name == name {
			bs[i].n++
			return bs
		}
	}
	return append(bs, branchCount{name: name, n: 1})
}

// keepHot adds node n (count requests in the window) to hot, the at most
// dashPrefixes hottest so far, sorted by count (then ID) descending.
func keepHot(hot []hotPrefix, n *prefixtree.Node, count, replicas, blockTokens int) []hotPrefix {
	if len(hot) == dashPrefixes && count <= hot[len(hot)-1].requests {
		return hot
	}
	keys := n.Keys()
	if len(keys) == 0 {
		return hot
	}
	h := hotPrefix{id: fmt.Sprintf("%016x", uint64(keys[0])), tokens: (n.Depth() + n.Own()) * blockTokens, requests: count}
	n.Assigned.Each(func(r int) {
		if r < replicas {
			h.assigned = append(h.assigned, r)
		}
	})
	for r := range replicas {
		if n.Cached(r) {
			h.cached = append(h.cached, r)
		}
	}
	i, _ := slices.BinarySearchFunc(hot, h, func(a, b hotPrefix) int {
		if c := cmp.Compare(b.requests, a.requests); c != 0 {
			return c
		}
		return strings.Compare(a.id, b.id)
	})
	hot = slices.Insert(hot, i, h)
	if len(hot) > dashPrefixes {
		hot = hot[:dashPrefixes]
	}
	return hot
}

// dashQueue is the dashboard's view of the queue's state (nil: off).
func dashQueue(st *cluster.GateState, now time.Time) *dashboard.Queue {
	if st == nil {
		return nil
	}
	q := &dashboard.Queue{Saturated: st.Pool.Saturated, Waiting: st.Waiting, MinWaitS: st.Pool.MinWait.Seconds(),
		Flows: make([]dashboard.QueueFlow, 0, len(st.Flows)), Passed: st.Stats.Passed, Queued: st.Stats.Queued,
		Dispatched: st.Stats.Dispatched, Cancelled: st.Stats.Cancelled, Shed: st.Shed}
	for _, f := range st.Flows {
		q.Flows = append(q.Flows, dashboard.QueueFlow{Priority: f.Priority, Tenant: f.Tenant, Waiting: f.Waiting,
			OldestWaitS: max(now.Sub(f.Oldest), 0).Seconds()})
	}
	return q
}
