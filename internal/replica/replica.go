// Package replica models one GPU inference engine (vLLM- or SGLang-like) well
// enough to price routing decisions: continuous batching, chunked prefill, a
// paged KV cache holding a prefix cache, recompute preemption and a local
// scheduler (ALGORITHMS.md §6). The discrete-event simulator drives it in
// virtual time; the engine command drives it in real time.
//
// The model runs one iteration at a time. An iteration's batch is, in order:
//  1. every running request past its prefill decodes one token (one token of
//     the budget each), oldest admitted first;
//  2. requests admitted earlier whose prefill is not done get the next chunk
//     of their prompt, in admission order;
//  3. waiting requests are admitted, in the local scheduler's order, while the
//     budget, MaxRunning and the KV cache allow, each with a first chunk.
//
// The iteration takes Profile.Iteration of that batch. Its effects (tokens,
// stored blocks) happen at its end; admissions, evictions and preemptions at
// its start.
//
// KV memory is counted in blocks of BlockSize tokens. A request holds a block
// for every BlockSize tokens of its sequence (prompt plus generated tokens);
// at admission it takes all its prompt blocks at once (the cached prefix is
// shared, the rest allocated), and a decode takes a new block when its
// sequence crosses a block boundary. Full prompt blocks enter the prefix cache
// at the end of the iteration that computed them, as vLLM caches full blocks;
// generated tokens are never added to the prefix cache (a later request's
// prompt matching an earlier answer misses it), which keeps the cache's keys
// exactly the router's chain keys of prompts. Unreferenced cached blocks are
// evicted LRU, leaves first, when space is needed; when a decode needs a block
// and none is free or evictable, the youngest running request is preempted:
// its KV is dropped (cached prompt blocks stay cached, unpinned) and it waits
// at the front of the queue to recompute (vLLM v1's recompute preemption).
//
// With Config.Slots > 0 the cache is llama.cpp's slot cache instead (one
// prompt per slot, the context split between slots, requests waiting for an
// idle slot): see slots.go.
//
// A Replica is not safe for concurrent use. It reads no clock: every method
// takes the current time from the caller.
package replica

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// Errors returned by Submit.
var (
	// ErrInvalidRequest: the request's sizes are inconsistent.
	ErrInvalidRequest = errors.New("replica: invalid request")
	// ErrDuplicateID: a request with this ID is already waiting or running.
	ErrDuplicateID = errors.New("replica: duplicate request ID")
	// ErrTooLong: the request's prompt and output cannot fit the KV cache
	// even alone (vLLM rejects such requests against max_model_len).
	ErrTooLong = errors.New("replica: request does not fit the KV cache")
	// ErrRole: the request is not one the replica's role takes (Config.Role).
	ErrRole = errors.New("replica: request does not fit the replica's role")
	// ErrNotAwaitingKV: KVArrived names a request that is not waiting for
	// its KV.
	ErrNotAwaitingKV = errors.New("replica: request is not awaiting KV")
)

// Request is one inference request as the replica sees it. The replica keeps
// the pointer until the request finishes or is cancelled; do not modify it in
// the meantime (BlocksStored events alias Keys).
type Request struct {
	// ID identifies the request in events; unique among live requests.
	ID uint64
	// Keys are the chain keys (internal/blocks) of the prompt's full blocks
	// of BlockSize tokens, in order. Fewer keys than full blocks is allowed:
	// blocks without a key are computed but never cached.
	Keys []blocks.Key
	// PromptTokens is the prompt length, at least len(Keys)·BlockSize; the
	// partial last block is never cached.
	PromptTokens int
	// OutputTokens is the number of tokens to generate, at least 1.
	OutputTokens int
	// RemoteKV says the prompt was prefilled on another replica (the decode
	// leg of a disaggregated request, vLLM's do_remote_prefill): when
	// admitted, the request takes blocks for its whole prompt, reusing the
	// prefix this replica caches, and waits (a KVPull event) until the
	// caller reports with KVArrived that the blocks it lacked came over the
	// network. It then recomputes only the last prompt token, for its
	// logits, and decodes. A block cache only; not on a prefill replica.
	RemoteKV bool
	// Adapter names the LoRA adapter the request runs with ("" for the
	// base model): its blocks are cached apart from every other adapter's
	// and the base model's, and with Config.MaxLoras > 0 it needs the
	// adapter in a GPU slot (lora.go). A block cache only.
	Adapter string
	// AdapterBytes is the size of Adapter's weights, which a load copies
	// to the GPU (costmodel.AdapterLoad); 0 prices only the fixed cost.
	AdapterBytes int64
	// Salt is the request's cache salt (vLLM's cache_salt; "" for none):
	// its blocks are cached apart from every other salt's and the
	// unsalted ones, whatever Keys the caller gave (lora.go, cacheKeys),
	// and its BlocksStored events carry it (Event.Salt). A slot cache
	// (Config.Slots) ignores it, as llama.cpp has no salt.
	Salt string
}

// seq is a request's state on the replica.
type seq struct {
	req       *Request
	arrival   uint64 // submission order
	admitted  uint64 // admission order, while running
	running   bool
	group     int // priority group while waiting in one, else -1
	target    int // tokens to prefill at this admission: prompt + generated
	computed  int // tokens whose KV is computed
	pinned    int // leading keys referenced in the prefix cache
	priv      int // blocks held outside the prefix cache
	generated int // output tokens produced
	match     int // scratch: cached prefix blocks (lpm)
	slot      int // slot cache: the slot it runs on, while running
	done      bool
	awaitKV   bool         // RemoteKV: admitted, its blocks reserved, its KV not yet arrived
	kvDone    bool         // RemoteKV: its KV arrived (a preemption then recomputes it here)
	keys      []blocks.Key // its blocks' keys in the prefix cache (cacheKeys)
	// ents are the prefix cache entries of its leading keys: while it
	// runs, exactly its pinned blocks' (ents[j] holds keys[j], j < pinned);
	// while it waits, those its last scan found cached (scanPrefix) or it
	// pinned before a preemption, which may have been evicted since, and are
	// checked before use (prefixCache.holds).
	ents []int32
	// CPU offloading (offload.go): blocks written through to the tier so
	// far, and a load in flight of loadN blocks from loadFrom, ending at
	// loadEnd.
	offloaded       int
	loading         bool
	loadFrom, loadN int
	loadEnd         time.Time
}

// Replica is the model of one GPU engine. Create it with New. It is not safe
// for concurrent use.
type Replica struct {
	cfg     Config
	local   int
	nBlocks int
	cache   prefixCache
	privAll int // blocks held outside the prefix cache, all requests

	running []*seq // admission order
	waiting []*seq // fcfs, lpm: the queue; priority: not yet in a group
	groups  [][]*seq
	turn    int // priority: the group whose turn comes next
	byID    map[uint64]*seq
	spare   []*seq // finished requests' state, for reuse
	nArr    uint64
	nAdm    uint64
	nAwait  int // running requests awaiting their KV (RemoteKV)

	// Per-step scratch, reused so that a step does not allocate.
	chunks  []costmodel.Chunk
	chunked []*seq // the request of each chunk
	decodes []*seq
	removed int // index in the step's events of its BlocksRemoved event, or -1

	// Slot cache (cfg.Slots > 0; slots.go); nil slots: the block cache.
	slots    []slot
	slotCtx  int                  // tokens of context per slot
	slotRefs map[blocks.Key]int32 // reported chain keys: how many slots hold each
	nRel     uint64               // slot releases, for LRU

	// LoRA adapters (lora.go): the GPU slots, the clock of their LRU, and
	// the load time the iteration being scheduled owes.
	loras     []loraSlot
	loraClock uint64
	loadTime  time.Duration

	// CPU offloading (offload.go; nil: off) and the loads in flight.
	cpu      *cpuTier
	nLoading int

	st Stats
}

const (
	localFCFS = iota
	localLPM
	localPriority
)

// New returns an idle replica with an empty cache. Zero fields of cfg take
// their defaults (Config.Default); the result must pass Config.Validate.
func New(cfg Config) (*Replica, error) {
	cfg.Default()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := &Replica{
		cfg:     cfg,
		nBlocks: cfg.capacity() / cfg.BlockSize,
		cache:   newPrefixCache(),
		byID:    make(map[uint64]*seq),
		removed: -1,
	}
	switch cfg.Local {
	case LocalLPM:
		r.local = localLPM
	case LocalPriority:
		r.local = localPriority
		r.groups = make([][]*seq, cfg.PriorityGroups)
		r.turn = cfg.PriorityGroups - 1
	}
	if cfg.Slots > 0 {
		r.newSlots()
	}
	if cfg.CPUOffloadTokens > 0 {
		r.cpu = newCPUTier(cfg.CPUOffloadTokens/cfg.BlockSize, cfg.Profile)
	}
	return r, nil
}

// Config returns the replica's configuration, defaults filled in.
func (r *Replica) Config() Config { return r.cfg }

// Submit enqueues a request; it waits until a Step admits it. now is its
// arrival time (the queue is kept in Submit order). A caller whose last Step
// returned busy=false must call Step again to start work on it.
func (r *Replica) Submit(req *Request, now time.Time) error {
	B := r.cfg.BlockSize
	switch {
	case req.OutputTokens < 1:
		return fmt.Errorf("%w: request %d: OutputTokens must be at least 1, got %d",
			ErrInvalidRequest, req.ID, req.OutputTokens)
	case req.PromptTokens < 1:
		return fmt.Errorf("%w: request %d: PromptTokens must be at least 1, got %d",
			ErrInvalidRequest, req.ID, req.PromptTokens)
	case req.PromptTokens < len(req.Keys)*B:
		return fmt.Errorf("%w: request %d: %d keys of %d tokens exceed PromptTokens %d",
			ErrInvalidRequest, req.ID, len(req.Keys), B, req.PromptTokens)
	case r.byID[req.ID] != nil:
		return fmt.Errorf("%w: %d", ErrDuplicateID, req.ID)
	case req.AdapterBytes < 0:
		return fmt.Errorf("%w: request %d: AdapterBytes must be >= 0, got %d", ErrInvalidRequest, req.ID, req.AdapterBytes)
	case req.Adapter != "" && r.slots != nil:
		return fmt.Errorf("%w: request %d: adapter %q needs a block cache, the replica has slots", ErrInvalidRequest, req.ID, req.Adapter)
	case req.RemoteKV && r.slots != nil:
		return fmt.Errorf("%w: request %d: RemoteKV needs a block cache, the replica has slots", ErrInvalidRequest, req.ID)
	case r.cfg.Role == RolePrefill && (req.RemoteKV || req.OutputTokens > 1):
		return fmt.Errorf("%w: request %d: a prefill replica takes one output token and no remote KV (asked %d tokens, remote %v)",
			ErrRole, req.ID, req.OutputTokens, req.RemoteKV)
	}
	// The longest sequence whose KV is ever held is prompt + output - 1 (the
	// last token's KV is never computed); recomputing it after a preemption
	// needs one more token and a block of headroom. A slot cache truncates
	// long prompts and shifts full contexts instead, as llama.cpp does.
	if need := ceilDiv(req.PromptTokens+req.OutputTokens-1, B) + 1; r.slots == nil && need > r.nBlocks {
		return fmt.Errorf("%w: request %d needs %d blocks, the replica has %d",
			ErrTooLong, req.ID, need, r.nBlocks)
	}
	var s *seq
	if n := len(r.spare); n > 0 {
		s = r.spare[n-1]
		r.spare = r.spare[:n-1]
	} else {
		s = new(seq)
	}
	ents := s.ents[:0]
	if cap(ents) < len(req.Keys) && r.slots == nil {
		ents = make([]int32, 0, len(req.Keys)) // its scans append no more
	}
	*s = seq{req: req, arrival: r.nArr, group: -1, ents: ents}
	s.keys = cacheKeys(nil, req)
	r.nArr++
	r.byID[req.ID] = s
	r.waiting = append(r.waiting, s)
	return nil
}

// Step runs one iteration starting at now, if there is work: it picks the
// batch, applies all its effects at once, and returns the iteration's end
// (now plus Profile.Iteration of the batch) with the iteration's events
// appended to ev, in time order (see Kind). busy is false, end is now and no
// event is added when nothing is running or waiting. When every running
// request awaits its KV (Request.RemoteKV) and nothing else can be
// scheduled, busy is false and end is now too, with the events of the
// admissions made (KVPull among them): the caller steps again after
// KVArrived.
//
// The caller calls Step again at end (the simulator schedules it; a real-time
// server sleeps until then). Because the effects are applied when Step
// returns, Stats and CachedPrefix describe the state at end; the caller
// delivers the events at their At times. Calling Step before end starts the
// next iteration early, which a GPU cannot do.
//
// Step does not allocate in steady state when ev has room, except for the
// Keys of a BlocksRemoved event.
func (r *Replica) Step(now time.Time, ev []Event) (end time.Time, out []Event, busy bool) {
	if len(r.running) == 0 && r.nWaiting() == 0 {
		return now, ev, false
	}
	if r.slots != nil {
		end, ev = r.stepSlots(now, ev)
		return end, ev, true
	}
	B := r.cfg.BlockSize
	unlimited := r.cfg.ChunkBudget == NoChunking
	budget := r.cfg.ChunkBudget
	r.removed = -1
	r.chunks, r.chunked, r.decodes = r.chunks[:0], r.chunked[:0], r.decodes[:0]
	// Loads from the CPU tier done by now land in the GPU cache first.
	r.landLoads(now, &ev)

	// 1. Decodes, oldest first; a decode crossing a block boundary takes a
	// block, evicting or preempting the youngest request when none is left
	// (vLLM v1 Scheduler.schedule, running loop).
	decodeCtx := 0
	for i := 0; i < len(r.running); i++ {
		s := r.running[i]
		if s.computed < s.target {
			continue // still prefilling, or awaiting its KV
		}
		if !unlimited && budget == 0 {
			break // unreachable: Validate keeps ChunkBudget ≥ MaxRunning
		}
		if ceilDiv(s.computed+1, B) > s.pinned+s.priv {
			for r.freeBlocks() == 0 && r.cache.nLRU == 0 {
				victim := r.victim()
				r.preempt(victim, now, &ev)
				if victim == s {
					break
				}
			}
			if !s.running {
				break // s preempted itself: it was the youngest
			}
			r.allocate(1, now, &ev)
			s.priv++
		}
		r.decodes = append(r.decodes, s)
		decodeCtx += s.computed + 1 // its sequence once this token's KV is in
		if !unlimited {
			budget--
		}
	}

	// 2. Continuing prefills, in admission order.
	for _, s := range r.running {
		if s.computed >= s.target || s.awaitKV || s.loading {
			continue
		}
		if !unlimited && budget == 0 {
			break
		}
		n := s.target - s.computed
		if !unlimited && n > budget {
			n = budget
		}
		r.addChunk(s, n)
		if !unlimited {
			budget -= n
		}
	}

	// 3. Admissions, in the local scheduler's order.
	if (unlimited || budget > 0) && len(r.running) < r.cfg.MaxRunning && r.nWaiting() > 0 {
		switch r.local {
		case localFCFS:
			r.admitQueue(now, &ev, &budget)
		case localLPM:
			r.sortLPM()
			r.admitQueue(now, &ev, &budget)
		case localPriority:
			r.admitPriority(now, &ev, &budget)
		}
	}
	if len(r.chunks) == 0 && len(r.decodes) == 0 {
		if r.nLoading > 0 {
			// Only loads from the CPU tier in flight (and maybe remote
			// KV): no iteration, a wait until the first load lands.
			return r.nextLoad(), ev, true
		}
		if r.nAwait > 0 {
			return now, ev, false // only requests awaiting their KV: idle until KVArrived
		}
	}
	end, ev = r.runBatch(now, decodeCtx, ev)
	return end, ev, true
}

// victim is the request a decode short of blocks preempts: the youngest
// running one, leaving out those awaiting their KV or loading it from the
// CPU tier (their blocks are the target of a transfer in flight; vLLM keeps
// such requests out of its running queue until their KV has arrived).
func (r *Replica) victim() *seq {
	for i := len(r.running) - 1; i >= 0; i-- {
		if s := r.running[i]; !s.awaitKV && !s.loading {
			return s
		}
	}
	panic("replica: internal error: no running request to preempt")
}

// runBatch runs the iteration scheduled in r.chunks and r.decodes, starting
// at now: it prices it, applies its effects at its end and returns the end.
func (r *Replica) runBatch(now time.Time, decodeCtx int, ev []Event) (end time.Time, out []Event) {
	if len(r.chunks) == 0 && len(r.decodes) == 0 {
		// Every waiting request fits an idle replica (Submit checks), and a
		// running request always gets a token of budget, so this is a bug.
		panic("replica: internal error: an iteration with work scheduled nothing")
	}

	d := r.cfg.Profile.Iteration(costmodel.Batch{
		Prefill:       r.chunks,
		DecodeSeqs:    len(r.decodes),
		DecodeContext: decodeCtx,
	})
	if d < 0 {
		d = 0
	}
	if r.loadTime > 0 {
		// Adapters loaded for this iteration's admissions (lora.go): the
		// step waits for their copies.
		d += r.loadTime
		r.loadTime = 0
	}
	end = now.Add(d)
	r.st.Iterations++
	r.st.BusyTime += d

	// Effects, at end.
	nDone := 0
	for _, s := range r.decodes {
		s.computed++
		if r.produce(s, end, &ev) {
			nDone++
		}
	}
	for i, s := range r.chunked {
		n := r.chunks[i].New
		s.computed += n
		r.st.PromptTokensComputed += int64(n)
		if r.slots != nil {
			r.storeSlot(s, end, &ev)
		} else {
			r.store(s, end, &ev)
		}
		if s.computed == s.target && r.produce(s, end, &ev) {
			nDone++
		}
	}
	if nDone > 0 {
		kept := r.running[:0]
		for _, s := range r.running {
			if s.done {
				r.recycle(s)
			} else {
				kept = append(kept, s)
			}
		}
		clear(r.running[len(kept):])
		r.running = kept
	}
	return end, ev
}

// produce records one output token for s at end and finishes s after its
// last. It reports whether s finished.
func (r *Replica) produce(s *seq, end time.Time, ev *[]Event) bool {
	s.generated++
	r.st.GenerationTokens++
	k := Token
	if s.generated == 1 {
		k = FirstToken
	}
	*ev = append(*ev, Event{Kind: k, At: end, RequestID: s.req.ID, N: s.generated})
	if s.generated < s.req.OutputTokens {
		return false
	}
	*ev = append(*ev, Event{Kind: Finished, At: end, RequestID: s.req.ID, N: s.generated})
	r.release(s)
	s.done = true // recycled after r.running is compacted
	delete(r.byID, s.req.ID)
	r.st.Finished++
	return true
}

// addChunk schedules n prefill tokens of s in this iteration.
func (r *Replica) addChunk(s *seq, n int) {
	r.chunks = append(r.chunks, costmodel.Chunk{New: n, Seq: s.computed + n})
	r.chunked = append(r.chunked, s)
}

// store puts the full prompt blocks s has computed into the prefix cache,
// reporting the new ones. A block already cached (another request computed
// the same prefix meanwhile) is shared and s's copy freed, as SGLang's radix
// cache does on insert.
func (r *Replica) store(s *seq, end time.Time, ev *[]Event) {
	keys, ck := s.req.Keys, s.keys
	full := min(s.computed/r.cfg.BlockSize, len(keys))
	run := -1 // start of the current run of new keys
	flush := func(upto int) { run = appendStored(ev, keys, run, upto, end, s.req) }
	for ; s.pinned < full; s.pinned++ {
		k := ck[s.pinned]
		i := r.cache.lookup(k)
		if i != nilEntry {
			flush(s.pinned)
			r.cache.pin(i)
		} else {
			parent := nilEntry
			if s.pinned > 0 {
				parent = s.ents[s.pinned-1]
			}
			i = r.cache.insert(k, keys[s.pinned], parent)
			if run < 0 {
				run = s.pinned
			}
		}
		s.ents = append(s.ents[:s.pinned], i)
		s.priv--
		r.privAll--
	}
	flush(full)
	r.offload(s, full, end, ev)
}

// appendStored appends a BlocksStored event for keys[run:upto] (the chain
// continuing keys[run-1]) of request req (its adapter and salt) when run ≥
// 0, and returns -1: no run open.
func appendStored(ev *[]Event, keys []blocks.Key, run, upto int, end time.Time, req *Request) int {
	if run < 0 {
		return -1
	}
	e := Event{Kind: BlocksStored, At: end, Keys: keys[run:upto:upto], Adapter: req.Adapter, Salt: req.Salt}
	if run > 0 {
		e.Parent, e.HasParent = keys[run-1], true
	}
	*ev = append(*ev, e)
	return -1
}

// freeBlocks is the number of blocks neither cached nor held by a request.
func (r *Replica) freeBlocks() int { return r.nBlocks - r.privAll - r.cache.len() }

// allocate makes n blocks free, evicting LRU leaves as needed, and gives them
// to a request. The caller has checked that free plus evictable blocks
// suffice.
func (r *Replica) allocate(n int, now time.Time, ev *[]Event) {
	if short := n - r.freeBlocks(); short > 0 {
		if r.removed < 0 {
			*ev = append(*ev, Event{Kind: BlocksRemoved, At: now, Keys: make([]blocks.Key, 0, short)})
			r.removed = len(*ev) - 1
		}
		e := &(*ev)[r.removed]
		for range short {
			e.Keys = append(e.Keys, r.cache.evict())
		}
	}
	r.privAll += n
}

// release drops s's references to cached blocks, deepest first so that they
// are evicted deepest first, and frees its other blocks. s.ents keeps the
// entries, the cached prefix a preempted request's next admission starts
// from (scanPrefix).
func (r *Replica) release(s *seq) {
	if r.slots != nil {
		r.releaseSlot(s)
		return
	}
	if s.running {
		r.loraRelease(s)
	}
	s.ents = s.ents[:s.pinned]
	for j := s.pinned - 1; j >= 0; j-- {
		r.cache.unpin(s.ents[j])
	}
	if s.loading {
		r.endLoad(s, false, time.Time{}, nil)
	}
	r.privAll -= s.priv
	s.pinned, s.priv, s.computed, s.target = 0, 0, 0, 0
	s.running = false
	if s.awaitKV {
		s.awaitKV = false
		r.nAwait--
	}
}

// preempt drops the KV of running request s and puts it back at the front of
// the waiting queue (vLLM v1: Scheduler._preempt_request, recompute mode).
func (r *Replica) preempt(s *seq, now time.Time, ev *[]Event) {
	r.release(s)
	if i := slices.Index(r.running, s); i >= 0 {
		r.running = slices.Delete(r.running, i, i+1)
	}
	r.waiting = slices.Insert(r.waiting, 0, s)
	r.st.Preemptions++
	*ev = append(*ev, Event{Kind: Preempted, At: now, RequestID: s.req.ID, N: s.generated})
}

// tryAdmit admits waiting request s if its uncached blocks plus one block of
// headroom fit in free and evictable blocks, scheduling its first chunk. It
// reports whether s was admitted. The hit is whole cached blocks, leaving at
// least the last token to compute (vLLM v1 KVCacheManager.get_computed_blocks
// caps the hit at num_tokens-1, block-aligned).
func (r *Replica) tryAdmit(s *seq, now time.Time, ev *[]Event, budget *int) bool {
	if r.loraBlocked(s) {
		return false // its adapter would exceed MaxLoras (lora.go)
	}
	B := r.cfg.BlockSize
	target := s.req.PromptTokens + s.generated
	total := ceilDiv(target, B)
	keys := s.keys
	maxHit := min(len(keys), (target-1)/B)
	avail := r.freeBlocks() + r.cache.nLRU
	if total-maxHit+1 > avail {
		return false // cannot fit even with the best possible hit
	}
	hit, unpinned := r.scanPrefix(s, maxHit)
	priv := total - hit
	if priv+1 > avail-unpinned {
		return false
	}
	tier, busy := r.offloadHit(s, hit, maxHit)
	if busy {
		return false // its blocks are being loaded: it waits (offload.go)
	}
	r.loraAcquire(s, now, ev)
	for _, i := range s.ents {
		r.cache.pin(i)
	}
	r.allocate(priv, now, ev)
	s.priv, s.pinned = priv, hit
	s.computed, s.target = hit*B, target
	s.offloaded = 0
	s.running, s.admitted, s.group = true, r.nAdm, -1
	r.nAdm++
	r.running = append(r.running, s)
	r.st.Admissions++
	r.st.PrefixCacheQueries += int64(target)
	r.st.PrefixCacheHits += int64(hit * B)
	if r.cpu != nil {
		r.cpu.touch(keys) // vLLM's lookup touches the request's blocks
	}
	*ev = append(*ev, Event{Kind: Admitted, At: now, RequestID: s.req.ID,
		HitTokens: hit * B, TierTokens: tier * B, Resumed: s.generated > 0})
	if tier > 0 {
		// The blocks after its GPU hit come from the CPU tier: no chunk
		// until they land (offload.go).
		r.startLoad(s, hit, tier, now)
		(*ev)[len(*ev)-1].LoadEnd = s.loadEnd
		return true
	}
	if s.req.RemoteKV && !s.kvDone {
		// Its blocks are reserved; the ones this replica lacks come over
		// the network (NixlConnector's pull of the blocks not computed
		// locally). No chunk until KVArrived.
		s.awaitKV = true
		r.nAwait++
		*ev = append(*ev, Event{Kind: KVPull, At: now, RequestID: s.req.ID, N: total - hit})
		return true
	}
	n := target - s.computed
	if *budget != NoChunking && n > *budget {
		n = *budget
	}
	r.addChunk(s, n)
	if *budget != NoChunking {
		*budget -= n
	}
	return true
}

// scanPrefix returns how many of the first n keys of waiting request s are
// cached (hit), as many as a lookup of each in turn finds
// (prefixCache.prefix), and how many of those no request references
// (unpinned); it leaves their entries in s.ents. It starts from the entries
// s.ents kept from s's last scan or its last run, as long as each still holds
// its key (prefixCache.holds), and finds the keys after them through the
// child hints (prefixCache.next): an overloaded replica retries its waiting
// requests' admission every step (vLLM's scheduler recomputes the hit each
// time), and prompts run to thousands of blocks, most of them still cached
// where the last retry found them. The result is the lookups' either way.
func (r *Replica) scanPrefix(s *seq, n int) (hit, unpinned int) {
	c := &r.cache
	keys, ents := s.keys[:n], s.ents
	j := 0
	for ; j < len(ents) && j < n; j++ {
		i := ents[j]
		if !c.holds(i, keys[j]) {
			break
		}
		if c.ents[i].refs == 0 {
			unpinned++
		}
	}
	ents = ents[:j]
	prev := nilEntry
	if j > 0 {
		prev = ents[j-1]
	}
	for _, k := range keys[j:] {
		i := c.next(prev, k)
		if i == nilEntry {
			break
		}
		if c.ents[i].refs == 0 {
			unpinned++
		}
		ents = append(ents, i)
		prev = i
	}
	s.ents = ents
	return len(ents), unpinned
}

// Cancel aborts a waiting or running request (its client went away), freeing
// its blocks; cached prompt blocks stay cached, unreferenced. It returns a
// Cancelled event at now, or nil if the request is unknown or already
// finished. Events a Step already returned for the request are not withdrawn:
// the caller drops those dated after the cancellation.
func (r *Replica) Cancel(id uint64, now time.Time) []Event {
	s := r.byID[id]
	if s == nil {
		return nil
	}
	delete(r.byID, id)
	switch {
	case s.running:
		r.release(s)
		r.running = slices.DeleteFunc(r.running, func(x *seq) bool { return x == s })
	case s.group >= 0:
		g := s.group
		r.groups[g] = slices.DeleteFunc(r.groups[g], func(x *seq) bool { return x == s })
	default:
		r.waiting = slices.DeleteFunc(r.waiting, func(x *seq) bool { return x == s })
	}
	r.st.Cancelled++
	n := s.generated
	r.recycle(s)
	return []Event{{Kind: Cancelled, At: now, RequestID: id, N: n}}
}

// KVArrived reports that the KV of remote request id (Request.RemoteKV),
// admitted and waiting since its KVPull event, has arrived at now. Its full
// prompt blocks enter the prefix cache (BlocksStored events at now, as vLLM
// caches the blocks a decode instance received), and it becomes ready to
// run: its next iteration recomputes its last prompt token, for the logits
// of its first output token, as vLLM's scheduler does for a request whose
// remote KV covers its whole prompt. A caller whose last Step returned
// busy=false must call Step again.
func (r *Replica) KVArrived(id uint64, now time.Time) ([]Event, error) {
	s := r.byID[id]
	if s == nil || !s.awaitKV {
		return nil, fmt.Errorf("%w: %d", ErrNotAwaitingKV, id)
	}
	s.awaitKV, s.kvDone = false, true
	r.nAwait--
	pulled := (s.pinned + s.priv) - s.computed/r.cfg.BlockSize
	r.st.KVBlocksPulled += int64(pulled)
	s.computed = s.target - 1
	var ev []Event
	r.store(s, now, &ev)
	return ev, nil
}

// recycle keeps a dead request's state for the next Submit.
func (r *Replica) recycle(s *seq) {
	*s = seq{ents: s.ents[:0]}
	r.spare = append(r.spare, s)
}

// ResetPrefixCache empties the prefix cache, returning an AllCleared event at
// now. Like vLLM's reset_prefix_cache it refuses (nil, false) while requests
// are running, since their blocks are in use.
func (r *Replica) ResetPrefixCache(now time.Time) ([]Event, bool) {
	if len(r.running) > 0 {
		return nil, false
	}
	r.resetSlots()
	for r.cache.nLRU > 0 {
		r.cache.evict()
	}
	if r.cpu != nil {
		// The offloaded copies go too: the AllCleared event empties
		// every tier for whoever applies the events.
		r.cpu.clear()
	}
	return []Event{{Kind: AllCleared, At: now}}, true
}

// CachedPrefix returns how many leading keys of a chain are in the prefix
// cache now (with a slot cache: held by some slot, busy or idle).
func (r *Replica) CachedPrefix(keys []blocks.Key) int {
	if r.slots != nil {
		return r.slotPrefix(keys)
	}
	return r.cache.prefix(keys)
}

// Stats is a snapshot of the replica, the numbers vLLM exports as metrics.
// Counters count since New.
type Stats struct {
	// Running is the number of admitted requests (prefilling or decoding),
	// vLLM's num_requests_running.
	Running int
	// Waiting is the number of requests waiting for admission, preempted
	// ones included, vLLM's num_requests_waiting.
	Waiting int
	// KVUsage is the fraction of KV blocks held by requests, in [0, 1].
	// Cached blocks no request references count as free, as in vLLM's
	// kv_cache_usage_perc.
	// With a slot cache it is the fraction of the context holding KV, idle
	// slots' cache included, as llama.cpp's kv_cache_usage_ratio (see
	// slotStats for the other block figures).
	KVUsage float64
	// TotalBlocks is the KV capacity in blocks.
	TotalBlocks int
	// FreeBlocks is the number of blocks neither cached nor held.
	FreeBlocks int
	// CachedBlocks is the number of blocks in the prefix cache, referenced
	// or not.
	CachedBlocks int
	// EvictableBlocks is the number of cached blocks no request references.
	EvictableBlocks int
	// PrefixCacheQueries is the number of tokens looked up in the prefix
	// cache at admissions (prompt, plus earlier output when resumed), vLLM's
	// prefix_cache_queries.
	PrefixCacheQueries int64
	// PrefixCacheHits is the number of those tokens found (the HitTokens of
	// Admitted events), vLLM's prefix_cache_hits.
	PrefixCacheHits int64
	// Preemptions counts preemptions, vLLM's num_preemptions.
	Preemptions int64
	// Admissions counts admissions, re-admissions after preemption included.
	Admissions int64
	// Finished counts requests that produced all their tokens.
	Finished int64
	// Cancelled counts requests aborted by Cancel.
	Cancelled int64
	// Iterations counts Steps that ran an iteration.
	Iterations int64
	// PromptTokensComputed counts prefill tokens computed, recomputation
	// included.
	PromptTokensComputed int64
	// GenerationTokens counts output tokens produced.
	GenerationTokens int64
	// KVBlocksPulled counts the blocks of remote requests' prompts that
	// came from another replica (KVArrived; Request.RemoteKV).
	KVBlocksPulled int64 `json:",omitempty"`
	// AdapterLoads counts LoRA adapters loaded into a GPU slot, and
	// AdapterEvictions those loads that evicted another adapter
	// (Config.MaxLoras; lora.go).
	AdapterLoads, AdapterEvictions int64 `json:",omitempty"`
	// AdapterLoadTime is the iteration time those loads added.
	AdapterLoadTime time.Duration `json:",omitempty"`
	// OffloadBlocks is the number of blocks in the CPU offload tier
	// (Config.CPUOffloadTokens; offload.go). OffloadStoredBlocks and
	// OffloadEvictedBlocks count the blocks written to it and evicted
	// from it; OffloadLoads counts the admissions that loaded blocks from
	// it, OffloadLoadedTokens their tokens, and OffloadLoadTime the
	// copies' total duration.
	OffloadBlocks                             int           `json:",omitempty"`
	OffloadStoredBlocks, OffloadEvictedBlocks int64         `json:",omitempty"`
	OffloadLoads, OffloadLoadedTokens         int64         `json:",omitempty"`
	OffloadLoadTime                           time.Duration `json:",omitempty"`
	// BusyTime is the total duration of the iterations run.
	BusyTime time.Duration
}

// Stats returns a snapshot of the replica's state and counters.
func (r *Replica) Stats() Stats {
	st := r.st
	st.Running = len(r.running)
	st.Waiting = r.nWaiting()
	st.TotalBlocks = r.nBlocks
	st.FreeBlocks = r.freeBlocks()
	st.CachedBlocks = r.cache.len()
	st.EvictableBlocks = r.cache.nLRU
	st.KVUsage = float64(r.nBlocks-st.FreeBlocks-st.EvictableBlocks) / float64(r.nBlocks)
	if r.slots != nil {
		r.slotStats(&st)
	}
	if r.cpu != nil {
		st.OffloadBlocks = r.cpu.len()
	}
	return st
}

func (r *Replica) nWaiting() int {
	n := len(r.waiting)
	for _, g := range r.groups {
		n += len(g)
	}
	return n
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }
