package replica

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// CPU offloading (Config.CPUOffloadTokens), as vLLM's OffloadingConnector
// with its CPU backend does it (vllm-project/vllm @
// e57c0d427864471fe231b58b2cd9a73453322cb2,
// vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py, and
// vllm/v1/kv_offload/lru_manager.py @ 3a04cf8f14c971435137c3ec572a7803c663673d):
//
//   - Write-through. Every full block a request computes is copied to the
//     CPU tier at the end of the iteration that computed it
//     (OffloadingConnectorScheduler._get_reqs_to_store offloads each
//     request's new full blocks, whatever the GPU cache does later), so a
//     block can be in both tiers; a block already in the tier is not copied
//     again. The copies run on their own stream: they cost the iteration
//     nothing.
//   - LRU. The tier holds CPUOffloadTokens/BlockSize blocks. Storing into a
//     full tier evicts its least recently used blocks that no load is
//     reading (LRUOffloadingManager.prepare_store skips ref_cnt > 0); when
//     not enough can be evicted the request's blocks are not stored this
//     time and are tried again at its next store. A store, and every lookup
//     at admission, "touches" the request's blocks from last to first
//     (LRUOffloadingManager.touch), so a prompt's first block ends up the
//     most recent.
//   - Loads. At admission, the blocks right after the request's GPU hit
//     that the tier holds (consecutive, as LRUOffloadingManager.lookup
//     counts them) are loaded instead of recomputed
//     (get_num_new_matched_tokens; the total hit is capped like a GPU hit,
//     leaving the last token to compute). The request takes GPU blocks for
//     them and waits, out of the batch, while they are copied
//     (WAITING_FOR_REMOTE_KVS); the copy takes their tokens' KV bytes over
//     the tier's bandwidth to the GPU (costmodel.KVBytesOf,
//     costmodel.TierBandwidth for costmodel.MediumCPU), one copy at a time
//     on the replica's host-to-device link. The first Step at or after the
//     copy's end puts the loaded blocks into the GPU prefix cache
//     (BlocksStored, as vLLM caches the blocks of a finished load) and the
//     request prefills the rest. A request whose loadable blocks another
//     request is loading right now waits (vLLM delays it: "hit blocks are
//     being loaded") and the queue goes on without it.
//   - Events. The tier's changes are BlocksStored and BlocksRemoved events
//     with Medium costmodel.MediumCPU, the medium vLLM's CPU backend names
//     (vllm/v1/kv_offload/mediums.py, CPULoadStoreSpec.medium() == "CPU");
//     like vLLM's (OffloadingConnectorScheduler.take_events) they carry no
//     parent. They are dated at the end of the iteration that stored the
//     blocks, the removals first.
//
// Not modelled: vLLM's offloaded block size larger than the GPU's
// (block_size_factor 1 here), a store's own duration before its blocks can
// be looked up, and a load that covers a block-aligned prompt's last block
// (vLLM loads it and recomputes one token; here the cap leaves the whole
// last block to compute, as for a GPU hit).

// cpuTier is the replica's CPU offload tier: an LRU of block keys.
type cpuTier struct {
	capBlocks int
	idx       map[blocks.Key]int32
	ents      []cpuEntry
	slots     []int32
	head      int32 // least recently used
	tail      int32
	// secsPerToken is one token's load time; linkFree is when the
	// host-to-device link finishes the loads queued on it.
	secsPerToken float64
	linkFree     time.Time
	missing      []int32 // scratch: store's blocks to write
}

type cpuEntry struct {
	key, ext   blocks.Key
	refs       int32 // loads reading it
	prev, next int32
}

func newCPUTier(capBlocks int, p costmodel.Profile) *cpuTier {
	return &cpuTier{
		capBlocks:    capBlocks,
		idx:          make(map[blocks.Key]int32),
		head:         nilEntry,
		tail:         nilEntry,
		secsPerToken: costmodel.KVBytesOf(p) / costmodel.TierBandwidth(p, costmodel.MediumCPU),
	}
}

func (t *cpuTier) len() int { return len(t.idx) }

func (t *cpuTier) unlink(i int32) {
	e := &t.ents[i]
	if e.prev != nilEntry {
		t.ents[e.prev].next = e.next
	} else {
		t.head = e.next
	}
	if e.next != nilEntry {
		t.ents[e.next].prev = e.prev
	} else {
		t.tail = e.prev
	}
	e.prev, e.next = nilEntry, nilEntry
}

func (t *cpuTier) pushBack(i int32) {
	e := &t.ents[i]
	e.prev, e.next = t.tail, nilEntry
	if t.tail != nilEntry {
		t.ents[t.tail].next = i
	} else {
		t.head = i
	}
	t.tail = i
}

// touch makes keys the most recently used, the first one last
// (LRUOffloadingManager.touch walks them in reverse).
func (t *cpuTier) touch(keys []blocks.Key) {
	for j := len(keys) - 1; j >= 0; j-- {
		if i, ok := t.idx[keys[j]]; ok && t.tail != i {
			t.unlink(i)
			t.pushBack(i)
		}
	}
}

// prefix is how many leading keys the tier holds.
func (t *cpuTier) prefix(keys []blocks.Key) int {
	for n, k := range keys {
		if _, ok := t.idx[k]; !ok {
			return n
		}
	}
	return len(keys)
}

// loading reports whether a load is reading any of keys.
func (t *cpuTier) loading(keys []blocks.Key) bool {
	for _, k := range keys {
		if i, ok := t.idx[k]; ok && t.ents[i].refs > 0 {
			return true
		}
	}
	return false
}

// ref adds d to the load references of keys, which the tier holds.
func (t *cpuTier) ref(keys []blocks.Key, d int32) {
	for _, k := range keys {
		if i, ok := t.idx[k]; ok {
			t.ents[i].refs += d
		}
	}
}

// store copies the keys of ck it does not hold (ext: the keys their events
// report) into the tier, evicting least recently used unreferenced blocks
// to make room, and appends the removed and then the stored keys' events
// at end. It reports false, storing nothing, when not enough blocks can be
// evicted (LRUOffloadingManager.prepare_store returns None).
func (t *cpuTier) store(ck, ext []blocks.Key, end time.Time, ev *[]Event) bool {
	// The blocks to store are chosen before evicting, as prepare_store
	// does: an eviction may take one of the request's own earlier blocks,
	// which is then simply gone.
	t.missing = t.missing[:0]
	for j, k := range ck {
		if _, ok := t.idx[k]; !ok {
			t.missing = append(t.missing, int32(j))
		}
	}
	need := len(t.missing)
	if need == 0 {
		return true
	}
	evict := need - (t.capBlocks - t.len())
	if evict > 0 {
		n := 0
		for i := t.head; i != nilEntry && n < evict; i = t.ents[i].next {
			if t.ents[i].refs == 0 {
				n++
			}
		}
		if n < evict {
			return false
		}
		removed := make([]blocks.Key, 0, evict)
		for i := t.head; len(removed) < evict; {
			next := t.ents[i].next
			if t.ents[i].refs == 0 {
				removed = append(removed, t.ents[i].ext)
				t.unlink(i)
				delete(t.idx, t.ents[i].key)
				t.slots = append(t.slots, i)
			}
			i = next
		}
		*ev = append(*ev, Event{Kind: BlocksRemoved, At: end, Keys: removed, Medium: costmodel.MediumCPU})
	}
	stored := make([]blocks.Key, 0, need)
	for _, j := range t.missing {
		var i int32
		if n := len(t.slots); n > 0 {
			i = t.slots[n-1]
			t.slots = t.slots[:n-1]
		} else {
			i = int32(len(t.ents))
			t.ents = append(t.ents, cpuEntry{})
		}
		t.ents[i] = cpuEntry{key: ck[j], ext: ext[j], prev: nilEntry, next: nilEntry}
		t.idx[ck[j]] = i
		t.pushBack(i)
		stored = append(stored, ext[j])
	}
	*ev = append(*ev, Event{Kind: BlocksStored, At: end, Keys: stored, Medium: costmodel.MediumCPU})
	return true
}

// clear empties the tier (no load may be reading it).
func (t *cpuTier) clear() {
	clear(t.idx)
	t.ents, t.slots = t.ents[:0], t.slots[:0]
	t.head, t.tail = nilEntry, nilEntry
}

// offload writes s's computed full blocks not yet offloaded through to the
// CPU tier and touches its blocks (OffloadingConnectorScheduler
// ._get_reqs_to_store). full is how many of its keys are computed.
func (r *Replica) offload(s *seq, full int, end time.Time, ev *[]Event) {
	if r.cpu == nil || full <= s.offloaded {
		return
	}
	n0 := len(*ev)
	if !r.cpu.store(s.keys[s.offloaded:full], s.req.Keys[s.offloaded:full], end, ev) {
		return
	}
	for _, e := range (*ev)[n0:] {
		if e.Kind == BlocksStored {
			r.st.OffloadStoredBlocks += int64(len(e.Keys))
		} else {
			r.st.OffloadEvictedBlocks += int64(len(e.Keys))
		}
	}
	s.offloaded = full
	r.cpu.touch(s.keys[:full])
}

// offloadHit is how many of s's blocks after its GPU hit of hit blocks, up
// to maxHit, the CPU tier can load, and whether a load in flight reads
// them (s must then wait).
func (r *Replica) offloadHit(s *seq, hit, maxHit int) (n int, busy bool) {
	if r.cpu == nil || s.req.RemoteKV || hit >= maxHit {
		return 0, false
	}
	n = r.cpu.prefix(s.keys[hit:maxHit])
	if n > 0 && r.cpu.loading(s.keys[hit:hit+n]) {
		return n, true
	}
	return n, false
}

// offloadBlocked reports whether waiting request s would load blocks a
// load in flight is reading (it is skipped this step, as vLLM delays it).
func (r *Replica) offloadBlocked(s *seq) bool {
	if r.cpu == nil || r.nLoading == 0 {
		return false
	}
	B := r.cfg.BlockSize
	maxHit := min(len(s.keys), (s.req.PromptTokens+s.generated-1)/B)
	hit, _ := r.scanPrefix(s, maxHit)
	_, busy := r.offloadHit(s, hit, maxHit)
	return busy
}

// startLoad makes admitted request s, whose GPU hit is hit blocks, load
// the n blocks after it from the CPU tier: it waits out of the batch until
// the copy ends, after the copies queued before it.
func (r *Replica) startLoad(s *seq, hit, n int, now time.Time) {
	r.cpu.ref(s.keys[hit:hit+n], 1)
	tokens := n * r.cfg.BlockSize
	d := time.Duration(float64(tokens) * r.cpu.secsPerToken * float64(time.Second))
	start := now
	if r.cpu.linkFree.After(start) {
		start = r.cpu.linkFree
	}
	s.loadFrom, s.loadN, s.loadEnd = hit, n, start.Add(d)
	s.loading = true
	s.offloaded = hit + n // vLLM's _next_stored_block_idx after a load
	r.cpu.linkFree = s.loadEnd
	r.nLoading++
	r.st.OffloadLoads++
	r.st.OffloadLoadedTokens += int64(tokens)
	r.st.OffloadLoadTime += d
}

// endLoad ends s's load (done: its blocks arrived at now and enter the
// GPU prefix cache; else it was cancelled).
func (r *Replica) endLoad(s *seq, done bool, now time.Time, ev *[]Event) {
	r.cpu.ref(s.keys[s.loadFrom:s.loadFrom+s.loadN], -1)
	s.loading = false
	r.nLoading--
	if done {
		s.computed = (s.loadFrom + s.loadN) * r.cfg.BlockSize
		r.store(s, now, ev)
	}
}

// landLoads ends the loads done by now (their blocks enter the GPU cache,
// dated now), in admission order.
func (r *Replica) landLoads(now time.Time, ev *[]Event) {
	if r.nLoading == 0 {
		return
	}
	for _, s := range r.running {
		if s.loading && !s.loadEnd.After(now) {
			r.endLoad(s, true, now, ev)
		}
	}
}

// nextLoad is the end of the earliest load in flight (nLoading > 0).
func (r *Replica) nextLoad() time.Time {
	var t time.Time
	for _, s := range r.running {
		if s.loading && (t.IsZero() || s.loadEnd.Before(t)) {
			t = s.loadEnd
		}
	}
	return t
}

// OffloadedPrefix returns how many leading keys of a chain the CPU offload
// tier holds (0 without one).
func (r *Replica) OffloadedPrefix(keys []blocks.Key) int {
	if r.cpu == nil {
		return 0
	}
	return r.cpu.prefix(keys)
}
