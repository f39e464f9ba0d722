package replica

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// The slot cache (Config.Slots > 0) models llama.cpp's llama-server
// (examples/server/server.cpp at commit c392e50) instead of vLLM's block LRU:
//
//   - The server has Slots slots (-np) and the context (-c, the KV capacity)
//     is split evenly between them: each slot has nctx = capacity/Slots tokens
//     of its own (n_ctx_slot). There is no shared pool, so nothing is ever
//     preempted and a slot's KV is never taken by another slot.
//   - A slot keeps the tokens of the last prompt it served and of the output
//     it generated (cache_tokens), after the request finishes.
//   - A request goes to an idle slot (get_available_slot): the one whose
//     cached tokens it shares the most of, if that is more than
//     SlotSimilarity of the slot's cached length; else the idle slot released
//     longest ago (t_last_used; never-used slots first, ties to the lowest
//     index). With every slot busy it waits, first come first served
//     (queue_tasks.defer; a release requeues the oldest deferred task).
//     llama.cpp measures the overlap with common_lcs, the longest common
//     contiguous run of tokens. The model has no tokens, only the chain keys
//     of the prompt's full blocks (Request.Keys), so it estimates that run by
//     the common prefix in whole blocks: the run llama.cpp finds is at least
//     as long, so the model picks a slot by similarity a little less often.
//   - On its slot the request reuses the longest common prefix with the
//     slot's cache (common_lcp), here in whole blocks, at most the prompt
//     less one token (llama.cpp recomputes the last prompt token for its
//     logits: n_past--); the slot's cache beyond it is overwritten
//     (llama_kv_cache_seq_rm from n_past). Requests on other slots holding the
//     same prefix do not help: slots share no KV.
//   - A prompt of nctx tokens or more is truncated as llama.cpp does with
//     context shift on (its default) and n_keep 0: whole halves of the slot's
//     context are dropped from the front until under nctx tokens are left
//     (n_block_size = nctx/2, erased_blocks = (n − nctx/2)/(nctx/2)). Its KV
//     then starts mid-prompt: it is not a prefix of any chain, so it is not
//     reported in cache events, and only a later prompt truncated at the same
//     point can reuse it.
//   - A decode that fills the slot's context shifts it (llama.cpp's context
//     shift): the first half of the slot's tokens is discarded. What is left
//     is no prompt's prefix, so the slot then matches nothing.
//   - Every iteration batches all slots, as update_slots builds one
//     llama_decode: first one token for each decoding slot, then prompt tokens
//     of the slots still prefilling, in slot order, while ChunkBudget
//     (n_batch, 2048 by default in llama.cpp) lasts.
//   - The slots share one KV buffer, and llama.cpp's attention runs over
//     every used cell of it, masking other sequences' (kv_self.n, the highest
//     used cell; defragmentation keeps that near the cells in use). So the
//     batch is priced over what is attended: a chunk's Seq is every slot's
//     KV once the chunk is in (idle slots' kept caches included), and the
//     decode context is that span once per iteration, not once per sequence
//     (the keys are read once for the whole batch). Measured on llama-server
//     at c392e50 (docs/profiles.md, llamacpp-tiny-cpu): a cold 256-token
//     prompt takes 46 ms beside an empty slot and 158 ms beside a slot
//     holding 2,048 tokens; a decode step costs the same with one sequence or
//     two.
//
// The cache events describe the union of the chain blocks the slots hold
// from the start of a prompt: a block is stored when the first slot computes
// it and removed when the last slot holding it overwrites it. llama.cpp
// publishes no such events; the model keeps them so that a simulator may
// feed them to a router, and so that CachedPrefix and the events agree.

// slot is one llama.cpp slot.
type slot struct {
	keys    []blocks.Key // full-block keys of its last prompt, its own copy
	start   int          // tokens truncation dropped from the front of that prompt
	upto    int          // prompt tokens (from the prompt's start) whose KV it holds, start included
	held    int          // leading keys it reports as cached (0 when start > 0 or shifted)
	tokens  int          // tokens of KV it holds (cache_tokens), while idle
	shifted bool         // a context shift dropped its first tokens: it matches nothing
	rel     uint64       // release order, llama.cpp's t_last_used; 0: never used
	s       *seq         // the request running on it, or nil
}

// newSlots sets up the slot cache of a replica with cfg.Slots > 0.
func (r *Replica) newSlots() {
	r.slots = make([]slot, r.cfg.Slots)
	r.slotCtx = r.cfg.capacity() / r.cfg.Slots
	r.slotRefs = make(map[blocks.Key]int32)
}

// truncation returns the tokens llama.cpp drops from the front of a prompt
// of n tokens on a slot of nctx tokens (update_slots, "if input prompt is too
// big, truncate it", with n_keep 0).
func truncation(n, nctx int) int {
	if n < nctx {
		return 0
	}
	half := nctx / 2
	return (n - half) / half * half
}

// commonPrefix is the number of leading keys a and b share. A linear scan:
// the model's tests use hand-made keys that are not chains.
func commonPrefix(a, b []blocks.Key) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// slotMatch is the number of tokens of a prompt with keys, truncated by
// start tokens, that idle slot sl holds at the same positions: its common
// prefix with the slot's last prompt, in whole blocks, beyond the truncation.
func (r *Replica) slotMatch(sl *slot, keys []blocks.Key, start int) int {
	if sl.tokens == 0 || sl.shifted || sl.start != start {
		return 0
	}
	B := r.cfg.BlockSize
	common := min(commonPrefix(sl.keys, keys), sl.upto/B) * B
	return max(common-start, 0)
}

// chooseSlot is llama.cpp's get_available_slot for a prompt with keys
// truncated by start tokens: the index of the idle slot the request goes to,
// or -1 when every slot is busy.
func (r *Replica) chooseSlot(keys []blocks.Key, start int) int {
	best, bestLen := -1, 0
	if r.cfg.SlotSimilarity > 0 {
		for i := range r.slots {
			sl := &r.slots[i]
			if sl.s != nil || sl.tokens == 0 {
				continue
			}
			n := r.slotMatch(sl, keys, start)
			if n > bestLen && float64(n)/float64(sl.tokens) > r.cfg.SlotSimilarity {
				best, bestLen = i, n
			}
		}
		if best >= 0 {
			return best
		}
	}
	for i := range r.slots {
		sl := &r.slots[i]
		if sl.s == nil && (best < 0 || sl.rel < r.slots[best].rel) {
			best = i
		}
	}
	return best
}

// admitSlots launches waiting requests, oldest first, while a slot is idle.
// Unlike the block cache, launching needs no room in the iteration: the
// slot is taken now and gets prompt tokens when the batch has room.
func (r *Replica) admitSlots(now time.Time, ev *[]Event) {
	n := 0
	for _, s := range r.waiting {
		start := truncation(s.req.PromptTokens, r.slotCtx)
		i := r.chooseSlot(s.req.Keys, start)
		if i < 0 {
			break
		}
		r.launch(i, s, start, now, ev)
		n++
	}
	if n > 0 {
		clear(r.waiting[:n])
		r.waiting = r.waiting[n:]
	}
}

// launch puts waiting request s, whose prompt loses start tokens to
// truncation, on idle slot i (launch_slot_with_task and the first prompt
// batch of update_slots): it reuses the common prefix and overwrites the
// rest of the slot's cache.
func (r *Replica) launch(i int, s *seq, start int, now time.Time, ev *[]Event) {
	B := r.cfg.BlockSize
	sl := &r.slots[i]
	target := s.req.PromptTokens - start
	hit := min(r.slotMatch(sl, s.req.Keys, start), target-1)
	keep := 0
	if start == 0 {
		keep = min(hit/B, sl.held)
	}
	r.dropHeld(sl, keep, now, ev)
	sl.keys = append(sl.keys[:0], s.req.Keys...)
	sl.start, sl.upto, sl.tokens, sl.shifted, sl.s = start, start+hit, 0, false, s
	s.slot = i
	s.computed, s.target = hit, target
	s.running, s.admitted = true, r.nAdm
	r.nAdm++
	r.running = append(r.running, s)
	r.st.Admissions++
	r.st.PrefixCacheQueries += int64(target)
	r.st.PrefixCacheHits += int64(hit)
	*ev = append(*ev, Event{Kind: Admitted, At: now, RequestID: s.req.ID, HitTokens: hit})
}

// dropHeld stops slot sl reporting its cached keys beyond the first keep,
// removing those no other slot holds (deepest first, in the iteration's one
// BlocksRemoved event at now).
func (r *Replica) dropHeld(sl *slot, keep int, now time.Time, ev *[]Event) {
	for j := sl.held - 1; j >= keep; j-- {
		k := sl.keys[j]
		if r.slotRefs[k]--; r.slotRefs[k] > 0 {
			continue
		}
		delete(r.slotRefs, k)
		if r.removed < 0 {
			*ev = append(*ev, Event{Kind: BlocksRemoved, At: now})
			r.removed = len(*ev) - 1
		}
		e := &(*ev)[r.removed]
		e.Keys = append(e.Keys, k)
	}
	sl.held = min(sl.held, keep)
}

// storeSlot reports the full prompt blocks s has computed on its slot that
// no slot held, as the block cache's store does (one BlocksStored event per
// run of new keys; with chain keys the union of the slots' blocks is
// prefix-closed, so there is one run). Only an untruncated prompt on an
// unshifted slot holds chain blocks.
func (r *Replica) storeSlot(s *seq, end time.Time, ev *[]Event) {
	sl := &r.slots[s.slot]
	if sl.start > 0 || sl.shifted {
		return
	}
	keys := s.req.Keys
	full := min(min(s.computed, s.target)/r.cfg.BlockSize, len(keys))
	run := -1
	flush := func(upto int) { run = appendStored(ev, keys, run, upto, end, &Request{}) }
	for ; sl.held < full; sl.held++ {
		k := keys[sl.held]
		if r.slotRefs[k]++; r.slotRefs[k] > 1 {
			flush(sl.held)
		} else if run < 0 {
			run = sl.held
		}
	}
	flush(full)
}

// releaseSlot frees s's slot, which keeps what s computed (a finished
// request's prompt and all its output but the last token; a cancelled one's
// prefix), as llama.cpp's server_slot::release does.
func (r *Replica) releaseSlot(s *seq) {
	sl := &r.slots[s.slot]
	sl.tokens = s.computed
	if !sl.shifted {
		sl.upto = sl.start + min(s.computed, s.target)
	}
	sl.s = nil
	r.nRel++
	sl.rel = r.nRel
	s.computed, s.target = 0, 0
	s.running = false
}

// shift applies llama.cpp's context shift to decoding request s, whose slot
// is full: the first half of its tokens are discarded (n_keep 0, n_discard
// n_past/2), and the slot holds no prompt's prefix any more.
func (r *Replica) shift(s *seq, now time.Time, ev *[]Event) {
	sl := &r.slots[s.slot]
	r.dropHeld(sl, 0, now, ev)
	d := s.computed / 2
	s.computed -= d
	s.target -= d
	sl.shifted, sl.upto = true, 0
}

// stepSlots is Step for a slot cache: launches, then one token for each
// decoding slot, then prompt tokens for each prefilling slot in slot order,
// within ChunkBudget (llama.cpp's n_batch).
func (r *Replica) stepSlots(now time.Time, ev []Event) (time.Time, []Event) {
	unlimited := r.cfg.ChunkBudget == NoChunking
	budget := r.cfg.ChunkBudget
	r.removed = -1
	r.chunks, r.chunked, r.decodes = r.chunks[:0], r.chunked[:0], r.decodes[:0]

	r.admitSlots(now, &ev)
	for i := range r.slots {
		s := r.slots[i].s
		if s == nil || s.computed < s.target {
			continue
		}
		if s.computed+1 >= r.slotCtx {
			r.shift(s, now, &ev)
		}
		r.decodes = append(r.decodes, s)
		if !unlimited {
			budget-- // Validate keeps ChunkBudget ≥ Slots
		}
	}
	// cells is the KV in use, as llama.cpp's attention spans it.
	cells := len(r.decodes)
	for i := range r.slots {
		if s := r.slots[i].s; s != nil {
			cells += s.computed
		} else {
			cells += r.slots[i].tokens
		}
	}
	decodeCtx := 0
	if len(r.decodes) > 0 {
		decodeCtx = cells
	}
	for i := range r.slots {
		s := r.slots[i].s
		if s == nil || s.computed >= s.target {
			continue
		}
		if !unlimited && budget == 0 {
			break
		}
		n := s.target - s.computed
		if !unlimited && n > budget {
			n = budget
		}
		cells += n
		r.chunks = append(r.chunks, costmodel.Chunk{New: n, Seq: cells})
		r.chunked = append(r.chunked, s)
		if !unlimited {
			budget -= n
		}
	}
	return r.runBatch(now, decodeCtx, ev)
}

// slotStats fills the cache fields of st for a slot cache. The KV figures
// count every slot's tokens, idle slots' included, as llama.cpp's
// kv_cache_usage_ratio counts used cells: a slot keeps its cache until it is
// overwritten. CachedBlocks is the chain blocks reported in events;
// EvictableBlocks the blocks idle slots hold (the next launch overwrites
// them).
func (r *Replica) slotStats(st *Stats) {
	B := r.cfg.BlockSize
	used, idle, tokens := 0, 0, 0
	for i := range r.slots {
		sl := &r.slots[i]
		n := sl.tokens
		if sl.s != nil {
			n = sl.s.computed
		}
		tokens += n
		used += ceilDiv(n, B)
		if sl.s == nil {
			idle += ceilDiv(n, B)
		}
	}
	st.TotalBlocks = r.nBlocks
	st.FreeBlocks = max(r.nBlocks-used, 0)
	st.CachedBlocks = len(r.slotRefs)
	st.EvictableBlocks = idle
	st.KVUsage = min(float64(tokens)/float64(r.slotCtx*len(r.slots)), 1)
}

// slotPrefix is CachedPrefix for a slot cache: the leading keys some slot
// reports as cached.
func (r *Replica) slotPrefix(keys []blocks.Key) int {
	for i, k := range keys {
		if r.slotRefs[k] == 0 {
			return i
		}
	}
	return len(keys)
}

// resetSlots empties every slot (ResetPrefixCache); no request is running.
func (r *Replica) resetSlots() {
	for i := range r.slots {
		sl := &r.slots[i]
		sl.keys, sl.start, sl.upto, sl.held, sl.tokens, sl.shifted = sl.keys[:0], 0, 0, 0, 0, false
	}
	clear(r.slotRefs)
}
