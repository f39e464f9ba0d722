package policy

import (
	"math"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// e2Adapter is E2's placement of one LoRA adapter: the replicas assigned to
// it and its load, as Preble's E2 keeps an assigned set and windowed load for
// a hot prefix (Srivatsa et al., ICLR 2025, §3.2; ALGORITHMS §2–4), applied
// to adapters. Counts and GPU-seconds decay exponentially with time constant
// E2Config.Window, from the requests' times only (no clock): at time t a
// figure last updated at t0 is worth exp(−(t−t0)/Window) of itself, so a
// decayed count is about the adapter's requests in the last window.
type e2Adapter struct {
	set  prefixtree.Set // assigned replicas
	at   int64          // ns of the last decay
	work float64        // decayed GPU-seconds routed for the adapter
	per  []e2AdapterReplica
}

// e2AdapterReplica is one adapter's decayed figures on one replica.
type e2AdapterReplica struct {
	count float64 // requests routed there
	work  float64 // their GPU-seconds (prefill + expected decode)
}

// decayFactor is exp(−Δ/Window) for Δ = ns − at (1 when Δ ≤ 0: times out of
// order do not grow a figure).
func (p *E2) decayFactor(at, ns int64) float64 {
	if ns <= at {
		return 1
	}
	return math.Exp(-float64(ns-at) / float64(p.cfg.Window))
}

// adapterState returns adapter a's placement decayed to ns, creating it
// when create is set (nil otherwise for an adapter never routed).
func (p *E2) adapterState(a string, ns int64, create bool) *e2Adapter {
	st := p.adapters[a]
	if st == nil {
		if !create {
			return nil
		}
		if p.adapters == nil {
			p.adapters = make(map[string]*e2Adapter)
		}
		st = &e2Adapter{at: ns}
		p.adapters[a] = st
		p.adapterList = append(p.adapterList, st) // placedWork's order: first routed first
	}
	if f := p.decayFactor(st.at, ns); f != 1 {
		st.work *= f
		for i := range st.per {
			st.per[i].count *= f
			st.per[i].work *= f
		}
		st.at = ns
	}
	return st
}

// adapterVictim is the adapter a load on rp would evict: vLLM's LRU among
// the slots no running request uses (Replica.Adapters lists the most
// recently used first); "" when every held adapter runs.
func adapterVictim(rp *Replica) string {
	for i := len(rp.Adapters) - 1; i >= 0; i-- {
		if b := rp.Adapters[i]; !containsString(rp.RunningAdapters, b) {
			return b
		}
	}
	return ""
}

func containsString(s []string, x string) bool {
	for _, y := range s {
		if y == x {
			return true
		}
	}
	return false
}

// adapterCascadeTerm is what loading this request's adapter a on r costs
// the adapter placed there that the load evicts (prefixlb's extension of M).
// When r lacks a and its max_loras slots are full, the load evicts b, the
// LRU idle adapter (adapterVictim). If r is in b's assigned set, b's
// requests keep coming to r and each reloads it while a displaces it: b's
// expected reload rate there, λ_b(r), times the load time, over the window
// the placement holds for:
//
//	adapter_cascade = w · n_b(r) · T_load(r)   if r lacks a, slots full, r ∈ set(b)
//
// n_b(r) = λ_b(r)·Window is b's requests routed to r in the last window
// (decayed). adapter_eviction already prices one reload of b; this term
// prices the rest. 0 for the base model, where r holds a, a slot is free or
// every held adapter runs (adapter_wait prices that), and when b is not
// placed on r (a stray copy: evicting it costs one reload at most). So a
// request for a goes where a is held, and a load goes to a replica whose
// evicted adapter is cold or stray, unless another replica is cheaper by
// more than the cascade; every adapter's set is protected by the same price.
// The term is priced inside a's set too (a member that lost a evicts as
// much): with the exemption for a's own set the target run's TTFT p90 was
// 31.7 / 37.3 ms at rates 12 / 20 instead of 24.8 / 34.7 (docs/lora.md).
func (p *E2) adapterCascadeTerm(w float64, r int, req *Request, v *View) float64 {
	rp := &v.Replicas[r]
	a := req.Adapter
	if w <= 0 || a == "" || !rp.AdapterSlotsFull() || rp.HoldsAdapter(a) {
		return 0
	}
	b := adapterVictim(rp)
	if b == "" {
		return 0
	}
	sb := p.adapters[b]
	if sb == nil || !sb.set.Has(r) || r >= len(sb.per) {
		return 0
	}
	n := sb.per[r].count * p.decayFactor(sb.at, p.nowNS)
	return w * n * secs(costmodel.AdapterLoadOf(v.ProfileOf(r)).Time(rp.AdapterBytes))
}

// adapterTarget is the number of replicas adapter st's load calls for: its
// share of the windowed GPU-seconds of every request routed (base model's
// included) times the replicas up, rounded up, at least 1 — as many
// replicas as its work would fill at the cluster's mean load per replica.
func (p *E2) adapterTarget(st *e2Adapter, up int) float64 {
	if p.adapterWork <= 0 || up <= 0 {
		return 1
	}
	return math.Max(st.work/p.adapterWork*float64(up), 0)
}

// placeAdapter updates adapter a's placement after a request for it was
// routed to r at ns with GPU-seconds work: r joins its set (the cost chose
// it, as E2 assigns a prefix to the replica it routes it to), the set grows
// to the target its load calls for (ceil of adapterTarget) by the up
// replica outside it with the least placed work, and shrinks, dropping the
// member with the least of a's work (never r), while it exceeds 1.5× that
// target (the margin keeps a set from flapping around a boundary).
func (p *E2) placeAdapter(a string, r int, work float64, v *View, ns int64) {
	if f := p.decayFactor(p.adapterAt, ns); f != 1 {
		p.adapterWork *= f
		p.adapterAt = ns
	}
	p.adapterWork += work
	if a == "" {
		return
	}
	st := p.adapterState(a, ns, true)
	if len(st.per) < len(v.Replicas) {
		st.per = append(st.per, make([]e2AdapterReplica, len(v.Replicas)-len(st.per))...)
	}
	st.work += work
	st.per[r].count++
	st.per[r].work += work
	st.set.Add(r)
	x := p.adapterTarget(st, v.Up())
	want := max(int(math.Ceil(x-1e-9)), 1)
	for p.upIn(&st.set, v) < want {
		best, bestLoad := -1, math.Inf(1)
		for q := range v.Replicas {
			if !v.Replicas[q].Up || st.set.Has(q) {
				continue
			}
			if l := p.placedWork(q, ns); l < bestLoad {
				best, bestLoad = q, l
			}
		}
		if best < 0 {
			break
		}
		st.set.Add(best)
	}
	limit := max(int(math.Ceil(1.5*x-1e-9)), 1)
	for st.set.Len() > limit {
		worst, worstWork := -1, math.Inf(1)
		st.set.Each(func(q int) {
			if q == r {
				return
			}
			wq := 0.0
			if q < len(st.per) {
				wq = st.per[q].work
			}
			if q >= len(v.Replicas) || !v.Replicas[q].Up {
				wq = -1 // a replica that is down goes first
			}
			if wq < worstWork {
				worst, worstWork = q, wq
			}
		})
		if worst < 0 {
			break
		}
		st.set.Remove(worst)
	}
}

// upIn counts the up replicas of set.
func (p *E2) upIn(set *prefixtree.Set, v *View) int {
	n := 0
	set.Each(func(q int) {
		if q < len(v.Replicas) && v.Replicas[q].Up {
			n++
		}
	})
	return n
}

// placedWork is the decayed work of the adapters assigned to replica q,
// each counted at its share per member of its set.
func (p *E2) placedWork(q int, ns int64) float64 {
	l := 0.0
	for _, st := range p.adapterList { // not the map: a sum in a fixed order
		if st.set.Has(q) {
			l += st.work * p.decayFactor(st.at, ns) / float64(max(st.set.Len(), 1))
		}
	}
	return l
}

// AdapterSet returns the replicas assigned to LoRA adapter a, in ID order
// (nil when a was never routed): E2's adapter placement, for reports and
// tests.
func (p *E2) AdapterSet(a string) []int {
	st := p.adapters[a]
	if st == nil {
		return nil
	}
	var out []int
	st.set.Each(func(r int) { out = append(out, r) })
	return out
}
