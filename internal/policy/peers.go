package policy

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// The peers' policies below restate the peers' code at the commits their
// doc comments name (repository, path @ commit). Where they depart from it,
// the comment says so and why.

// LLMDPrecise is llm-d's precise prefix-cache scorer set: the
// "precise-prefix-cache-scorer" (llm-d/llm-d-inference-scheduler
// pkg/plugins/scorer/precise_prefix_cache.go @
// 17abea8af978e6d8b49ac03834e0317884f07525, its kv-cache index fed by the
// engines' KV events) with GIE's queue and KV-cache utilization scorers,
// weighted as in llm-d's published benchmark and GIE's default profile
// (kubernetes-sigs/gateway-api-inference-extension
// pkg/epp/config/loader/defaults.go @ 0c8fd519270ebd8422e0bbbfc03ac4d91fc2f1b0;
// llm-d/llm-d guides/precise-prefix-cache-aware/gaie-kv-events/values.yaml @
// bf8659b23aa1be08300ebf47c6e7d31a6c570f47):
//
//	score(r) = 3·prefix(r) + 2·kv(r) + 2·queue(r)
//
// prefix: each replica's longest run of the request's blocks from block 0
// that it holds, in any cache tier, each block weighted by its tier (gpu
// 1.0, cpu 0.8; precisePrefixScores) (llm-d/llm-d-kv-cache
// pkg/kvcache/kvblock_scorer.go @
// 24d82ea07f5e1b454da8ccd2eef8672c718dfc77, LongestPrefixScorer), normalised
// min-max over the replicas with any hit (llm-d-inference-scheduler
// pkg/plugins/scorer/utils.go @ 2202f3ca54371e64d835b2257a4bb802b2184ecb,
// indexedScoresToNormalizedScoredPods): (m − min)/(max − min), 1 for all when
// min = max, 0 for a replica with no hit. So a lone replica with any hit
// scores 1, and the one with the fewest hits among several scores 0, like
// those with none. The minimum is taken over the up replicas (the
// candidates), as the plugin's speculative path does (it looks up only the
// candidate endpoints); its non-speculative path scores every pod the index
// knows, so there a pod that is not a candidate can set the minimum too.
//
// kv and queue: see scoreLLMD. Scores are clamped to [0,1] and summed with
// the weights (GIE pkg/epp/scheduling/framework/scheduler_profile.go @
// b41c483eb9a1b32ec33587e91b73c0d68fb86e6e); the highest wins, ties at random
// (GIE's max-score picker shuffles, then stable-sorts:
// pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go @
// 45e59d012825971008b10dd3492744f516e434f5; here a reservoir sample).
//
// llm-d's newest precise guide (llm-d/llm-d
// guides/precise-prefix-cache-aware/scheduler/precise-prefix-cache-aware.values.yaml
// @ 955190d9d24fb78d8fb8d0bee3d7e6af4e5beb71) weighs 2/1/1 and turns
// speculativeIndexing on: "llmd-precise:prefix_weight=2:kv_weight=1:queue_weight=1:speculative=true".
type LLMDPrecise struct {
	// PrefixWeight, KVWeight and QueueWeight weigh the prefix, KV-cache
	// utilization and queue scorers (3, 2, 2).
	PrefixWeight, KVWeight, QueueWeight float64
	// SpeculativeIndexing is the plugin's speculativeIndexing (default
	// false): a routed prompt counts as cached on its replica until the
	// engine's events confirm it (the router's speculative entries; see
	// Speculator).
	SpeculativeIndexing bool
	name                string
	prefix              []float64
}

var (
	_ Policy     = (*LLMDPrecise)(nil)
	_ Speculator = (*LLMDPrecise)(nil)
)

// NewLLMDPrecise returns llm-d's precise scorer with weights 3/2/2 and no
// speculative indexing (the plugin's default).
func NewLLMDPrecise() *LLMDPrecise {
	return &LLMDPrecise{PrefixWeight: 3, KVWeight: 2, QueueWeight: 2, name: "llmd-precise"}
}

// Name implements Policy.
func (p *LLMDPrecise) Name() string { return p.name }

// Speculative implements Speculator: the plugin's speculativeIndexing.
func (p *LLMDPrecise) Speculative() bool { return p.SpeculativeIndexing }

// Route implements Policy.
func (p *LLMDPrecise) Route(req *Request, v *View, now time.Time) (Decision, error) {
	p.prefix = precisePrefixScores(p.prefix, req, v)
	return scoreLLMD(req, v, p.prefix, v.Match.PerReplica, p.PrefixWeight, p.KVWeight, p.QueueWeight, "llmd-precise")
}

// precisePrefixScores fills dst (resized) with the precise scorer's prefix
// score of each replica: its tier-weighted matched blocks normalised min-max
// over the up replicas with any (LLMDPrecise's doc comment gives the
// source). llm-d's index keeps each block's medium, lowercased, and its
// LongestPrefixScorer walks the longest run of the request's blocks from
// block 0 that a pod holds in any tier, adding per block the largest weight
// among the tiers holding it (llm-d/llm-d-kv-cache
// pkg/kvcache/kvblock_scorer.go @ 24d82ea07f5e1b454da8ccd2eef8672c718dfc77,
// getMaxWeight), with the default weights gpu 1.0 and cpu 0.8 and 1.0 for
// a medium it has no weight for (pkg/kvcache/backend.go @
// daca7db40021c590c0fb4354b45e0f08f643dce3, DefaultKVCacheBackendConfig).
// Here the run is the GPU match, then the blocks after it that the replica
// holds in slower tiers (View.TierSplit): host memory at 0.8, any other
// tier at 1.0:
//
//	w(r) = gpu blocks + 0.8 · CPU blocks + 1.0 · other-tier blocks
//
// A block held on the GPU again after a block held only in a slower tier is
// not counted (the router's tier walk stops at the first block it does not
// hold in a tier); with write-through offloading such a block is in the CPU
// tier too. With req nil (llmd-pd's pools, which renumber the replicas) only
// the GPU match counts.
func precisePrefixScores(dst []float64, req *Request, v *View) []float64 {
	dst = resize(dst, len(v.Replicas))
	lo, hi := math.Inf(1), 0.0
	for i := range v.Replicas {
		dst[i] = 0
		if !v.Replicas[i].Up {
			continue
		}
		w := llmdTierWeighted(req, v, i)
		dst[i] = w
		if w > 0 {
			lo, hi = min(lo, w), max(hi, w)
		}
	}
	for i := range v.Replicas {
		w := dst[i]
		switch {
		case !v.Replicas[i].Up || w == 0:
			dst[i] = 0
		case hi == lo:
			dst[i] = 1
		default:
			dst[i] = (w - lo) / (hi - lo)
		}
	}
	return dst
}

// LLMDCPUTierWeight is llm-d's default scoring weight of a block held in
// CPU memory, against 1.0 on the GPU and for a medium without a weight
// (llm-d/llm-d-kv-cache pkg/kvcache/backend.go @
// daca7db40021c590c0fb4354b45e0f08f643dce3, DefaultKVCacheBackendConfig).
const LLMDCPUTierWeight = 0.8

// llmdTierWeighted is replica r's tier-weighted longest prefix in blocks
// (precisePrefixScores); without tier sets, its GPU-matched blocks.
func llmdTierWeighted(req *Request, v *View, r int) float64 {
	m := at(v.Match.PerReplica, r)
	w := float64(m)
	if v.TierSplit == nil || req == nil {
		return w
	}
	bt := v.BlockTokens()
	host, other := v.TierSplitOf(r, req, m*bt)
	if host == 0 && other == 0 {
		return w
	}
	return w + (LLMDCPUTierWeight*float64(host)+float64(other))/float64(bt)
}

// scoreLLMD sums GIE's weighted scorers, given each replica's prefix score
// (in [0,1]) and the blocks it is believed to hold, and picks the highest:
//
//   - kv = 1 − KV-cache usage (vllm:kv_cache_usage_perc): GIE
//     pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization/kvcache_utilization.go
//     @ 33173e4c83e87fece15b50f3ded861a3c0edb0ea. Unknown usage reads as 0
//     (score 1), as GIE's unscraped metrics do.
//   - queue = (maxQ − q)/(maxQ − minQ) over the up replicas, 1 for all when
//     equal, with q = the waiting queue only (Replica.Queue): GIE
//     pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go @
//     cb1c67d325c9335dfa867050f81c1624ac8340ac reads WaitingQueueSize,
//     filled from vllm:num_requests_waiting
//     (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go @
//     1cf544386df8c93bf3e07fb42b7ef995bf0ea59a; SGLang: sglang:num_queue_reqs).
//
// Each score is clamped to [0,1] before weighting (scheduler_profile.go's
// enforceScoreRange). Scores within 1e-12 of the best tie, and ties are
// broken uniformly at random.
func scoreLLMD(req *Request, v *View, prefix []float64, matched []int, wp, wkv, wq float64, branch string) (Decision, error) {
	return scoreGIE(req, v, prefix, matched, wp, wkv, wq, 0, nil, branch)
}

// scoreGIE is scoreLLMD with one more scorer, extra (in [0,1]) at weight
// we, added last (gie-lora's lora-affinity).
func scoreGIE(req *Request, v *View, prefix []float64, matched []int, wp, wkv, wq, we float64,
	extra func(rp *Replica) float64, branch string) (Decision, error) {
	minQ, maxQ := math.MaxInt, -1
	for i := range v.Replicas {
		if !v.Replicas[i].Up {
			continue
		}
		q := v.Replicas[i].Queue()
		minQ, maxQ = min(minQ, q), max(maxQ, q)
	}
	if maxQ < 0 {
		return Decision{}, ErrNoReplica
	}
	d := Decision{Branch: branch, Replica: -1, Candidates: make([]Candidate, 0, len(v.Replicas))}
	top := newArgmax()
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		pre := 0.0
		if i < len(prefix) {
			pre = clamp01(prefix[i])
		}
		kv := 1.0
		if rp.KVUsage >= 0 && finite(rp.KVUsage) {
			kv = 1 - clamp01(rp.KVUsage)
		}
		queue := 1.0
		if maxQ > minQ {
			queue = float64(maxQ-rp.Queue()) / float64(maxQ-minQ)
		}
		s := wp*pre + wkv*kv + wq*queue
		if extra != nil {
			s += we * extra(rp)
		}
		m := min(at(matched, i)*v.BlockTokens(), req.PromptTokens)
		d.Candidates = append(d.Candidates, Candidate{Replica: i, MatchedTokens: m, Score: s})
		top.offer(&d, v.Rand, i, m, s)
	}
	return d, nil
}

// argmax keeps a decision's best-scoring candidate as they are offered,
// ties (within 1e-12) broken uniformly at random by reservoir sampling, as
// GIE's max-score picker does.
type argmax struct {
	best float64
	ties int
}

func newArgmax() argmax { return argmax{best: math.Inf(-1)} }

// offer considers replica i, with m matched tokens, at score s.
func (a *argmax) offer(d *Decision, rng *rand.Rand, i, m int, s float64) {
	switch {
	case s > a.best+1e-12:
		a.best, a.ties = s, 1
		d.Replica, d.MatchedTokens = i, m
	case math.Abs(s-a.best) <= 1e-12:
		a.ties++
		if rng.IntN(a.ties) == 0 {
			d.Replica, d.MatchedTokens = i, m
		}
	}
}

// LLMDApprox is the Gateway API Inference Extension's approximate
// "prefix-cache-scorer", llm-d's approximate prefix-cache routing
// (kubernetes-sigs/gateway-api-inference-extension
// pkg/epp/scheduling/framework/plugins/prefixcachescorer/plugin.go @
// a172f54a01a5d54ae4933897316a175f880c30ad, its index
// pkg/epp/framework/plugins/scheduling/scorer/prefix/indexer.go @
// 66e1934970fc9fa4da073cfdb5091b2c578030e9), with GIE's KV-cache and queue
// scorers (scoreLLMD), weighted 1/1/1 as in llm-d's published benchmark of
// "approximate".
//
// The index is the router's own record of what it sent where: per replica an
// LRU of block keys (capacity: the replica's KV capacity in blocks, GIE's
// AutoTune default reading CacheNumGPUBlocks, else 31,250), and for each key
// the replicas whose LRU holds it. It knows nothing of the engines'
// evictions. Only a prompt's first MaxPrefixBlocks blocks (256) are hashed,
// matched and recorded. The match walks the request's blocks from the first
// and stops at the first block no replica holds, crediting each replica
// with every block it holds along the way (not necessarily a run: a prompt's
// LRU entries are added first block first, so its head is evicted before its
// tail). prefix = credited blocks / hashed blocks, a fraction (no min-max).
type LLMDApprox struct {
	// PrefixWeight, KVWeight and QueueWeight weigh the scorers (1, 1, 1).
	PrefixWeight, KVWeight, QueueWeight float64
	// MaxPrefixBlocks bounds the blocks of a prompt that are matched and
	// recorded (GIE's maxPrefixBlocksToMatch, 256; ≤ 0: no bound).
	MaxPrefixBlocks int
	// capacity is every replica's LRU capacity in blocks; 0: each replica's
	// KV capacity (View.KVCapacityOf, GIE's AutoTune).
	capacity int
	idx      gieIndex
	name     string
	prefix   []float64
	matched  []int
}

var (
	_ Policy   = (*LLMDApprox)(nil)
	_ Observer = (*LLMDApprox)(nil)
)

// GIE's prefix-cache-scorer defaults (plugin.go @ a172f54a01a5d54ae4933897316a175f880c30ad).
const (
	gieMaxPrefixBlocks = 256   // DefaultMaxPrefixBlocks
	gieLRUCapacity     = 31250 // DefaultLRUCapacityPerServer: a replica with no KV capacity known
)

// NewLLMDApprox returns the approximate scorer over keys of blockTokens
// tokens. capacityBlocks > 0 bounds every replica's LRU at that many blocks
// (GIE with AutoTune off); 0 sizes each replica's LRU at its own KV capacity
// (View.KVCapacityOf(r) / View.BlockTokens(): the engine's figure, else
// the profile's, read when the replica is first recorded, as GIE reads
// CacheNumGPUBlocks — vllm:cache_config_info's num_gpu_blocks — when it
// creates a pod's LRU).
func NewLLMDApprox(blockTokens, capacityBlocks int) (*LLMDApprox, error) {
	if blockTokens < 1 {
		return nil, fmt.Errorf("policy: llmd-approx: block tokens must be ≥ 1, got %d", blockTokens)
	}
	if capacityBlocks < 0 {
		return nil, fmt.Errorf("policy: llmd-approx: per-replica history capacity must be ≥ 0 blocks (0: each replica's KV capacity), got %d", capacityBlocks)
	}
	return &LLMDApprox{
		PrefixWeight: 1, KVWeight: 1, QueueWeight: 1,
		MaxPrefixBlocks: gieMaxPrefixBlocks,
		capacity:        capacityBlocks,
		idx:             gieIndex{holders: make(map[blocks.Key]prefixtree.Set)},
		name:            "llmd-approx",
	}, nil
}

// Name implements Policy.
func (p *LLMDApprox) Name() string { return p.name }

// hashed is the part of req's keys GIE hashes.
func (p *LLMDApprox) hashed(req *Request) []blocks.Key {
	if p.MaxPrefixBlocks > 0 && len(req.Keys) > p.MaxPrefixBlocks {
		return req.Keys[:p.MaxPrefixBlocks]
	}
	return req.Keys
}

// Route implements Policy.
func (p *LLMDApprox) Route(req *Request, v *View, now time.Time) (Decision, error) {
	keys := p.hashed(req)
	p.matched = resize(p.matched, len(v.Replicas))
	p.idx.match(keys, p.matched)
	p.prefix = resize(p.prefix, len(v.Replicas))
	if len(keys) > 0 {
		for i, m := range p.matched {
			p.prefix[i] = float64(m) / float64(len(keys))
		}
	}
	return scoreLLMD(req, v, p.prefix, p.matched, p.PrefixWeight, p.KVWeight, p.QueueWeight, "llmd-approx")
}

// capacityOf is replica r's LRU capacity in blocks.
func (p *LLMDApprox) capacityOf(v *View, r int) int {
	if p.capacity > 0 {
		return p.capacity
	}
	if c := v.KVCapacityOf(r) / v.BlockTokens(); c > 0 {
		return c
	}
	return gieLRUCapacity
}

// Routed implements Observer: the decision enters the index (GIE's
// PreRequest).
func (p *LLMDApprox) Routed(req *Request, d *Decision, v *View, now time.Time) {
	if d.Replica < 0 {
		return
	}
	p.idx.add(p.hashed(req), d.Replica, p.capacityOf(v, d.Replica))
}

// FirstToken implements Observer.
func (p *LLMDApprox) FirstToken(uint64, int, time.Duration, time.Time) {}

// Finished implements Observer.
func (p *LLMDApprox) Finished(uint64, int, int, bool, time.Time) {}

// ReplicaDown implements Observer: the replica's LRU is dropped (GIE's
// RemovePod, which its pod clean-up runs for pods that left the pool).
func (p *LLMDApprox) ReplicaDown(r int, now time.Time) { p.idx.removeReplica(r) }

// gieIndex is GIE's approximate prefix index (indexer.go): for each block
// key the replicas that hold it, and per replica an LRU of the keys it holds
// whose evictions remove the replica from the key's holders.
type gieIndex struct {
	holders map[blocks.Key]prefixtree.Set
	lrus    []*keyLRU // by replica; nil until the replica is first recorded
}

// match adds to counts[r] the blocks of keys replica r holds, walking from
// the first key until one that no replica holds (matchLongestPrefix).
func (x *gieIndex) match(keys []blocks.Key, counts []int) {
	for _, k := range keys {
		s, ok := x.holders[k]
		if !ok || s.Empty() {
			return
		}
		s.Each(func(r int) {
			if r < len(counts) {
				counts[r]++
			}
		})
	}
}

// add records keys on replica r, in order, creating r's LRU with capacity
// blocks if it has none (indexer.Add).
func (x *gieIndex) add(keys []blocks.Key, r int, capacity int) {
	for len(x.lrus) <= r {
		x.lrus = append(x.lrus, nil)
	}
	l := x.lrus[r]
	if l == nil {
		l = newKeyLRU(max(capacity, 1))
		x.lrus[r] = l
	}
	for _, k := range keys {
		if old, evicted := l.add(k); evicted {
			x.drop(old, r)
		}
		if s := x.holders[k]; !s.Has(r) {
			s.Add(r)
			x.holders[k] = s
		}
	}
}

// drop removes r from k's holders.
func (x *gieIndex) drop(k blocks.Key, r int) {
	s, ok := x.holders[k]
	if !ok {
		return
	}
	s.Remove(r)
	if s.Empty() {
		delete(x.holders, k)
	} else {
		x.holders[k] = s
	}
}

// removeReplica forgets everything r holds (indexer.RemovePod).
func (x *gieIndex) removeReplica(r int) {
	if r < 0 || r >= len(x.lrus) || x.lrus[r] == nil {
		return
	}
	for _, e := range x.lrus[r].e {
		x.drop(e.key, r)
	}
	x.lrus[r] = nil
}

// keyLRU is a fixed-capacity LRU set of block keys (hashicorp/golang-lru's
// Cache as GIE uses it: adding a present key moves it to the front; adding a
// new one to a full cache evicts the least recently added or refreshed).
type keyLRU struct {
	capacity   int
	slot       map[blocks.Key]int32
	e          []lruEntry
	head, tail int32 // head: most recent; -1 when empty
}

type lruEntry struct {
	key        blocks.Key
	prev, next int32
}

func newKeyLRU(capacity int) *keyLRU {
	return &keyLRU{capacity: capacity, slot: make(map[blocks.Key]int32), head: -1, tail: -1}
}

// add puts k at the front and returns the key it evicted, if any.
func (l *keyLRU) add(k blocks.Key) (blocks.Key, bool) {
	if i, ok := l.slot[k]; ok {
		l.unlink(i)
		l.pushFront(i)
		return 0, false
	}
	if len(l.e) < l.capacity {
		i := int32(len(l.e))
		l.e = append(l.e, lruEntry{key: k})
		l.slot[k] = i
		l.pushFront(i)
		return 0, false
	}
	i := l.tail
	old := l.e[i].key
	l.unlink(i)
	delete(l.slot, old)
	l.e[i].key = k
	l.slot[k] = i
	l.pushFront(i)
	return old, true
}

func (l *keyLRU) pushFront(i int32) {
	l.e[i].prev, l.e[i].next = -1, l.head
	if l.head >= 0 {
		l.e[l.head].prev = i
	}
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
}

func (l *keyLRU) unlink(i int32) {
	e := &l.e[i]
	if e.prev >= 0 {
		l.e[e.prev].next = e.next
	} else {
		l.head = e.next
	}
	if e.next >= 0 {
		l.e[e.next].prev = e.prev
	} else {
		l.tail = e.prev
	}
	e.prev, e.next = -1, -1
}

// history is a router's own record of what it sent where: a private prefix
// tree whose "cached" marks mean "routed there", bounded per replica by LRU
// (deepest blocks first, so each replica's record stays prefix-closed).
// SGLang's router keeps this instead of listening to the engines.
type history struct {
	tree     *prefixtree.Tree
	capacity int // blocks per replica
	m        prefixtree.Match
}

func newHistory(blockTokens, capacityBlocks int) (*history, error) {
	if capacityBlocks < 1 {
		return nil, fmt.Errorf("policy: per-replica history capacity must be ≥ 1 block, got %d", capacityBlocks)
	}
	t, err := prefixtree.New(prefixtree.Config{BlockTokens: blockTokens}, 0)
	if err != nil {
		return nil, err
	}
	return &history{tree: t, capacity: capacityBlocks}, nil
}

// lookup returns, per replica slot of v, the blocks of req the history says
// the replica holds.
func (h *history) lookup(req *Request, v *View) []int {
	for h.tree.Replicas() < len(v.Replicas) {
		h.tree.AddReplica()
	}
	h.tree.Lookup(req.Keys, &h.m)
	return h.m.PerReplica
}

// record notes that req was sent to r at now.
func (h *history) record(req *Request, r int, now time.Time) {
	if r < 0 {
		return
	}
	for h.tree.Replicas() <= r {
		h.tree.AddReplica()
	}
	h.tree.Insert(req.Keys, now, &h.m)
	h.tree.SetPathCached(h.m.Path, r, now)
	if over := h.tree.CachedBlocks(r) - h.capacity; over > 0 {
		h.tree.EvictLRU(r, over, now)
	}
}

func (h *history) forget(r int) {
	if r < h.tree.Replicas() {
		h.tree.ClearReplica(r)
	}
}

// SGLang's router defaults: cache_threshold 0.3, balance_abs_threshold 64,
// balance_rel_threshold 1.5, max_tree_size 2^26 (sgl-project/sglang
// sgl-model-gateway/bindings/python/src/sglang_router/router_args.py @
// 6614f98405b9d58cf284fd1494dd9322e9d44f76, and the same in the Rust CLI,
// sgl-model-gateway/src/main.rs @ f47e04e04c2a9408b8b106fb62612daa45d4b067;
// CacheAwareConfig::default() in src/policies/mod.rs @
// 01f6c92a0ae883504466f0be6235eb8e70651c46 has 0.5/32/1.1, but the CLI's are
// what users get).
const (
	sglangCacheThreshold = 0.3
	sglangBalanceAbs     = 64
	sglangBalanceRel     = 1.5
	sglangMaxTreeChars   = 1 << 26
	// charsPerToken converts SGLang's character budget to tokens: GIE's
	// estimate for the same purpose (averageCharactersPerToken, plugin.go
	// @ a172f54a01a5d54ae4933897316a175f880c30ad).
	charsPerToken = 4
)

// SGLang is SGLang's cache-aware router (sgl-project/sglang
// sgl-model-gateway/src/policies/cache_aware.rs @
// b93974f140de1e545d9134d87e77f0bd1fbf3014; the same rules in its successor,
// lightseekorg/smg model_gateway/src/policies/cache_aware.rs @
// 1cb059334667fd685127f616d08028b98f5863fc):
//
//   - load = the router's own in-flight count per replica; the cluster is
//     imbalanced when max − min > BalanceAbs and max > BalanceRel·min; then
//     the least loaded replica wins (branch "balance");
//   - else the replica with the longest match in the router's history tree
//     wins if its match covers strictly more than MatchThreshold of the
//     prompt (branch "cache");
//   - else the least loaded (branch "least-load").
//
// Least loaded: ties to the lowest ID, as Rust's min_by_key over the
// healthy workers in list order. Several replicas with the longest match:
// SGLang takes the first tenant its tree node's hash map yields (smg caches
// it on the node) — arbitrary per prefix, but the same one every time; here
// rendezvous hashing of the deepest matched block over the tied replicas,
// arbitrary and stable in the same way.
//
// Departures: SGLang's tree is over characters and its match rate is matched
// over input characters; here both are in blocks (matched blocks / the
// prompt's full blocks), the partial last block being invisible. SGLang
// takes min and max load over every worker it lists, healthy or not; here
// over the up replicas, because a replica that is down here may have left
// the pool for good, which SGLang would no longer list. SGLang bounds each
// worker's share of the tree at max_tree_size characters, evicting LRU leaves
// every eviction_interval (60 s); here at that size in blocks (2^26/4 tokens,
// at 4 characters a token), evicting as soon as a replica exceeds it. That
// is far more than any replica's KV cache: SGLang's router remembers
// prefixes long after the engines evicted them, and so does this one.
type SGLang struct {
	BalanceAbs     int
	BalanceRel     float64
	MatchThreshold float64
	h              *history
}

var (
	_ Policy   = (*SGLang)(nil)
	_ Observer = (*SGLang)(nil)
)

// NewSGLang returns SGLang's router with its CLI defaults (0.3, 64, 1.5),
// its history over keys of blockTokens tokens bounded at capacityBlocks
// blocks per replica (0: SGLang's max_tree_size, 2^26 characters, as blocks).
func NewSGLang(blockTokens, capacityBlocks int) (*SGLang, error) {
	if capacityBlocks < 0 {
		return nil, fmt.Errorf("policy: sglang: per-replica history capacity must be ≥ 0 blocks (0: SGLang's max_tree_size), got %d", capacityBlocks)
	}
	if capacityBlocks == 0 && blockTokens > 0 {
		capacityBlocks = sglangMaxTreeChars / charsPerToken / blockTokens
	}
	h, err := newHistory(blockTokens, capacityBlocks)
	if err != nil {
		return nil, err
	}
	return &SGLang{BalanceAbs: sglangBalanceAbs, BalanceRel: sglangBalanceRel, MatchThreshold: sglangCacheThreshold, h: h}, nil
}

// Name implements Policy.
func (p *SGLang) Name() string { return "sglang" }

// Route implements Policy.
func (p *SGLang) Route(req *Request, v *View, now time.Time) (Decision, error) {
	matched := p.h.lookup(req, v)
	minL, maxL := math.MaxInt, -1
	bestM := -1
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		minL, maxL = min(minL, rp.InFlight), max(maxL, rp.InFlight)
		bestM = max(bestM, at(matched, i))
	}
	if maxL < 0 {
		return Decision{}, ErrNoReplica
	}
	imbalanced := maxL-minL > p.BalanceAbs && float64(maxL) > p.BalanceRel*float64(minL)
	if !imbalanced && bestM > 0 && float64(bestM) > p.MatchThreshold*float64(len(req.Keys)) {
		key := uint64(req.Keys[bestM-1])
		best, bestW := -1, uint64(0)
		for i := range v.Replicas {
			if !v.Replicas[i].Up || at(matched, i) != bestM {
				continue
			}
			if w := mix64(key ^ mix64(uint64(i)+1)); best < 0 || w > bestW {
				best, bestW = i, w
			}
		}
		return Decision{Replica: best, Branch: "cache", MatchedTokens: v.MatchedTokens(best, req)}, nil
	}
	d, err := LeastLoad{}.Route(req, v, now)
	if imbalanced {
		d.Branch = "balance"
	} else {
		d.Branch = "least-load"
	}
	return d, err
}

// Routed implements Observer: the decision enters the history (SGLang
// inserts the request into the chosen worker's tree in every branch).
func (p *SGLang) Routed(req *Request, d *Decision, v *View, now time.Time) {
	p.h.record(req, d.Replica, now)
}

// FirstToken implements Observer.
func (p *SGLang) FirstToken(uint64, int, time.Duration, time.Time) {}

// Finished implements Observer.
func (p *SGLang) Finished(uint64, int, int, bool, time.Time) {}

// ReplicaDown implements Observer: the replica's history is dropped
// (SGLang's remove_worker → remove_tenant).
func (p *SGLang) ReplicaDown(r int, now time.Time) { p.h.forget(r) }

// DynamoConfig configures the Dynamo KV router's cost.
type DynamoConfig struct {
	// OverlapWeight weighs prefill blocks (overlap_score_weight, 1.0).
	OverlapWeight float64
	// Temperature > 0 samples by softmax over the range-normalised costs
	// instead of taking the cheapest (router_temperature, 0).
	Temperature float64
}

// DefaultDynamoConfig returns Dynamo's defaults: overlap_score_weight 1.0,
// router_temperature 0.0 (ai-dynamo/dynamo lib/kv-router/src/config.rs @
// 870abbd1e540664f8738c867c2b702e1d1ce629b).
func DefaultDynamoConfig() DynamoConfig { return DynamoConfig{OverlapWeight: 1} }

// Dynamo is NVIDIA Dynamo's KV-aware router (ai-dynamo/dynamo
// lib/llm/src/kv_router/scheduler.rs @ db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4,
// DefaultWorkerSelector; identical in lib/kv-router/src/scheduling/selector.rs
// @ ccd1706e138fe41b54b85305598ad6b748f377fe; the newest,
// lib/kv-router/src/scheduling/selector/default.rs @
// a4bdb9bfa1eed0afd4d67331f0938f9d5e3b58ed, reduces to it with default
// settings). Per replica, in blocks of B tokens, lower wins:
//
//	logit(r) = w·prefill(r) + decode(r)
//	prefill(r) = (prompt tokens − tokens r caches + r's active prefill tokens) / B
//	decode(r)  = r's active blocks + the request's blocks not active on r
//
// (lib/llm/src/kv_router/sequence.rs @
// 581ee33e434f3f99b84f6ea99fcf0a3fda26a685, potential_blocks_and_tokens).
// Active prefill tokens are the uncached prompt tokens of r's requests that
// have not finished prefill (Replica.PendingPrefillTokens); active blocks are
// the distinct prompt blocks of all r's in-flight requests
// (prefixtree.Tree.ActiveBlocks; output blocks count only with
// router_track_output_blocks, off by default). The request's blocks not
// active on r are those of its path no request on r references yet.
//
// Blocks past the GPU match that r holds in a lower cache tier (KV events
// of another medium; View.TierSplit) are credited as Dynamo's tiered
// indexer and selector do: host-memory blocks at host_cache_hit_weight
// (DynamoHostCacheHitWeight, 0.75) and disk ones at disk_cache_hit_weight
// (DynamoDiskCacheHitWeight, 0.25) of a device block, subtracted from the
// prefill blocks (selector/default.rs @
// 07a6c9ce3bb096cfaf353fe69ee578e105c6a512, worker_logit):
//
//	prefill(r) = (prompt tokens − tokens r caches + r's active prefill tokens) / B
//	             − 0.75·host blocks − 0.25·disk blocks
//
// Temperature 0 takes the lowest logit, ties uniformly at random (the newest
// selector; the classic one broke ties by the smaller cache, then at
// random). Temperature T > 0 samples p(r) ∝ exp(−(v − vmin)/((vmax − vmin)·T)),
// uniformly when all are equal.
type Dynamo struct {
	cfg DynamoConfig
}

var _ Policy = (*Dynamo)(nil)

// NewDynamo returns a Dynamo KV router.
func NewDynamo(cfg DynamoConfig) *Dynamo { return &Dynamo{cfg: cfg} }

// Name implements Policy.
func (p *Dynamo) Name() string { return "dynamo" }

// newBlocks is how many of req's blocks no in-flight request on replica r
// passes through: the blocks of v.Match.Path that r does not reference, and
// any the tree does not hold (when the view was looked up, not inserted).
func newBlocks(v *View, req *Request, r int) int {
	m := v.Match
	n := max(len(req.Keys)-m.Blocks, 0)
	for j, nd := range m.Path {
		if nd.Ref(r) > 0 {
			continue
		}
		if j == len(m.Path)-1 {
			n += m.LastBlocks
		} else {
			n += nd.Own()
		}
	}
	return n
}

// Route implements Policy. Candidate terms: Prefill = prefill(r), Load =
// decode(r), Score = the logit.
func (p *Dynamo) Route(req *Request, v *View, now time.Time) (Decision, error) {
	bt := float64(v.BlockTokens())
	d := Decision{Branch: "dynamo", Replica: -1, Candidates: make([]Candidate, 0, len(v.Replicas))}
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		m := v.MatchedTokens(i, req)
		prefill := float64(req.PromptTokens-m+max(rp.PendingPrefillTokens, 0)) / bt
		if host, other := v.TierSplitOf(i, req, m); host+other > 0 {
			prefill = max(prefill-(DynamoHostCacheHitWeight*float64(host)+DynamoDiskCacheHitWeight*float64(other))/bt, 0)
		}
		decode := float64(v.Tree.ActiveBlocks(i) + newBlocks(v, req, i))
		c := p.cfg.OverlapWeight*prefill + decode
		d.Candidates = append(d.Candidates, Candidate{Replica: i, MatchedTokens: m, Prefill: prefill, Load: decode, Score: c})
	}
	if len(d.Candidates) == 0 {
		return Decision{}, ErrNoReplica
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, c := range d.Candidates {
		lo, hi = math.Min(lo, c.Score), math.Max(hi, c.Score)
	}
	pick := 0
	switch {
	case p.cfg.Temperature > 0 && hi > lo:
		sum := 0.0
		for _, c := range d.Candidates {
			sum += math.Exp(-(c.Score - lo) / ((hi - lo) * p.cfg.Temperature))
		}
		x := v.Rand.Float64() * sum
		pick = len(d.Candidates) - 1
		for i, c := range d.Candidates {
			x -= math.Exp(-(c.Score - lo) / ((hi - lo) * p.cfg.Temperature))
			if x <= 0 {
				pick = i
				break
			}
		}
	case p.cfg.Temperature > 0:
		pick = v.Rand.IntN(len(d.Candidates))
	default:
		ties := 0
		for i, c := range d.Candidates {
			if c.Score == lo {
				ties++
				if ties == 1 || v.Rand.IntN(ties) == 0 {
					pick = i
				}
			}
		}
	}
	d.Replica = d.Candidates[pick].Replica
	d.MatchedTokens = d.Candidates[pick].MatchedTokens
	return d, nil
}

// at is s[i], or 0 past its end.
func at(s []int, i int) int {
	if i < 0 || i >= len(s) {
		return 0
	}
	return s[i]
}

// resize returns s with length n, zeroed, reusing its array when it can.
func resize[T int | float64](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	s = s[:n]
	clear(s)
	return s
}

// clamp01 clamps x to [0,1] (NaN to 0).
func clamp01(x float64) float64 {
	if !(x > 0) {
		return 0
	}
	return math.Min(x, 1)
}
