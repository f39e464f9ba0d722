package replica

import (
	"hash/fnv"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// LoRA adapters (Config.MaxLoras, Request.Adapter), as vLLM serves them:
//
//   - The replica holds at most MaxLoras adapters in GPU slots (vLLM's
//     --max-loras). A request for an adapter that is not in a slot is
//     admitted only when the running requests use fewer than MaxLoras
//     adapters; otherwise it is skipped, and the requests behind it may be
//     admitted (vLLM v1 Scheduler.schedule: "Scheduling would exceed
//     max_loras, skip"). It waits in the queue meanwhile.
//   - Admitting it loads the adapter into a free slot or, when all are
//     taken, into the least recently used slot no running request uses
//     (vLLM's LRUCacheWorkerLoRAManager; an adapter in use by a running
//     request is never evicted). The load takes the profile's
//     costmodel.AdapterLoad for Request.AdapterBytes and is added to the
//     iteration that admits the request: vLLM activates a batch's adapters
//     before its forward pass, so every request of that step waits for it.
//   - The prefix cache never matches across adapters, nor between an adapter
//     and the base model: vLLM folds the adapter's name into the hash of
//     every block of an adapter's request (vllm/v1/core/kv_cache_utils.py,
//     generate_block_hash_extra_keys puts lora_request.lora_name first among
//     a block's extra keys, and hash_block_tokens hashes (parent, tokens,
//     extra keys); vllm-project/vllm at 001cabc1be16a59a70d720ed61a13b678c060a18).
//     The replica keys its cache by the request's keys mixed with the
//     adapter (a mix of its name into each key), whatever keys the caller gave; its cache events
//     report the caller's keys, with the adapter (Event.Adapter) on
//     BlocksStored as vLLM's BlockStored carries lora_name. A caller whose
//     keys are already adapter-specific therefore sees the events as a
//     faithful copy of the cache.
//
// With MaxLoras 0 adapters are not modelled as slots (every adapter is
// resident, no load) but caches still keep them apart.

// loraSlot is one adapter held in a GPU slot.
type loraSlot struct {
	name    string
	running int    // running requests using it
	used    uint64 // LRU clock of its last admission or release
}

// adapterSeed is the seed an adapter's cache keys are mixed with (FNV-1a
// of its name); 0 for the base model.
func adapterSeed(adapter string) uint64 {
	if adapter == "" {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(adapter))
	return h.Sum64() | 1
}

// adapterKey mixes key k with an adapter's seed (splitmix64's finalizer of
// their xor): injective for a given seed, and unrelated between seeds, so a
// key of one adapter never equals a key of another or of the base model
// except by a 64-bit collision.
func adapterKey(k blocks.Key, seed uint64) blocks.Key {
	x := uint64(k) ^ seed
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return blocks.Key(x)
}

// saltSeed is the seed a salted request's cache keys are mixed with
// (FNV-1a of the salt, apart from adapters' names); 0 for no salt. vLLM
// folds cache_salt into the hash of a prompt's first block
// (generate_block_hash_extra_keys, at
// 001cabc1be16a59a70d720ed61a13b678c060a18), and so into every block
// after it: salted prefixes are never shared across salts.
func saltSeed(salt string) uint64 {
	if salt == "" {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte("salt\x00"))
	h.Write([]byte(salt))
	return h.Sum64() | 1
}

// cacheKeys returns the keys req's blocks have in the prefix cache: its
// own, or for an adapter's or a salted request a mixed copy (reusing dst).
func cacheKeys(dst []blocks.Key, req *Request) []blocks.Key {
	if req.Adapter == "" && req.Salt == "" {
		return req.Keys
	}
	seed := adapterSeed(req.Adapter) ^ saltSeed(req.Salt)
	if seed == 0 {
		seed = 1 // an adapter and a salt that cancel: still apart
	}
	dst = dst[:0]
	for _, k := range req.Keys {
		dst = append(dst, adapterKey(k, seed))
	}
	return dst
}

// loraSlotOf returns the index of adapter's slot, or -1.
func (r *Replica) loraSlotOf(adapter string) int {
	for i := range r.loras {
		if r.loras[i].name == adapter {
			return i
		}
	}
	return -1
}

// loraBlocked reports whether s cannot be admitted now for its adapter: it
// needs one that is not resident while the running requests already use
// MaxLoras adapters.
func (r *Replica) loraBlocked(s *seq) bool {
	a := s.req.Adapter
	if a == "" || r.cfg.MaxLoras == 0 || r.loraSlotOf(a) >= 0 {
		return false
	}
	active := 0
	for i := range r.loras {
		if r.loras[i].running > 0 {
			active++
		}
	}
	return active >= r.cfg.MaxLoras
}

// loraAcquire marks s's adapter in use by one more running request, loading
// it first when it is not resident (evicting the least recently used idle
// adapter when the slots are full); the load's time goes to the iteration
// being scheduled. loraBlocked(s) must be false.
func (r *Replica) loraAcquire(s *seq, now time.Time, ev *[]Event) {
	a := s.req.Adapter
	if a == "" || r.cfg.MaxLoras == 0 {
		return
	}
	r.loraClock++
	i := r.loraSlotOf(a)
	if i < 0 {
		if len(r.loras) < r.cfg.MaxLoras {
			r.loras = append(r.loras, loraSlot{})
			i = len(r.loras) - 1
		} else {
			i = -1
			for j := range r.loras {
				if r.loras[j].running == 0 && (i < 0 || r.loras[j].used < r.loras[i].used) {
					i = j
				}
			}
			if i < 0 {
				panic("replica: internal error: every adapter slot is in use")
			}
			r.st.AdapterEvictions++
			*ev = append(*ev, Event{Kind: AdapterEvicted, At: now, Adapter: r.loras[i].name})
		}
		d := costmodel.AdapterLoadOf(r.cfg.Profile).Time(s.req.AdapterBytes)
		r.loadTime += d
		r.st.AdapterLoads++
		r.st.AdapterLoadTime += d
		r.loras[i] = loraSlot{name: a}
		*ev = append(*ev, Event{Kind: AdapterLoaded, At: now, RequestID: s.req.ID, Adapter: a})
	}
	r.loras[i].running++
	r.loras[i].used = r.loraClock
}

// loraRelease drops running request s's use of its adapter.
func (r *Replica) loraRelease(s *seq) {
	a := s.req.Adapter
	if a == "" || r.cfg.MaxLoras == 0 {
		return
	}
	if i := r.loraSlotOf(a); i >= 0 {
		r.loraClock++
		r.loras[i].running--
		r.loras[i].used = r.loraClock
	}
}

// Adapters appends to dst the adapters in the replica's GPU slots, most
// recently used first (ties: in use first), and returns it: what vLLM
// would list as loaded. Empty with MaxLoras 0.
func (r *Replica) Adapters(dst []string) []string {
	idx := make([]int, len(r.loras))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		x, y := &r.loras[a], &r.loras[b]
		switch {
		case x.used != y.used:
			if x.used > y.used {
				return -1
			}
			return 1
		case x.running != y.running:
			return y.running - x.running
		}
		return 0
	})
	for _, i := range idx {
		dst = append(dst, r.loras[i].name)
	}
	return dst
}

// RunningAdapters appends to dst the adapters running requests use, in
// slot order (vllm:lora_requests_info's running_lora_adapters).
func (r *Replica) RunningAdapters(dst []string) []string {
	for i := range r.loras {
		if r.loras[i].running > 0 {
			dst = append(dst, r.loras[i].name)
		}
	}
	return dst
}

// WaitingAdapters appends to dst the distinct adapters of the waiting
// requests, in queue order (vllm:lora_requests_info's
// waiting_lora_adapters), and returns it. Empty with MaxLoras 0.
func (r *Replica) WaitingAdapters(dst []string) []string {
	if r.cfg.MaxLoras == 0 {
		return dst
	}
	n := len(dst)
	add := func(s *seq) {
		if a := s.req.Adapter; a != "" && !slices.Contains(dst[n:], a) {
			dst = append(dst, a)
		}
	}
	for _, s := range r.waiting {
		add(s)
	}
	for _, g := range r.groups {
		for _, s := range g {
			add(s)
		}
	}
	return dst
}

// CachedPrefixFor is CachedPrefix for the keys of an adapter's request
// (Request.Adapter): how many leading keys its prefix cache holds for that
// adapter.
func (r *Replica) CachedPrefixFor(adapter string, keys []blocks.Key) int {
	return r.CachedPrefixAs(adapter, "", keys)
}

// CachedPrefixAs is CachedPrefix for the keys of a request of adapter
// with cache salt salt (Request.Adapter, Request.Salt): how many leading
// keys its prefix cache holds for them.
func (r *Replica) CachedPrefixAs(adapter, salt string, keys []blocks.Key) int {
	if r.slots != nil || (adapter == "" && salt == "") {
		return r.CachedPrefix(keys)
	}
	return r.cache.prefix(cacheKeys(nil, &Request{Keys: keys, Adapter: adapter, Salt: salt}))
}
