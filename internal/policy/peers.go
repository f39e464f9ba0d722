package policy

import (
	"fmt"
	"math"
	"time"

	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// LLMDPrecise is llm-d's precise prefix-cache scorer set (llm-d
// inference-scheduler, "precise-prefix-cache-scorer" with its kv-cache
// indexer fed by vLLM KV events), combined as in llm-d's published benchmark:
//
//	score(r) = 3·prefix(r) + 2·(1 − kvUsage(r)) + 2·queue(r)
//
// prefix = longest run of the request's blocks that r holds / total blocks
// (from the engine's cache as the tree knows it), queue = (maxQ − q)/(maxQ −
// minQ) (1 when all are equal). Highest score wins; ties are broken at random.
type LLMDPrecise struct {
	PrefixWeight, KVWeight, QueueWeight float64
	name                                string
}

var _ Policy = (*LLMDPrecise)(nil)

// NewLLMDPrecise returns llm-d's precise scorer with weights 3/2/2.
func NewLLMDPrecise() *LLMDPrecise {
	return &LLMDPrecise{PrefixWeight: 3, KVWeight: 2, QueueWeight: 2, name: "llmd-precise"}
}

// Name implements Policy.
func (p *LLMDPrecise) Name() string { return p.name }

// Route implements Policy.
func (p *LLMDPrecise) Route(req *Request, v *View, now time.Time) (Decision, error) {
	return scoreLLMD(req, v, v.Match.PerReplica, p.PrefixWeight, p.KVWeight, p.QueueWeight, "llmd-precise")
}

// scoreLLMD applies llm-d's weighted scorers given per-replica matched blocks.
func scoreLLMD(req *Request, v *View, matched []int, wp, wkv, wq float64, branch string) (Decision, error) {
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
	best := math.Inf(-1)
	ties := 0
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		prefix := 0.0
		if len(req.Keys) > 0 && i < len(matched) {
			prefix = float64(matched[i]) / float64(len(req.Keys))
		}
		kv := 1.0
		if rp.KVUsage >= 0 && finite(rp.KVUsage) {
			kv = 1 - math.Min(math.Max(rp.KVUsage, 0), 1)
		}
		queue := 1.0
		if maxQ > minQ {
			queue = float64(maxQ-rp.Queue()) / float64(maxQ-minQ)
		}
		s := wp*prefix + wkv*kv + wq*queue
		m := 0
		if i < len(matched) {
			m = min(matched[i]*v.BlockTokens(), req.PromptTokens)
		}
		d.Candidates = append(d.Candidates, Candidate{Replica: i, MatchedTokens: m, Score: s})
		switch {
		case s > best+1e-12:
			best, ties = s, 1
			d.Replica, d.MatchedTokens = i, m
		case math.Abs(s-best) <= 1e-12:
			// Reservoir-sample among equal scores, as llm-d's max-score
			// picker shuffles ties.
			ties++
			if v.Rand.IntN(ties) == 0 {
				d.Replica, d.MatchedTokens = i, m
			}
		}
	}
	return d, nil
}

// history is a router's own record of what it sent where: a private prefix
// tree whose "cached" marks mean "routed there", bounded per replica by LRU.
// llm-d's approximate scorer and SGLang's router keep exactly this instead
// of listening to the engines.
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

// LLMDApprox is llm-d's approximate prefix-cache scorer (the Gateway API
// Inference Extension's "prefix-cache-scorer"): the same scoring as
// LLMDPrecise with weights 1/1/1, but "r holds the block" means the router
// sent that prefix to r (a per-replica LRU of block keys, with no knowledge
// of the engine's evictions).
type LLMDApprox struct {
	h *history
}

var _ Policy = (*LLMDApprox)(nil)
var _ Observer = (*LLMDApprox)(nil)

// NewLLMDApprox returns the approximate scorer with a per-replica history of
// capacityBlocks blocks.
func NewLLMDApprox(blockTokens, capacityBlocks int) (*LLMDApprox, error) {
	h, err := newHistory(blockTokens, capacityBlocks)
	if err != nil {
		return nil, err
	}
	return &LLMDApprox{h: h}, nil
}

// Name implements Policy.
func (p *LLMDApprox) Name() string { return "llmd-approx" }

// Route implements Policy.
func (p *LLMDApprox) Route(req *Request, v *View, now time.Time) (Decision, error) {
	d, err := scoreLLMD(req, v, p.h.lookup(req, v), 1, 1, 1, "llmd-approx")
	return d, err
}

// Routed implements Observer: the decision enters the history.
func (p *LLMDApprox) Routed(req *Request, d *Decision, v *View, now time.Time) {
	p.h.record(req, d.Replica, now)
}

// FirstToken implements Observer.
func (p *LLMDApprox) FirstToken(uint64, int, time.Duration, time.Time) {}

// Finished implements Observer.
func (p *LLMDApprox) Finished(uint64, int, int, bool, time.Time) {}

// ReplicaDown implements Observer: the replica's history is dropped.
func (p *LLMDApprox) ReplicaDown(r int, now time.Time) { p.h.forget(r) }

// SGLang is SGLang's cache-aware router (sgl-router, defaults as of 2026):
// if the cluster is imbalanced (max−min in-flight > BalanceAbs and max >
// BalanceRel·min) the least loaded replica wins; else if the best history
// match covers more than MatchThreshold of the prompt, that replica wins;
// else the least loaded. Its tree is its own routing history, evicted LRU.
type SGLang struct {
	BalanceAbs     int
	BalanceRel     float64
	MatchThreshold float64
	h              *history
}

var _ Policy = (*SGLang)(nil)
var _ Observer = (*SGLang)(nil)

// NewSGLang returns SGLang's router with its defaults (64, 1.5, 0.3).
func NewSGLang(blockTokens, capacityBlocks int) (*SGLang, error) {
	h, err := newHistory(blockTokens, capacityBlocks)
	if err != nil {
		return nil, err
	}
	return &SGLang{BalanceAbs: 64, BalanceRel: 1.5, MatchThreshold: 0.3, h: h}, nil
}

// Name implements Policy.
func (p *SGLang) Name() string { return "sglang" }

// Route implements Policy.
func (p *SGLang) Route(req *Request, v *View, now time.Time) (Decision, error) {
	matched := p.h.lookup(req, v)
	minL, maxL := math.MaxInt, -1
	best, bestM := -1, -1
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		minL, maxL = min(minL, rp.InFlight), max(maxL, rp.InFlight)
		m := 0
		if i < len(matched) {
			m = matched[i]
		}
		if m > bestM || (m == bestM && rp.InFlight < v.Replicas[best].InFlight) {
			best, bestM = i, m
		}
	}
	if best < 0 {
		return Decision{}, ErrNoReplica
	}
	imbalanced := maxL-minL > p.BalanceAbs && float64(maxL) > p.BalanceRel*float64(minL)
	if !imbalanced && len(req.Keys) > 0 && float64(bestM) > p.MatchThreshold*float64(len(req.Keys)) {
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

// Routed implements Observer: the decision enters the history.
func (p *SGLang) Routed(req *Request, d *Decision, v *View, now time.Time) {
	p.h.record(req, d.Replica, now)
}

// FirstToken implements Observer.
func (p *SGLang) FirstToken(uint64, int, time.Duration, time.Time) {}

// Finished implements Observer.
func (p *SGLang) Finished(uint64, int, int, bool, time.Time) {}

// ReplicaDown implements Observer.
func (p *SGLang) ReplicaDown(r int, now time.Time) { p.h.forget(r) }

// DynamoConfig configures the Dynamo KV router's cost.
type DynamoConfig struct {
	// OverlapWeight weighs prefill blocks (1.0 in Dynamo).
	OverlapWeight float64
	// Temperature > 0 samples by softmax over −cost instead of argmin.
	Temperature float64
}

// DefaultDynamoConfig returns Dynamo's defaults (weight 1, argmin).
func DefaultDynamoConfig() DynamoConfig { return DynamoConfig{OverlapWeight: 1} }

// Dynamo is NVIDIA Dynamo's KV-aware router cost (dynamo kv_router
// "DefaultWorkerSelector"):
//
//	cost(r) = w·(prefill blocks not cached on r + r's active prefill blocks)
//	          + r's active decode blocks
//
// lowest wins, or softmax sampling with a temperature.
type Dynamo struct {
	cfg   DynamoConfig
	costs []float64
}

var _ Policy = (*Dynamo)(nil)

// NewDynamo returns a Dynamo-style router.
func NewDynamo(cfg DynamoConfig) *Dynamo { return &Dynamo{cfg: cfg} }

// Name implements Policy.
func (p *Dynamo) Name() string { return "dynamo" }

// Route implements Policy.
func (p *Dynamo) Route(req *Request, v *View, now time.Time) (Decision, error) {
	bt := float64(v.BlockTokens())
	total := float64(req.PromptTokens) / bt
	d := Decision{Branch: "dynamo", Replica: -1, Candidates: make([]Candidate, 0, len(v.Replicas))}
	p.costs = p.costs[:0]
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		m := v.MatchedTokens(i, req)
		prefill := total - float64(m)/bt + float64(rp.PendingPrefillTokens)/bt
		decode := float64(rp.DecodeContextTokens) / bt
		c := p.cfg.OverlapWeight*prefill + decode
		d.Candidates = append(d.Candidates, Candidate{Replica: i, MatchedTokens: m, Prefill: prefill, Load: decode, Score: c})
	}
	if len(d.Candidates) == 0 {
		return Decision{}, ErrNoReplica
	}
	pick := 0
	if p.cfg.Temperature > 0 {
		lo := math.Inf(1)
		for _, c := range d.Candidates {
			lo = math.Min(lo, c.Score)
		}
		sum := 0.0
		for _, c := range d.Candidates {
			sum += math.Exp(-(c.Score - lo) / (p.cfg.Temperature * math.Max(lo, 1)))
		}
		x := v.Rand.Float64() * sum
		for i, c := range d.Candidates {
			x -= math.Exp(-(c.Score - lo) / (p.cfg.Temperature * math.Max(lo, 1)))
			if x <= 0 {
				pick = i
				break
			}
		}
	} else {
		for i, c := range d.Candidates {
			if c.Score < d.Candidates[pick].Score {
				pick = i
			}
		}
	}
	d.Replica = d.Candidates[pick].Replica
	d.MatchedTokens = d.Candidates[pick].MatchedTokens
	return d, nil
}
