package router

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// maxSlots bounds SetCacheSlots (llama.cpp's -np is a handful; 256 is far
// beyond any real deployment).
const maxSlots = 256

// noSlot marks a flight that holds no slot: a block-cache replica, or a
// slot replica whose slots were all busy (llama.cpp defers it).
const noSlot = -1

// DefaultSlotSimilarity is llama.cpp's --slot-prompt-similarity default: a
// request goes to the idle slot whose cached tokens it shares more than this
// fraction of (server.cpp, get_available_slot).
const DefaultSlotSimilarity = 0.5

// slot is the router's model of one llama.cpp slot.
type slot struct {
	// keys are the full-block keys of the prompt the slot last served
	// (a copy: the caller's slices are theirs once a request finishes).
	keys []blocks.Key
	// tokens is what the slot holds: that prompt and its output.
	tokens int
	used   uint64 // logical time of its last assignment, for LRU
	busy   bool
}

// slotCache is the router's model of a slot-cache replica.
type slotCache struct {
	slots    []slot
	clock    uint64
	deferred []uint64 // requests waiting for a free slot, in arrival order
}

func newSlotCache(n int) *slotCache {
	if n <= 0 {
		return nil
	}
	return &slotCache{slots: make([]slot, n)}
}

// n is the number of slots (0 for nil: a block cache).
func (c *slotCache) n() int {
	if c == nil {
		return 0
	}
	return len(c.slots)
}

// commonBlocks is the number of leading keys a and b share. Chain keys
// (internal/blocks) hash the whole prefix, so keys equal at position i are
// equal before it too, and a binary search finds the boundary.
func commonBlocks(a, b []blocks.Key) int {
	lo, hi := 0, min(len(a), len(b)) // a[:lo] == b[:lo]; a[hi-1] != b[hi-1] unless hi == lo
	if hi > 0 && a[hi-1] == b[hi-1] {
		return hi
	}
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if a[mid] == b[mid] {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

// choose returns the slot llama.cpp would give a request with keys, and
// how many leading blocks of keys that slot holds. Among idle slots it takes
// the one whose cached tokens the prompt shares the most of, if that is
// more than sim of the slot's length; else the least recently used idle
// slot. The common subsequence llama.cpp measures is estimated by the common
// prefix, which is what the request can reuse. With every slot busy the
// request must wait (wait = true); idx is then the slot assigned longest ago,
// the first likely to free up and so the one it will most likely land on.
func (c *slotCache) choose(keys []blocks.Key, bt int, sim float64) (idx, common int, wait bool) {
	idx, bestLCS := noSlot, 0
	for i := range c.slots {
		s := &c.slots[i]
		if s.busy || s.tokens == 0 {
			continue
		}
		cb := commonBlocks(s.keys, keys)
		lcs := cb * bt
		if lcs > bestLCS && float64(lcs)/float64(s.tokens) > sim {
			idx, bestLCS, common = i, lcs, cb
		}
	}
	if idx != noSlot {
		return idx, common, false
	}
	for i := range c.slots {
		s := &c.slots[i]
		if s.busy {
			continue
		}
		if idx == noSlot || s.used < c.slots[idx].used {
			idx = i
		}
	}
	if idx != noSlot {
		return idx, commonBlocks(c.slots[idx].keys, keys), false
	}
	oldest := 0
	for i := range c.slots {
		if c.slots[i].used < c.slots[oldest].used {
			oldest = i
		}
	}
	return oldest, commonBlocks(c.slots[oldest].keys, keys), true
}

// slotted returns replica id's slot model, or nil when the replica has a
// block cache or reports KV events (then the events are the truth).
func (r *Router) slotted(id int) *slotCache {
	if id >= len(r.cache) || r.events[id] {
		return nil
	}
	return r.cache[id].slots
}

// slotMatches replaces, in the current match, each slot replica's cached
// blocks (the longest prefix any of its slots holds) by what the slot the
// request would land on holds: all that the replica can reuse for it. It
// sets each slot replica's SlotSpan for a prompt of prompt tokens: the
// other slots' tokens and the prompt (policy.Replica.SlotSpan).
func (r *Router) slotMatches(keys []blocks.Key, prompt int) {
	for id := range r.reps {
		r.reps[id].SlotSpan = 0
	}
	for id := range r.cache {
		c := r.slotted(id)
		if c == nil || id >= len(r.match.PerReplica) {
			continue
		}
		s, cb, _ := c.choose(keys, r.cfg.BlockTokens, r.cfg.SlotSimilarity)
		r.match.PerReplica[id] = min(r.match.PerReplica[id], cb)
		if id < len(r.reps) {
			r.reps[id].SlotSpan = c.span(s, prompt)
		}
	}
}

// span is the KV cells the replica's slots hold with a prompt of prompt
// tokens in slot s: every other slot's tokens and the prompt.
func (c *slotCache) span(s, prompt int) int {
	n := prompt
	for i := range c.slots {
		if i != s {
			n += c.slots[i].tokens
		}
	}
	return n
}

// occupy gives flight f slot s of replica id: the slot's old prompt is
// overwritten beyond what it shares with the new one (the tree forgets the
// blocks of it that no other slot holds), and the new prompt's path is
// cached.
func (r *Router) occupy(id int, c *slotCache, s int, f *flight, path []*prefixtree.Node, now time.Time) {
	sl := &c.slots[s]
	f.slot, f.prevKeys, f.prevTokens = s, sl.keys, sl.tokens
	r.dropSlotTail(id, c, s, f.keys)
	sl.keys = append([]blocks.Key(nil), f.keys...)
	sl.tokens = f.prompt + f.out
	c.clock++
	sl.used = c.clock
	sl.busy = true
	r.tree.SetPathCached(path, id, now)
	if t := r.cal[id]; t != nil {
		// Its prefill starts now (waiting for a slot is not prefill),
		// over every slot's cells.
		r.calStart(t, f, c.span(s, f.prompt), now)
	}
}

// dropSlotTail uncaches the part of slot s's prompt that neither keys nor
// another slot of replica id shares.
func (r *Router) dropSlotTail(id int, c *slotCache, s int, keys []blocks.Key) {
	old := c.slots[s].keys
	keep := commonBlocks(old, keys)
	for j := range c.slots {
		if j != s {
			keep = max(keep, commonBlocks(old, c.slots[j].keys))
		}
	}
	if keep < len(old) {
		r.tree.UncacheFrom(old, keep, id)
	}
}

// releaseSlot frees flight f's slot (it now holds the prompt and
// outputTokens of output) or takes f off the replica's wait list, then gives
// free slots to the requests waiting, oldest first, as llama.cpp does when a
// slot is released.
func (r *Router) releaseSlot(id int, c *slotCache, fid uint64, f *flight, outputTokens int, now time.Time) {
	if f.slot != noSlot && f.slot < len(c.slots) {
		sl := &c.slots[f.slot]
		sl.busy = false
		sl.tokens = f.prompt + max(outputTokens, 0)
	} else {
		for i, w := range c.deferred {
			if w == fid {
				c.deferred = append(c.deferred[:i], c.deferred[i+1:]...)
				break
			}
		}
	}
	for len(c.deferred) > 0 {
		wid := c.deferred[0]
		w, ok := r.inflight[wid]
		if !ok || w.replica != id {
			c.deferred = c.deferred[1:]
			continue
		}
		s, _, wait := c.choose(w.keys, r.cfg.BlockTokens, r.cfg.SlotSimilarity)
		if wait {
			return
		}
		c.deferred = c.deferred[1:]
		r.tree.Lookup(w.keys, &r.scratch)
		r.occupy(id, c, s, w, r.scratch.Path, now)
	}
}

// slotFeedback corrects replica id's slot model from a finished request's
// report: when the replica reused less than the slot the router placed the
// request on held, the request ran on another slot. That slot (the idle one
// holding about the reported prefix, else the least recently used idle one)
// now holds the request's prompt, and the router's slot keeps what it held
// before. It reports whether the model changed.
func (r *Router) slotFeedback(id int, c *slotCache, f *flight, reported int, now time.Time) bool {
	bt := r.cfg.BlockTokens
	if f.slot == noSlot || f.slot >= len(c.slots) || f.matched-reported <= bt {
		return false
	}
	s := f.slot
	want := reported / bt
	j, jd := noSlot, 0
	for i := range c.slots {
		if i == s || c.slots[i].busy {
			continue
		}
		d := commonBlocks(c.slots[i].keys, f.keys) - want
		if d < 0 {
			d = -d
		}
		if d <= 1 && (j == noSlot || d < jd) {
			j, jd = i, d
		}
	}
	if j == noSlot {
		for i := range c.slots {
			if i != s && !c.slots[i].busy && (j == noSlot || c.slots[i].used < c.slots[j].used) {
				j = i
			}
		}
	}
	if j == noSlot {
		return false
	}
	sj, ss := &c.slots[j], &c.slots[s]
	oldJ := sj.keys
	sj.keys, sj.tokens, sj.used, sj.busy = ss.keys, ss.tokens, ss.used, true
	ss.keys, ss.tokens, ss.busy = f.prevKeys, f.prevTokens, false
	f.slot, f.prevKeys = j, nil
	if len(ss.keys) > 0 {
		r.tree.Lookup(ss.keys, &r.scratch)
		r.tree.SetPathCached(r.scratch.Path, id, now)
	}
	keep := 0
	for i := range c.slots {
		if i != j {
			keep = max(keep, commonBlocks(oldJ, c.slots[i].keys))
		}
	}
	keep = max(keep, commonBlocks(oldJ, sj.keys))
	if keep < len(oldJ) {
		r.tree.UncacheFrom(oldJ, keep, id)
	}
	return true
}

// slotVictims calls fn, until it returns false, for the tree nodes replica
// id would stop caching if it took a request with keys now: the part of the
// chosen slot's prompt that neither the request nor another slot shares.
// When every slot is busy that is the slot the request will most likely get
// once it has waited (choose): a busy replica evicts too, later.
func (r *Router) slotVictims(id int, keys []blocks.Key, fn func(n *prefixtree.Node) bool) {
	c := r.slotted(id)
	if c == nil {
		return
	}
	s, _, _ := c.choose(keys, r.cfg.BlockTokens, r.cfg.SlotSimilarity)
	old := c.slots[s].keys
	keep := commonBlocks(old, keys)
	for j := range c.slots {
		if j != s {
			keep = max(keep, commonBlocks(old, c.slots[j].keys))
		}
	}
	if keep >= len(old) {
		return
	}
	r.tree.Lookup(old, &r.victims)
	for _, n := range r.victims.Path {
		if n.Depth() < keep || !n.Cached(id) {
			continue
		}
		if !fn(n) {
			return
		}
	}
}

// clear forgets what the slots hold (the engine restarted or
// dropped its cache); requests in flight keep their slots.
func (c *slotCache) clear() {
	if c == nil {
		return
	}
	for i := range c.slots {
		c.slots[i].keys, c.slots[i].tokens = nil, 0
	}
}
