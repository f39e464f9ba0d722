package kvevents

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// ErrUnknownParent is returned (wrapped) by Index.Apply when a BlockStored
// names a parent block the index does not hold: events were missed, and the
// caller should replay rather than lose the blocks silently. The event is
// skipped; the rest of the batch is applied.
var ErrUnknownParent = errors.New("kvevents: BlockStored with unknown parent block")

// Sink receives the router-key view of a replica's cache changes. The router
// core implements it. Calls for one replica come in event order from one
// goroutine at a time; the keys slice is only valid during the call.
type Sink interface {
	// Stored: the replica now holds keys in medium, a chain whose first key
	// follows parent (hasParent false: the chain starts a prompt). Storing a
	// key already held must be harmless.
	Stored(replica string, parent blocks.Key, hasParent bool, keys []blocks.Key, medium string)
	// Removed: the replica no longer holds keys in medium. A key is reported
	// only when the last engine block that maps to it in that medium is gone.
	Removed(replica string, keys []blocks.Key, medium string)
	// Cleared: the replica holds nothing any more, in any medium.
	Cleared(replica string)
}

// NopSink discards everything; a nil Sink given to Apply means the same.
type NopSink struct{}

// Stored implements Sink.
func (NopSink) Stored(string, blocks.Key, bool, []blocks.Key, string) {}

// Removed implements Sink.
func (NopSink) Removed(string, []blocks.Key, string) {}

// Cleared implements Sink.
func (NopSink) Cleared(string) {}

var _ Sink = NopSink{}

// ApplyStats counts what one Apply did.
type ApplyStats struct {
	// Applied counts events applied, by type name.
	Stored, Removed, Cleared int
	// BlocksStored and BlocksRemoved count engine blocks.
	BlocksStored, BlocksRemoved int
	// UnknownParent counts BlockStored events skipped for an unknown parent.
	UnknownParent int
	// Malformed counts BlockStored events skipped because their token ids do
	// not cover their blocks.
	Malformed int
	// UnknownRemoved counts removed hashes the index did not hold (stored
	// before the stream was followed, or already removed), and the hashes
	// of a slower tier's token-less BlockStored that no medium maps.
	UnknownRemoved int
}

// Add accumulates o into s.
func (s *ApplyStats) Add(o ApplyStats) {
	s.Stored += o.Stored
	s.Removed += o.Removed
	s.Cleared += o.Cleared
	s.BlocksStored += o.BlocksStored
	s.BlocksRemoved += o.BlocksRemoved
	s.UnknownParent += o.UnknownParent
	s.Malformed += o.Malformed
	s.UnknownRemoved += o.UnknownRemoved
}

// Index maps each replica's engine block hashes to prefixlb's router keys.
//
// vLLM's block hash cannot be reproduced by the router (by default SHA-256 over
// a Python pickle), so the router key of a stored block is computed from the
// token ids the event carries, chained after the parent's router key exactly as
// blocks.Keys chains a request's tokens. The map engine hash → router key lets a
// later BlockRemoved, which carries hashes only, be applied. Memory is bounded
// by the replica's cache: a removed block leaves the map, AllBlocksCleared
// empties it.
//
// Blocks are kept apart per medium and per KV-cache group (hybrid models store
// one block per group); the same router key in one medium may be held by
// several engine blocks (different LoRA adapters or extra keys over the same
// tokens), so keys are reference-counted and Removed reports a key only when
// its last engine block in that medium goes.
//
// Index is safe for concurrent use; each replica has its own lock, so
// subscribers of different replicas do not contend.
type Index struct {
	mu       sync.Mutex // guards replicas (the map, not the states)
	replicas map[string]*replicaIndex
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{replicas: make(map[string]*replicaIndex)}
}

type replicaIndex struct {
	mu    sync.Mutex // guards everything below
	slots []*slot
	refs  map[string]map[blocks.Key]int32 // medium → router key → engine blocks
	keys  []blocks.Key                    // scratch for Stored
	gone  []blocks.Key                    // scratch for Removed
}

// slot holds one (medium, group)'s blocks.
type slot struct {
	medium string
	group  int64
	blocks map[uint64]blocks.Key
}

func (ix *Index) replica(name string) *replicaIndex {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	r := ix.replicas[name]
	if r == nil {
		r = &replicaIndex{refs: make(map[string]map[blocks.Key]int32)}
		ix.replicas[name] = r
	}
	return r
}

func (r *replicaIndex) slot(medium string, group *int64, create bool) *slot {
	var g int64
	if group != nil {
		g = *group
	}
	for _, s := range r.slots {
		if s.medium == medium && s.group == g {
			return s
		}
	}
	if !create {
		return nil
	}
	s := &slot{medium: medium, group: g, blocks: make(map[uint64]blocks.Key)}
	r.slots = append(r.slots, s)
	if r.refs[medium] == nil {
		r.refs[medium] = make(map[blocks.Key]int32)
	}
	return s
}

// parentKey finds the router key of an engine hash: first in the same slot,
// then in any (a block offloaded to CPU may chain after a GPU parent; router
// keys do not depend on the medium).
func (r *replicaIndex) parentKey(s *slot, h uint64) (blocks.Key, bool) {
	if k, ok := s.blocks[h]; ok {
		return k, true
	}
	for _, o := range r.slots {
		if k, ok := o.blocks[h]; ok {
			return k, true
		}
	}
	return 0, false
}

// Apply applies events, in order, to replica's map and tells sink (nil: none)
// what changed. An event that cannot be applied is skipped and counted; when
// any BlockStored was skipped for an unknown parent the error wraps
// ErrUnknownParent.
func (ix *Index) Apply(replica string, events []Event, sink Sink) (ApplyStats, error) {
	if sink == nil {
		sink = NopSink{}
	}
	r := ix.replica(replica)
	r.mu.Lock()
	defer r.mu.Unlock()
	var st ApplyStats
	for _, ev := range events {
		switch ev := ev.(type) {
		case BlockStored:
			r.stored(replica, &ev, sink, &st)
		case *BlockStored:
			r.stored(replica, ev, sink, &st)
		case BlockRemoved:
			r.removed(replica, &ev, sink, &st)
		case *BlockRemoved:
			r.removed(replica, ev, sink, &st)
		case AllBlocksCleared, *AllBlocksCleared:
			r.clear()
			sink.Cleared(replica)
			st.Cleared++
		}
	}
	if st.UnknownParent > 0 {
		return st, fmt.Errorf("%w: %d event(s) for replica %s", ErrUnknownParent, st.UnknownParent, replica)
	}
	return st, nil
}

func (r *replicaIndex) stored(replica string, ev *BlockStored, sink Sink, st *ApplyStats) {
	n := len(ev.BlockHashes)
	if n == 0 {
		st.Stored++
		return
	}
	if len(ev.TokenIDs) == 0 && !ev.HasParent && mediumName(ev.Medium) != MediumGPU {
		r.storedByHash(replica, ev, sink, st)
		return
	}
	bs := ev.BlockSize
	if bs <= 0 && len(ev.TokenIDs)%n == 0 {
		bs = len(ev.TokenIDs) / n // block_size missing: infer it
	}
	if bs <= 0 || len(ev.TokenIDs) != n*bs {
		st.Malformed++
		return
	}
	medium := mediumName(ev.Medium)
	s := r.slot(medium, ev.GroupIdx, true)
	var parent blocks.Key
	var keys []blocks.Key
	if ev.HasParent {
		var ok bool
		if parent, ok = r.parentKey(s, ev.ParentHash); !ok {
			st.UnknownParent++
			return
		}
		// blocks.Keys chains after the last key already in dst (the
		// parent's key carries the chain's seed).
		r.keys = blocks.Keys(append(r.keys[:0], parent), ev.TokenIDs, bs)
		keys = r.keys[1:]
	} else {
		r.keys = blocks.SeededKeys(r.keys[:0], seedOf(ev), ev.TokenIDs, bs)
		keys = r.keys
	}
	refs := r.refs[medium]
	for i, h := range ev.BlockHashes {
		k := keys[i]
		if old, ok := s.blocks[h]; ok {
			if old == k {
				continue // stored again: nothing changes
			}
			r.unref(refs, old) // same engine hash, new tokens: rare, keep counts exact
		}
		s.blocks[h] = k
		refs[k]++
	}
	st.Stored++
	st.BlocksStored += n
	sink.Stored(replica, parent, ev.HasParent, keys, medium)
}

// storedByHash applies a slower tier's BlockStored that carries no token
// ids, as vLLM's OffloadingConnector publishes them (take_events: no parent,
// token_ids [], vllm-project/vllm @ e57c0d427864471fe231b58b2cd9a73453322cb2):
// its blocks are copies of blocks the engine computed, whose hashes it
// shares, so each hash takes the router key it has in another medium (the
// GPU's, where the block was computed). A hash no medium maps is counted as
// unknown and skipped.
func (r *replicaIndex) storedByHash(replica string, ev *BlockStored, sink Sink, st *ApplyStats) {
	medium := mediumName(ev.Medium)
	s := r.slot(medium, ev.GroupIdx, true)
	refs := r.refs[medium]
	keys := r.keys[:0]
	for _, h := range ev.BlockHashes {
		k, ok := r.parentKey(s, h)
		if !ok {
			st.UnknownRemoved++
			continue
		}
		if old, ok := s.blocks[h]; ok {
			if old == k {
				continue // stored again: nothing changes
			}
			r.unref(refs, old)
		}
		s.blocks[h] = k
		refs[k]++
		keys = append(keys, k)
	}
	st.Stored++
	st.BlocksStored += len(keys)
	if len(keys) > 0 {
		sink.Stored(replica, 0, false, keys, medium)
	}
	r.keys = keys[:0]
}

func (r *replicaIndex) unref(refs map[blocks.Key]int32, k blocks.Key) bool {
	if refs[k] <= 1 {
		delete(refs, k)
		return true
	}
	refs[k]--
	return false
}

func (r *replicaIndex) removed(replica string, ev *BlockRemoved, sink Sink, st *ApplyStats) {
	st.Removed++
	medium := mediumName(ev.Medium)
	s := r.slot(medium, ev.GroupIdx, false)
	if s == nil {
		st.UnknownRemoved += len(ev.BlockHashes)
		return
	}
	refs := r.refs[medium]
	gone := r.gone[:0]
	for _, h := range ev.BlockHashes {
		k, ok := s.blocks[h]
		if !ok {
			st.UnknownRemoved++
			continue
		}
		delete(s.blocks, h)
		st.BlocksRemoved++
		if r.unref(refs, k) {
			gone = append(gone, k)
		}
	}
	r.gone = gone[:0]
	if len(gone) > 0 {
		sink.Removed(replica, gone, medium)
	}
}

// clear drops the maps, so the memory of a replica's cache is returned.
func (r *replicaIndex) clear() {
	r.slots = nil
	clear(r.refs)
}

// Clear forgets everything replica holds and tells sink (nil: none), as when
// its publisher restarted.
func (ix *Index) Clear(replica string, sink Sink) {
	r := ix.replica(replica)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clear()
	if sink != nil {
		sink.Cleared(replica)
	}
}

// Forget drops replica from the index entirely (it left the pool).
func (ix *Index) Forget(replica string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.replicas, replica)
}

// Held returns how many engine blocks replica holds, by medium (summed over
// KV-cache groups). Media with no blocks are omitted.
func (ix *Index) Held(replica string) map[string]int {
	ix.mu.Lock()
	r := ix.replicas[replica]
	ix.mu.Unlock()
	out := make(map[string]int)
	if r == nil {
		return out
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.slots {
		if len(s.blocks) > 0 {
			out[s.medium] += len(s.blocks)
		}
	}
	return out
}

// Lookup returns the router key of an engine block hash held by replica in
// medium ("" means GPU), in KV-cache group 0.
func (ix *Index) Lookup(replica, medium string, hash uint64) (blocks.Key, bool) {
	ix.mu.Lock()
	r := ix.replicas[replica]
	ix.mu.Unlock()
	if r == nil {
		return 0, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.slot(mediumName(medium), nil, false)
	if s == nil {
		return 0, false
	}
	k, ok := s.blocks[hash]
	return k, ok
}

// Keys returns the distinct router keys replica holds in medium ("" means
// GPU), sorted: what the router's tree should say the replica holds.
func (ix *Index) Keys(replica, medium string) []blocks.Key {
	ix.mu.Lock()
	r := ix.replicas[replica]
	ix.mu.Unlock()
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	refs := r.refs[mediumName(medium)]
	out := make([]blocks.Key, 0, len(refs))
	for k := range refs {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// seedOf is the seed of a chain a BlockStored starts: its LoRA adapter's
// (lora_name, which vLLM folds into the block hashes) or the base model's,
// salted with the cache salt of its first block's extra keys
// (BlockStored.Salt; blocks.SaltedSeed), as a request with that adapter
// and salt is keyed: a salted prompt's blocks land under its own salt's
// keys and are never predicted for another salt or for none. An event
// with only the deprecated lora_id names its adapter "#ID", which no
// request's model matches: its blocks are kept, under their own chain,
// and never predicted as another adapter's or the base model's. Extra
// keys that are not in vLLM's shape salt the chain with their own bytes
// (malformedSalt), which no request's salt is: those blocks are kept
// apart too.
func seedOf(ev *BlockStored) blocks.Seed {
	seed := blocks.BaseSeed
	switch {
	case ev.LoRAName != nil && *ev.LoRAName != "":
		seed = blocks.AdapterSeed(*ev.LoRAName)
	case ev.LoRAID != nil && *ev.LoRAID != 0:
		seed = blocks.AdapterSeed("#" + strconv.FormatInt(*ev.LoRAID, 10))
	}
	salt, ok := ev.Salt()
	if !ok {
		salt = malformedSalt + string(ev.ExtraKeys)
	}
	return blocks.SaltedSeed(seed, salt)
}

// malformedSalt starts the salt seedOf gives a chain whose extra keys it
// cannot read: a NUL byte, which vLLM's salts (request body strings, as
// clients send them) do not start with in practice.
const malformedSalt = "\x00prefixlb:unreadable extra_keys:"
