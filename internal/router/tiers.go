package router

import (
	"fmt"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// Cache tiers. An engine that offloads KV (vLLM's CPU offloading, LMCache's
// CPU and disk) reports the blocks it keeps off the GPU in KV events whose
// medium is not GPU. The router keeps them apart from its prefix tree, which
// holds GPU blocks only: per replica, the keys each slower tier holds. A
// block held only there is neither a hit (free) nor a miss (a recompute): it
// costs its load, its tokens' KV bytes over the tier's bandwidth
// (costmodel.TierBandwidth), which E2 prices in P (View.TierHit).

// tierSet is one replica's offloaded blocks: key → the tier holding it.
type tierSet map[blocks.Key]uint8

// tierIndex returns medium's index in r.tierNames, adding it.
func (r *Router) tierIndex(medium string) uint8 {
	for i, n := range r.tierNames {
		if n == medium {
			return uint8(i)
		}
	}
	r.tierNames = append(r.tierNames, medium)
	return uint8(len(r.tierNames) - 1)
}

// CacheStoredTier records that replica id holds keys in the slower tier
// medium ("CPU", "DISK", or an engine's own name; never "GPU": those go to
// CacheStored).
func (r *Router) CacheStoredTier(id int, medium string, keys []blocks.Key) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if len(r.tierNames) >= 255 {
		return fmt.Errorf("router: too many cache tiers (%v)", r.tierNames)
	}
	for len(r.tiers) <= id {
		r.tiers = append(r.tiers, nil)
	}
	if r.tiers[id] == nil {
		r.tiers[id] = make(tierSet)
	}
	t := r.tierIndex(medium)
	for _, k := range keys {
		r.tiers[id][k] = t
	}
	return nil
}

// CacheRemovedTier records that replica id dropped keys from tier medium.
func (r *Router) CacheRemovedTier(id int, medium string, keys []blocks.Key) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if id >= len(r.tiers) || r.tiers[id] == nil {
		return nil
	}
	t := r.tierIndex(medium)
	for _, k := range keys {
		if cur, ok := r.tiers[id][k]; ok && cur == t {
			delete(r.tiers[id], k)
		}
	}
	return nil
}

// TierBlocks is how many blocks replica id holds in slower tiers.
func (r *Router) TierBlocks(id int) int {
	if id < 0 || id >= len(r.tiers) {
		return 0
	}
	return len(r.tiers[id])
}

// TierPrefix is how many leading keys of a chain replica id holds in its
// slower tiers (a test's and a debug view's question; routing walks the
// tiers after the GPU match, tierWalk).
func (r *Router) TierPrefix(id int, keys []blocks.Key) int {
	if id < 0 || id >= len(r.tiers) {
		return 0
	}
	for n, k := range keys {
		if _, ok := r.tiers[id][k]; !ok {
			return n
		}
	}
	return len(keys)
}

// clearTiers forgets replica id's offloaded blocks (AllBlocksCleared, or
// another replica in its slot).
func (r *Router) clearTiers(id int) {
	if id < len(r.tiers) {
		r.tiers[id] = nil
	}
}

// tierHit is View.TierHit: how many prompt tokens after the gpu tokens
// replica rep caches on its GPU it holds, block after block, in slower
// tiers, and the seconds loading them takes. A profile that does not know
// its KV bytes per token (a fitted one) credits nothing: the blocks are
// priced as a recompute.
func (r *Router) tierHit(rep int, req *policy.Request, gpu int) (int, float64) {
	if rep >= len(r.tiers) || len(r.tiers[rep]) == 0 {
		return 0, 0
	}
	prof := r.view.ProfileOf(rep)
	perToken := costmodel.KVBytesOf(prof)
	if perToken <= 0 {
		return 0, 0
	}
	tokens, seconds := 0, 0.0
	r.tierWalk(rep, req, gpu, func(tier uint8, n int) {
		tokens += n
		seconds += float64(n) * perToken / costmodel.TierBandwidth(prof, r.tierNames[tier])
	})
	return tokens, seconds
}

// tierSplit is View.TierSplit: tierHit's tokens, split into those in host
// memory (costmodel.MediumCPU) and those in other tiers.
func (r *Router) tierSplit(rep int, req *policy.Request, gpu int) (host, other int) {
	if rep >= len(r.tiers) || len(r.tiers[rep]) == 0 {
		return 0, 0
	}
	r.tierWalk(rep, req, gpu, func(tier uint8, n int) {
		if r.tierNames[tier] == costmodel.MediumCPU {
			host += n
		} else {
			other += n
		}
	})
	return host, other
}

// tierWalk calls fn with the tier and the prompt tokens of each of req's
// blocks after the gpu tokens that replica rep holds in a slower tier, in
// order, stopping at the first it does not hold.
func (r *Router) tierWalk(rep int, req *policy.Request, gpu int, fn func(tier uint8, tokens int)) {
	bt := r.tree.BlockTokens()
	set := r.tiers[rep]
	done := 0
	for i := gpu / bt; i < len(req.Keys); i++ {
		t, ok := set[req.Keys[i]]
		if !ok {
			break
		}
		n := min(bt, req.PromptTokens-gpu-done)
		if n <= 0 {
			break
		}
		done += n
		fn(t, n)
	}
}

// flightTiers records in f (routed to replica rep) the prompt tokens after
// its GPU match that rep holds in slower tiers, which rep will load rather
// than compute, and their share of f's pending prefill: the prefill of all
// its missed tokens less that of the ones left to compute, at the context
// they are computed in. They stay in PendingPrefill (every policy sees the
// queue as before) and are also counted in Replica.PendingTierPrefill, for a
// tier-aware policy to take out.
func (r *Router) flightTiers(f *flight, rep int, req *policy.Request) {
	f.tierTokens, f.tierPrefill = 0, 0
	tier, _ := r.tierHit(rep, req, f.matched)
	tier = min(tier, f.pendingTokens)
	if tier <= 0 {
		return
	}
	rest := r.priced[rep].Prefill(f.pendingTokens-tier, r.view.SeqFor(rep, req))
	f.tierTokens, f.tierPrefill = tier, max(f.pendingPrefill-rest, 0)
}
