package policy

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// E2Config configures Preble's E2 scheduler (Srivatsa et al., "Preble:
// Efficient Distributed Prompt Scheduling for LLM Serving", ICLR 2025, §3.2,
// Algorithm 1). Every constant of the paper is a field; DefaultE2Config gives
// prefixlb's tuned `e2` and PrebleE2Config the prototype's rules (`e2-preble`).
type E2Config struct {
	// Name is the policy name reported in decisions and results.
	Name string `json:"name"`
	// Window is H, the history window of the load statistics (3 min).
	Window time.Duration `json:"window"`
	// BalanceThreshold is Thbal: rebalance while the heaviest replica's load
	// is at least this multiple of the lightest's (1.5).
	BalanceThreshold float64 `json:"balance_threshold"`
	// MixHitRatio is the windowed hit ratio above which a replica takes
	// miss-heavy requests to mix prefill with its cheap hits (0.7).
	MixHitRatio float64 `json:"mix_hit_ratio"`
	// MixWindow is the window of that hit ratio (30 s).
	MixWindow time.Duration `json:"mix_window"`
	// WarmupPerReplica: rebalancing starts after this many routed requests
	// per replica (50).
	WarmupPerReplica int `json:"warmup_per_replica"`
	// MinHotCount: only prefixes with at least this many requests in the
	// window count as load for rebalancing (2).
	MinHotCount int `json:"min_hot_count"`
	// ReplicateTTFTRatio: a lone hot prefix is replicated when the mean TTFT
	// of the newer half of its window is at least this multiple of the older
	// half's (2).
	ReplicateTTFTRatio float64 `json:"replicate_ttft_ratio"`
	// TPOTSamples is how many observed time-per-output-token samples the
	// per-replica median uses (200).
	TPOTSamples int `json:"tpot_samples"`

	// ExploitAssignedOnly restricts the exploit branch to the replicas the
	// prefix is assigned to (the paper). When false, exploit compares every
	// replica by cost, whose P term already credits each replica's cache.
	ExploitAssignedOnly bool `json:"exploit_assigned_only"`
	// IncludePrefill adds P (term prefill), this request's own prefill on
	// the replica, to the cost (the paper includes it; the prototype leaves
	// it out).
	IncludePrefill bool `json:"include_prefill"`
	// MarginalDecode charges in-flight decode at the marginal time one more
	// sequence adds to a batched iteration instead of TPOT per token.
	MarginalDecode bool `json:"marginal_decode"`
	// HistoryWeight weighs L's windowed prefill history (Preble's L; term
	// history).
	HistoryWeight float64 `json:"history_weight"`
	// PendingWeight weighs the prefill still queued on the replica now (the
	// "queue now" that llm-d scores), in GPU seconds (term pending).
	PendingWeight float64 `json:"pending_weight"`
	// DecodeWeight weighs L's in-flight decode term (1 in the paper; term
	// decode).
	DecodeWeight float64 `json:"decode_weight"`
	// SelfDecodeWeight weighs this request's own decode time on the replica:
	// its expected output times the replica's decode step at its batch size
	// plus one (0 in the paper; term self_decode).
	SelfDecodeWeight float64 `json:"self_decode_weight"`
	// PrefillSlowdown stretches the queued prefill and P by the share of
	// each chunked-prefill iteration the replica's running decodes take
	// (term prefill_slowdown).
	PrefillSlowdown bool `json:"prefill_slowdown"`
	// DecodeBatchInFlight sizes the batch this request will decode in by
	// every request in flight on the replica (those still prefilling will be
	// decoding too), not only those decoding now.
	DecodeBatchInFlight bool `json:"decode_batch_in_flight"`
	// DecodePrefillRate stretches this request's decode by the replica's
	// windowed prefill rate (prefill that arrives meanwhile shares the
	// iterations).
	DecodePrefillRate bool `json:"decode_prefill_rate"`
	// PrefillWeight weighs P (1 in the paper; term prefill). Above 1 it
	// charges a recompute for the requests that will queue behind it.
	PrefillWeight float64 `json:"prefill_weight"`
	// InterferenceWeight weighs the delay this request's prefill imposes on
	// the requests decoding on the replica: every iteration that carries a
	// chunk of its prompt also carries one token of each running decode, so
	// its prefill time P is added to each of their latencies (0 in the
	// paper; term interference).
	InterferenceWeight float64 `json:"interference_weight"`
	// EvictionRecompute prices an evicted prefix that was used in the window
	// at one recompute of it (the next request for it pays its prefill),
	// instead of the paper's missRate·count·T_prefill, which prices a prefix
	// that always hits — the one most worth keeping — at zero.
	EvictionRecompute bool `json:"eviction_recompute"`
	// EvictionWeight weighs M, the eviction cost (1 in the paper; term
	// eviction).
	EvictionWeight float64 `json:"eviction_weight"`
	// AdapterLoadWeight weighs the time to load a request's LoRA adapter on
	// a replica that does not hold it (term adapter_load, part of P), and
	// AdapterEvictionWeight the reload of the adapter that load evicts when
	// the replica's slots are full (term adapter_eviction, part of M). Both
	// are 0 for the base model.
	AdapterLoadWeight     float64 `json:"adapter_load_weight"`
	AdapterEvictionWeight float64 `json:"adapter_eviction_weight"`
	// AdapterWaitWeight weighs the wait of a request whose adapter is not
	// among those r's running requests use when they already use max_loras
	// adapters: vLLM admits it only once one of them drains (term
	// adapter_wait, part of L; 0 for the base model).
	AdapterWaitWeight float64 `json:"adapter_wait_weight"`
	// AdapterCascadeWeight weighs the reloads a request's adapter load
	// causes the adapter placed on that replica that it evicts (term
	// adapter_cascade, part of M; 0 for the base model). E2 keeps each
	// adapter's assigned set sized to its load (e2adapter.go); 0 turns the
	// placement's price off.
	AdapterCascadeWeight float64 `json:"adapter_cascade_weight"`
	// Mixing enables the prefill/decode mixing rule.
	Mixing bool `json:"mixing"`
	// Rebalance enables migration of prefixes off a heavy replica, and
	// Replicate the replication of a lone hot prefix.
	Rebalance bool `json:"rebalance"`
	Replicate bool `json:"replicate"`
	// RebalanceInterval runs rebalancing at most this often (0: after every
	// decision, as the prototype does).
	RebalanceInterval time.Duration `json:"rebalance_interval"`
	// MoveCooldown is the least time between two moves of one prefix.
	MoveCooldown time.Duration `json:"move_cooldown"`
	// TieBreakInFlight breaks cost ties by cached tokens, then by the number
	// of in-flight requests (then by ID); without it ties go to the lowest
	// ID, which piles equal work (no cache anywhere, empty queues) onto one
	// replica.
	TieBreakInFlight bool `json:"tie_break_in_flight"`
	// MovableLoadOnly decides moves on the windowed prefill load alone (what
	// a move can shift), leaving in-flight decode out; and keeps a move only
	// if the prefix's windowed load exceeds the recompute it causes.
	MovableLoadOnly bool `json:"movable_load_only"`
	// SlotWait adds, for a replica with a slot cache (Replica.Slots > 0:
	// llama.cpp runs at most that many requests and defers the rest), the
	// time this request would wait for a slot when all are taken (term
	// slot_wait; see slotWait).
	SlotWait bool `json:"slot_wait"`

	// TierCredit says how P prices the prompt's blocks that follow the
	// replica's GPU hit and that it holds only in a slower cache tier (CPU
	// offloading, disk: View.TierHit, fed by KV events of another medium):
	//   - TierCreditLoad ("load", or ""): at their load time, their KV bytes
	//     over the tier's bandwidth (costmodel.TierBandwidth), at weight 1:
	//     only this request waits for the copy, which runs beside the
	//     replica's batches (vLLM's OffloadingConnector loads
	//     asynchronously), unlike a recompute, which P weighs at
	//     prefill_weight for the requests queued behind it;
	//   - TierCreditFixed ("fixed"): Dynamo's fixed credit, a block in host
	//     memory as DynamoHostCacheHitWeight of a GPU hit and one on disk as
	//     DynamoDiskCacheHitWeight (the rest of its recompute is priced);
	//   - TierCreditNone ("none"): recomputed, as if the tier's events were
	//     dropped (serve --ignore-cache-tiers).
	//
	// Either way the blocks take GPU memory, so M prices what they evict.
	TierCredit string `json:"tier_credit"`
}

// TierCredit modes (E2Config.TierCredit).
const (
	TierCreditLoad  = "load"
	TierCreditFixed = "fixed"
	TierCreditNone  = "none"
)

// Dynamo's default credits for a prompt's blocks past the GPU match that a
// worker holds in a lower tier, as a fraction of a GPU hit: host memory
// (host_cache_hit_weight) and disk or external storage
// (disk_cache_hit_weight). ai-dynamo/dynamo lib/kv-router/src/scheduling/config.rs
// @ 0243c51bb6e8958be89df4978b5761677c9adc23 (default_host_cache_hit_weight,
// default_disk_cache_hit_weight); applied in
// lib/kv-router/src/scheduling/selector/default.rs @
// 07a6c9ce3bb096cfaf353fe69ee578e105c6a512 (worker_logit: overlap credit =
// credit·device + host_weight·host + disk_weight·disk blocks, subtracted
// from the prefill blocks) and lib/kv-router/src/scheduling/overlap.rs @
// 13a4eeab3ff95e09dfa58402a063e9b0f0ac4bcd (cache_hit_weight_for_tier).
const (
	DynamoHostCacheHitWeight = 0.75
	DynamoDiskCacheHitWeight = 0.25
)

// PrebleE2Config returns the rules as Preble's prototype writes them
// (ALGORITHMS §3–4): exploit within the assigned set, L without P, decode at
// TPOT per token, rebalancing after every decision. The terms of its cost
// (DefaultE2Config lists them) weigh:
//
//	term              weight
//	decode            1       (at TPOT per token: marginal_decode false)
//	history           1
//	pending           0
//	interference      0
//	self_decode       0
//	prefill_slowdown  0
//	slot_wait         0
//	eviction          1       (missRate·count·T_prefill: eviction_recompute false)
//	prefill           0       (include_prefill false)
//	adapter_eviction  1       (prefixlb's: LoRA adapters, e2cost.go)
//	adapter_load      1       (prefixlb's: LoRA adapters, e2cost.go)
//	adapter_wait      1       (prefixlb's: LoRA adapters, e2cost.go)
//	adapter_cascade   1       (prefixlb's: LoRA adapter placement, e2adapter.go)
func PrebleE2Config() E2Config {
	return E2Config{
		Name:                "e2-preble",
		Window:              3 * time.Minute,
		BalanceThreshold:    1.5,
		MixHitRatio:         0.7,
		MixWindow:           30 * time.Second,
		WarmupPerReplica:    50,
		MinHotCount:         2,
		ReplicateTTFTRatio:  2,
		TPOTSamples:         200,
		ExploitAssignedOnly: true,
		IncludePrefill:      false,
		MarginalDecode:      false,
		HistoryWeight:       1,
		PendingWeight:       0,
		DecodeWeight:        1,
		PrefillWeight:       1,
		EvictionWeight:      1,
		Mixing:              true,
		// Preble prices no adapters; these are prefixlb's (e2cost.go),
		// at the weight of the terms they extend (M and P, 1 in the
		// paper), so that e2-preble on adapters sees their loads.
		AdapterLoadWeight:     1,
		AdapterEvictionWeight: 1,
		AdapterWaitWeight:     1,
		AdapterCascadeWeight:  1,
		Rebalance:             true,
		Replicate:             true,
	}
}

// DefaultE2Config returns prefixlb's `e2`: Preble's E2 with the changes the
// simulator justified (docs/simulator.md, "Tuning e2"). The cost of a replica
// r is an estimate of what placing the request there costs in GPU seconds of
// latency, over every replica (P credits each replica's cache, so a hot
// prefix spreads by itself once its holder's queue outweighs a recompute):
// the paper's L + M + P, with prefixlb's terms in L, each term at its weight
// (E2Term; each term's method in e2cost.go gives its formula):
//
//	cost(r) = L + M + P
//	L = decode + history + pending + interference + self_decode + prefill_slowdown + slot_wait + adapter_wait
//	M = eviction + adapter_eviction + adapter_cascade
//	P = prefill + adapter_load
//
//	term              weight  on replica r, w the weight                         from
//	decode            0       w·(decode tokens owed)·T_marginal(inflight_r)      Preble's L
//	history           0       w·(prefill seconds routed to r in the window)      Preble's L
//	pending           1.5     w·Q_r, the prefill queued on r now                 llm-d's queue
//	interference      0.3     w·P_r·decoding_r: each running decode waits P_r    prefixlb
//	self_decode       0.6     w·(out−1)·T_step(inflight_r+1)·(1+ρ_r)             prefixlb
//	prefill_slowdown  1       w·s_r·(pending + prefill)                          prefixlb
//	slot_wait         1       w·(wait for a free slot of a slot cache)           prefixlb
//	eviction          1       w·M_r, the paper's eviction cost                   Preble's M
//	prefill           3       w·P_r, P_r = T_prefill(missed on r, prompt)        Preble's P
//	adapter_eviction  1       w·T_load(r) if r lacks the adapter, slots full     prefixlb
//	adapter_load      1       w·T_load(r) if r lacks the adapter                 prefixlb
//	adapter_wait      1       w·(wait for r's running adapters to free a slot)   prefixlb
//	adapter_cascade   1       w·n_b(r)·T_load(r) if a load on r evicts b placed on r  prefixlb
//
// ρ_r is r's windowed prefill rate (prefill that arrives meanwhile shares
// this request's decode) and s_r the share of each chunked-prefill iteration
// r's running decodes take. A term's weight is the E2Config field of its name
// with "_weight"; prefill_slowdown and slot_wait are flags (1 on, 0 off), and
// prefill weighs 0 without include_prefill. P weighs 3 because a recompute
// also delays the requests that queue behind it. TestE2ConfigDocs holds this
// table to the code.
//
// On a replica with a slot cache (llama.cpp; Replica.Slots > 0) "missed" is
// what the slot the request lands on does not hold, M prices the prompt that
// slot loses (only prefixes no other replica holds), and slot_wait is the
// wait for a free slot when all are taken (slotWait).
//
// For a LoRA adapter's request, adapter_load is its load on a replica that
// lacks it (part of P_r, so interference charges it to r's running decodes
// too), adapter_eviction the reload of the adapter that load evicts, and
// adapter_wait the wait vLLM imposes when r's running requests already use
// max_loras other adapters (adapterWaitTerm); adapter_cascade the reloads
// of an adapter b placed on r (b's requests there in the window, each a load)
// that a load of this request's adapter there evicts (adapterCascadeTerm). E2 keeps each adapter's set
// sized to its load, as it assigns a hot prefix (placeAdapter, e2adapter.go).
// All are 0 for the base model.
//
// Rebalancing and replication run on movable (windowed prefill) load at most
// once a second with a per-prefix cooldown; with exploit over every replica
// they only maintain placements for reports.
func DefaultE2Config() E2Config {
	c := PrebleE2Config()
	c.Name = "e2"
	c.ExploitAssignedOnly = false
	c.IncludePrefill = true
	c.MarginalDecode = true
	c.HistoryWeight = 0
	c.PendingWeight = 1.5
	c.PrefillSlowdown = true
	c.DecodeWeight = 0
	c.SelfDecodeWeight = 0.6
	c.DecodeBatchInFlight = true
	c.DecodePrefillRate = true
	c.PrefillWeight = 3
	c.InterferenceWeight = 0.3
	c.Mixing = false
	c.RebalanceInterval = time.Second
	c.MoveCooldown = 30 * time.Second
	c.MovableLoadOnly = true
	c.TieBreakInFlight = true
	c.SlotWait = true
	return c
}

// Validate reports the first invalid field, naming it.
func (c E2Config) Validate() error {
	switch {
	case c.Name == "":
		return fmt.Errorf("policy: e2: name must not be empty")
	case c.Window <= 0:
		return fmt.Errorf("policy: e2 %s: window must be > 0, got %v", c.Name, c.Window)
	case c.MixWindow <= 0 || c.MixWindow > c.Window:
		return fmt.Errorf("policy: e2 %s: mix_window must be in (0, window], got %v", c.Name, c.MixWindow)
	case !finite(c.BalanceThreshold) || c.BalanceThreshold < 1:
		return fmt.Errorf("policy: e2 %s: balance_threshold must be ≥ 1, got %v", c.Name, c.BalanceThreshold)
	case !finite(c.MixHitRatio) || c.MixHitRatio < 0 || c.MixHitRatio > 1:
		return fmt.Errorf("policy: e2 %s: mix_hit_ratio must be in [0,1], got %v", c.Name, c.MixHitRatio)
	case c.WarmupPerReplica < 0:
		return fmt.Errorf("policy: e2 %s: warmup_per_replica must be ≥ 0, got %d", c.Name, c.WarmupPerReplica)
	case c.MinHotCount < 1:
		return fmt.Errorf("policy: e2 %s: min_hot_count must be ≥ 1, got %d", c.Name, c.MinHotCount)
	case !finite(c.ReplicateTTFTRatio) || c.ReplicateTTFTRatio < 1:
		return fmt.Errorf("policy: e2 %s: replicate_ttft_ratio must be ≥ 1, got %v", c.Name, c.ReplicateTTFTRatio)
	case c.TPOTSamples < 1:
		return fmt.Errorf("policy: e2 %s: tpot_samples must be ≥ 1, got %d", c.Name, c.TPOTSamples)
	case !finite(c.HistoryWeight) || c.HistoryWeight < 0:
		return fmt.Errorf("policy: e2 %s: history_weight must be ≥ 0, got %v", c.Name, c.HistoryWeight)
	case !finite(c.PendingWeight) || c.PendingWeight < 0:
		return fmt.Errorf("policy: e2 %s: pending_weight must be ≥ 0, got %v", c.Name, c.PendingWeight)
	case !finite(c.DecodeWeight) || c.DecodeWeight < 0:
		return fmt.Errorf("policy: e2 %s: decode_weight must be ≥ 0, got %v", c.Name, c.DecodeWeight)
	case !finite(c.SelfDecodeWeight) || c.SelfDecodeWeight < 0:
		return fmt.Errorf("policy: e2 %s: self_decode_weight must be ≥ 0, got %v", c.Name, c.SelfDecodeWeight)
	case !finite(c.PrefillWeight) || c.PrefillWeight < 0:
		return fmt.Errorf("policy: e2 %s: prefill_weight must be ≥ 0, got %v", c.Name, c.PrefillWeight)
	case !finite(c.InterferenceWeight) || c.InterferenceWeight < 0:
		return fmt.Errorf("policy: e2 %s: interference_weight must be ≥ 0, got %v", c.Name, c.InterferenceWeight)
	case !finite(c.EvictionWeight) || c.EvictionWeight < 0:
		return fmt.Errorf("policy: e2 %s: eviction_weight must be ≥ 0, got %v", c.Name, c.EvictionWeight)
	case !finite(c.AdapterLoadWeight) || c.AdapterLoadWeight < 0:
		return fmt.Errorf("policy: e2 %s: adapter_load_weight must be ≥ 0, got %v", c.Name, c.AdapterLoadWeight)
	case !finite(c.AdapterEvictionWeight) || c.AdapterEvictionWeight < 0:
		return fmt.Errorf("policy: e2 %s: adapter_eviction_weight must be ≥ 0, got %v", c.Name, c.AdapterEvictionWeight)
	case c.TierCredit != "" && c.TierCredit != TierCreditLoad && c.TierCredit != TierCreditFixed && c.TierCredit != TierCreditNone:
		return fmt.Errorf("policy: e2 %s: tier_credit must be %q, %q or %q, got %q", c.Name, TierCreditLoad, TierCreditFixed, TierCreditNone, c.TierCredit)
	case !finite(c.AdapterWaitWeight) || c.AdapterWaitWeight < 0:
		return fmt.Errorf("policy: e2 %s: adapter_wait_weight must be ≥ 0, got %v", c.Name, c.AdapterWaitWeight)
	case !finite(c.AdapterCascadeWeight) || c.AdapterCascadeWeight < 0:
		return fmt.Errorf("policy: e2 %s: adapter_cascade_weight must be ≥ 0, got %v", c.Name, c.AdapterCascadeWeight)
	case c.RebalanceInterval < 0:
		return fmt.Errorf("policy: e2 %s: rebalance_interval must be ≥ 0, got %v", c.Name, c.RebalanceInterval)
	case c.MoveCooldown < 0:
		return fmt.Errorf("policy: e2 %s: move_cooldown must be ≥ 0, got %v", c.Name, c.MoveCooldown)
	}
	return nil
}

// e2Entry is one routed request inside the window. The window holds
// rate × Window of them (1,800 at 10 requests/s over 3 min), so the counts
// are 32-bit: 64 bytes an entry.
type e2Entry struct {
	id      uint64
	at      int64 // ns
	node    *prefixtree.Node
	prefill float64 // predicted prefill seconds on the chosen replica
	ttft    float64 // seconds; < 0 until observed
	replica int32
	prompt  int32 // tokens
	hit     int32 // tokens
	out     int32 // tokens
	live    bool  // in flight
	queued  bool  // still in the window queue
	inMix   bool  // counted in its replica's mix-window figures
	// dropped: it failed before its first token, and its figures left the
	// statistics then (drop); it stays queued, counting nothing, until
	// its time in the window ends.
	dropped bool
}

// e2Node is E2's windowed statistics of one prefix unit (Node.Ext). Every
// prefix unit the tree holds may have one, so once the window holds none of
// its requests it keeps no slices, and it is dropped altogether unless a move
// cooldown still runs (forget).
type e2Node struct {
	count       int
	prompt, hit int
	out         int
	per         []e2NodeReplica
	entries     []*e2Entry // in window, oldest first
	lastMove    int64
	active      int32 // index in E2.active, -1 if absent
	everMoved   bool
}

type e2NodeReplica struct {
	count int
	load  float64 // windowed prefill seconds routed to this replica
}

type e2Replica struct {
	hist              float64 // windowed prefill seconds (L's history term)
	mixPrompt, mixHit int
	tpot              []float64
	tpotNext          int
	tpotMedian        float64
	tpotDirty         int
}

// E2 is Preble's E2 scheduler: exploit a replica that caches most of the
// prompt, explore by cost otherwise, with cost L+M+P in GPU seconds (a
// weighted sum of named terms: E2Term, cost in e2cost.go),
// windowed load statistics, the prefill/decode mixing rule, rebalancing by
// migration and replication of hot prefixes (ALGORITHMS §2–4).
//
// E2 keeps state across calls and implements Observer. It is not safe for
// concurrent use; the router serialises it.
type E2 struct {
	cfg     E2Config
	weights [NumE2Terms]float64 // cfg.termWeights()
	reps    []e2Replica
	queue   []*e2Entry // window FIFO (time order); queue[head:] live
	head    int
	mixHead int // queue[head:mixHead] are out of the mix window
	live    map[uint64]*e2Entry
	free    []*e2Entry
	active  []*prefixtree.Node
	routed  int
	lastReb int64 // when rebalancing last ran (valid once rebalanced)
	// rebalanced says whether rebalancing has run yet.
	rebalanced bool

	cands []Candidate
	terms []E2Terms // terms[i] are cands[i]'s
	// pfMemo and stepMemos remember cost-model figures within one decision
	// (and its Routed, which follows under the same lock).
	pfMemo, stepMemos []memoEntry
	chunk             [1]costmodel.Chunk // decodeShare's batch
	hot               []*prefixtree.Node
	order             []int
	lrb               []float64
	drains            []float64 // adapterWaitTerm's running adapters
	// adapters is each LoRA adapter's placement (e2adapter.go), adapterList
	// the same in the order first routed; adapterWork is the decayed
	// GPU-seconds of every request routed, as of adapterAt; nowNS is the
	// time of the decision being priced.
	adapters         map[string]*e2Adapter
	adapterList      []*e2Adapter
	adapterWork      float64
	adapterAt, nowNS int64
	// Moves and Replications count rebalancing actions (for reports).
	Moves, Replications, Shrinks int
}

var _ Policy = (*E2)(nil)
var _ Observer = (*E2)(nil)
var _ Speculator = (*E2)(nil)

// NewE2 returns an E2 scheduler with cfg, which it validates.
func NewE2(cfg E2Config) (*E2, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &E2{cfg: cfg, weights: cfg.termWeights(), live: make(map[uint64]*e2Entry)}, nil
}

// Name implements Policy.
func (p *E2) Name() string { return p.cfg.Name }

// Speculative implements Speculator: prefixlb's e2 prices the holder's
// queue, so a speculative entry cannot herd it; the prototype's rules
// (exploit within the assigned set) can be, and do not speculate.
func (p *E2) Speculative() bool { return !p.cfg.ExploitAssignedOnly }

// Config returns the configuration in force.
func (p *E2) Config() E2Config { return p.cfg }

func (p *E2) rep(r int) *e2Replica {
	for len(p.reps) <= r {
		p.reps = append(p.reps, e2Replica{})
	}
	return &p.reps[r]
}

func stats(n *prefixtree.Node) *e2Node {
	if n == nil {
		return nil
	}
	s, _ := n.Ext.(*e2Node)
	if s == nil {
		s = &e2Node{active: -1}
		n.Ext = s
	}
	return s
}

func (s *e2Node) at(r int) *e2NodeReplica {
	for len(s.per) <= r {
		s.per = append(s.per, e2NodeReplica{})
	}
	return &s.per[r]
}

func secs(d time.Duration) float64 { return d.Seconds() }

// tieTolerance is the relative difference under which two replicas' costs
// count as equal (0.1%: well inside the error of any cost estimate).
const tieTolerance = 1e-3

// memoSize bounds the per-decision memo of cost-model calls: replicas
// mostly share a few distinct figures (no hit, a full hit; an empty batch).
const memoSize = 8

type memoEntry struct {
	prof costmodel.Profile
	a, b int
	v    float64
}

// prefillMemo is secs(Prefill(missed, prompt)) on replica r's profile,
// remembered for the current decision (Route clears the memo).
func (p *E2) prefillMemo(v *View, r, missed, prompt int) float64 {
	prof := v.ProfileOf(r)
	if costmodel.Memoized(prof) {
		return secs(prof.Prefill(missed, prompt))
	}
	if x, ok := memoGet(p.pfMemo, prof, missed, prompt); ok {
		return x
	}
	x := secs(prof.Prefill(missed, prompt))
	memoPut(&p.pfMemo, prof, missed, prompt, x)
	return x
}

// stepMemo is the seconds of a decode-only iteration of batch sequences
// with ctx tokens of context each on replica r's profile, remembered for
// the current decision.
func (p *E2) stepMemo(v *View, r, batch, ctx int) float64 {
	prof := v.ProfileOf(r)
	if costmodel.Memoized(prof) {
		return secs(prof.Iteration(costmodel.Batch{DecodeSeqs: batch, DecodeContext: ctx * batch}))
	}
	if x, ok := memoGet(p.stepMemos, prof, batch, ctx); ok {
		return x
	}
	x := secs(prof.Iteration(costmodel.Batch{DecodeSeqs: batch, DecodeContext: ctx * batch}))
	memoPut(&p.stepMemos, prof, batch, ctx, x)
	return x
}

// memoGet finds the figure remembered for (prof, a, b) in a per-decision
// memo (prefillMemo, stepMemo).
func memoGet(memo []memoEntry, prof costmodel.Profile, a, b int) (float64, bool) {
	for _, e := range memo {
		if e.a == a && e.b == b && e.prof == prof {
			return e.v, true
		}
	}
	return 0, false
}

// memoPut remembers x for (prof, a, b) while the memo has room.
func memoPut(memo *[]memoEntry, prof costmodel.Profile, a, b int, x float64) {
	if len(*memo) < memoSize {
		*memo = append(*memo, memoEntry{prof, a, b, x})
	}
}

// Route implements Policy (Algorithm 1 of the paper).
func (p *E2) Route(req *Request, v *View, now time.Time) (Decision, error) {
	p.pfMemo, p.stepMemos = p.pfMemo[:0], p.stepMemos[:0]
	p.nowNS = now.UnixNano()
	p.expire(now.UnixNano())
	if v.Up() == 0 {
		return Decision{}, ErrNoReplica
	}
	matchedBlocks := 0
	for r, m := range v.Match.PerReplica {
		if r < len(v.Replicas) && v.Replicas[r].Up && m > matchedBlocks {
			matchedBlocks = m
		}
	}
	matched := min(matchedBlocks*v.BlockTokens(), req.PromptTokens)
	missed := req.PromptTokens - matched

	p.cands, p.terms = p.cands[:0], p.terms[:0]
	d := Decision{Replica: -1}
	mix := -1
	if missed >= matched && p.cfg.Mixing {
		mix = p.mixTarget(v)
	}
	switch {
	case missed < matched:
		d.Branch = "exploit"
		var set *prefixtree.Set
		if p.cfg.ExploitAssignedOnly {
			set = p.assignedSet(v, matchedBlocks)
		}
		p.pick(req, v, set, &d)
	case mix >= 0:
		d.Branch = "mixing"
		c := p.price(mix, req, v)
		d.Replica, d.MatchedTokens = mix, c.MatchedTokens
	default:
		d.Branch = "explore"
		p.pick(req, v, nil, &d)
	}
	if d.Replica < 0 {
		return Decision{}, ErrNoReplica
	}
	d.Candidates = slices.Clone(p.cands)
	if req.Explain {
		terms := slices.Clone(p.terms)
		for i := range d.Candidates {
			d.Candidates[i].Terms = &terms[i]
		}
	}
	return d, nil
}

// price adds replica r to the decision's candidates, priced (cost), its
// terms beside it, and returns it.
func (p *E2) price(r int, req *Request, v *View) *Candidate {
	p.cands = append(p.cands, Candidate{})
	p.terms = append(p.terms, E2Terms{})
	c := &p.cands[len(p.cands)-1]
	p.cost(c, &p.terms[len(p.terms)-1], r, req, v)
	return c
}

// assignedSet returns the assigned set of the deepest node among the first
// matchedBlocks blocks of the path that has one, if any of its replicas is up.
func (p *E2) assignedSet(v *View, matchedBlocks int) *prefixtree.Set {
	depth := 0
	var best *prefixtree.Set
	for _, n := range v.Match.Path {
		if depth >= matchedBlocks {
			break
		}
		depth += n.Own()
		if n.Assigned.Empty() {
			continue
		}
		up := false
		n.Assigned.Each(func(r int) {
			if r < len(v.Replicas) && v.Replicas[r].Up {
				up = true
			}
		})
		if up {
			best = &n.Assigned
		}
	}
	return best
}

// pick chooses argmin cost over set (all up replicas when nil), ties to the
// lowest ID.
func (p *E2) pick(req *Request, v *View, set *prefixtree.Set, d *Decision) {
	bestScore := math.Inf(1)
	for r := range v.Replicas {
		if !v.Replicas[r].Up || (set != nil && !set.Has(r)) {
			continue
		}
		c := p.price(r, req, v)
		if !finite(c.Score) {
			c.Score = math.MaxFloat64
		}
		// Costs within tieTolerance of each other are estimates of the same
		// thing: break the tie on what is certain.
		tol := tieTolerance * math.Max(bestScore, 0)
		if !p.cfg.TieBreakInFlight {
			tol = 0
		}
		better := d.Replica < 0 || c.Score < bestScore-tol
		if !better && p.cfg.TieBreakInFlight && c.Score <= bestScore+tol {
			// Equal cost (a short prefill is weight-bound: a hit saves no
			// time): prefer the cache, then fewer requests in flight.
			switch {
			case c.MatchedTokens != d.MatchedTokens:
				better = c.MatchedTokens > d.MatchedTokens
			default:
				better = v.Replicas[r].InFlight < v.Replicas[d.Replica].InFlight
			}
		}
		if better {
			d.Replica, bestScore, d.MatchedTokens = r, c.Score, c.MatchedTokens
		}
	}
}

// mixTarget returns the up replica whose hit ratio over the mix window is at
// least MixHitRatio (the highest such; ties to the lowest ID), or -1.
func (p *E2) mixTarget(v *View) int {
	best, bestRatio := -1, -1.0
	for r := range v.Replicas {
		if !v.Replicas[r].Up || r >= len(p.reps) {
			continue
		}
		rs := &p.reps[r]
		if rs.mixPrompt == 0 {
			continue
		}
		ratio := float64(rs.mixHit) / float64(rs.mixPrompt)
		if ratio >= p.cfg.MixHitRatio && ratio > bestRatio {
			best, bestRatio = r, ratio
		}
	}
	return best
}

// Routed implements Observer: the request enters the window, its prefix is
// assigned to the chosen replica, and rebalancing runs when due.
func (p *E2) Routed(req *Request, d *Decision, v *View, now time.Time) {
	ns := now.UnixNano()
	r := d.Replica
	var last *prefixtree.Node
	if len(v.Match.Path) > 0 {
		last = v.Match.Path[len(v.Match.Path)-1]
	}
	node := prefixtree.ImportantAncestor(last)
	e := p.newEntry()
	*e = e2Entry{
		id: req.ID, at: ns, node: node, replica: int32(r),
		prompt: sat32(req.PromptTokens), hit: sat32(d.MatchedTokens), out: sat32(req.OutputTokens),
		prefill: p.prefillMemo(v, r, p.routedMissed(r, req, d.MatchedTokens, v), v.SeqFor(r, req)),
		ttft:    -1, live: true, queued: true, inMix: true,
	}
	p.queue = append(p.queue, e)
	if old, ok := p.live[req.ID]; ok {
		old.live = false
	}
	p.live[req.ID] = e
	rs := p.rep(r)
	rs.hist += e.prefill
	rs.mixPrompt += int(e.prompt)
	rs.mixHit += int(e.hit)
	if s := stats(node); s != nil {
		s.count++
		s.prompt += int(e.prompt)
		s.hit += int(e.hit)
		s.out += int(e.out)
		pr := s.at(r)
		pr.count++
		pr.load += e.prefill
		s.entries = append(s.entries, e)
		if s.active < 0 {
			s.active = int32(len(p.active))
			p.active = append(p.active, node)
		}
		node.Assigned.Add(r)
	}
	if req.Adapter != "" || p.adapterList != nil {
		// Adapter placement sizes an adapter's set by its share of the
		// cluster's work, base-model requests' included from the first
		// adapter's request on (no base-model decision reads it, and a run
		// without adapters never calls the cost model here: its decisions
		// and results stay bit-identical).
		work := e.prefill
		if req.OutputTokens > 1 {
			rp := &v.Replicas[r]
			work += float64(req.OutputTokens-1) * p.stepMemo(v, r, rp.InFlight+1, decodeContext(rp, req))
		}
		p.placeAdapter(req.Adapter, r, work, v, ns)
	}
	p.routed++
	if (p.cfg.Rebalance || p.cfg.Replicate) && p.routed >= p.cfg.WarmupPerReplica*max(v.Up(), 1) &&
		(p.cfg.RebalanceInterval == 0 || !p.rebalanced || ns-p.lastReb >= int64(p.cfg.RebalanceInterval)) {
		p.lastReb, p.rebalanced = ns, true
		p.rebalance(v, ns)
	}
}

// sat32 is n as an int32, saturated: a request's token counts fit in 31
// bits; one that does not (an absurd max_tokens) must not wrap around.
func sat32(n int) int32 { return int32(min(max(n, math.MinInt32), math.MaxInt32)) }

func (p *E2) newEntry() *e2Entry {
	if n := len(p.free); n > 0 {
		e := p.free[n-1]
		p.free = p.free[:n-1]
		return e
	}
	return &e2Entry{}
}

func (p *E2) release(e *e2Entry) {
	if !e.live && !e.queued {
		*e = e2Entry{}
		p.free = append(p.free, e)
	}
}

// FirstToken implements Observer.
func (p *E2) FirstToken(id uint64, replica int, ttft time.Duration, now time.Time) {
	if e, ok := p.live[id]; ok {
		e.ttft = ttft.Seconds()
	}
}

// Finished implements Observer: the request's TPOT joins the replica's
// samples. A request that failed before its first token (a connection
// error, a 5xx, a cancel while queued) leaves the window at once (drop).
func (p *E2) Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time) {
	e, found := p.live[id]
	if !found {
		return
	}
	delete(p.live, id)
	e.live = false
	if !ok && e.ttft < 0 && outputTokens <= 0 && e.queued && !e.dropped {
		p.drop(e, now.UnixNano())
	}
	if ok && e.ttft >= 0 && outputTokens > 1 {
		lat := float64(now.UnixNano()-e.at) / 1e9
		if tp := (lat - e.ttft) / float64(outputTokens-1); tp > 0 && finite(tp) {
			rs := p.rep(int(e.replica))
			if len(rs.tpot) < p.cfg.TPOTSamples {
				rs.tpot = append(rs.tpot, tp)
			} else {
				rs.tpot[rs.tpotNext] = tp
				rs.tpotNext = (rs.tpotNext + 1) % len(rs.tpot)
			}
			rs.tpotDirty++
		}
	}
	p.release(e)
}

// ReplicaDown implements Observer: the replica leaves every assigned set.
func (p *E2) ReplicaDown(r int, now time.Time) {
	for _, n := range p.active {
		n.Assigned.Remove(r)
	}
	for _, st := range p.adapterList {
		st.set.Remove(r)
	}
	if r < len(p.reps) {
		p.reps[r].tpot = p.reps[r].tpot[:0]
	}
}

// expire drops requests older than the windows from the statistics. When a
// replica's count on a prefix reaches zero it leaves the prefix's assigned
// set (replication shrinks as load falls); a prefix with no request left in
// the window loses its placement (ALGORITHMS §2).
func (p *E2) expire(ns int64) {
	mixCut := ns - int64(p.cfg.MixWindow)
	for p.mixHead < len(p.queue) && p.queue[p.mixHead].at < mixCut {
		p.unmix(p.queue[p.mixHead])
		p.mixHead++
	}
	cut := ns - int64(p.cfg.Window)
	for p.head < p.mixHead && p.queue[p.head].at < cut {
		e := p.queue[p.head]
		p.queue[p.head] = nil
		p.head++
		if !e.dropped {
			p.unwindow(e, ns)
		} else if n := e.node; n != nil && !n.Evicted() {
			// Its prefix's entry list may hold it still, first (the
			// list is in time order and expiry takes the queue's).
			if s, ok := n.Ext.(*e2Node); ok && len(s.entries) > 0 && s.entries[0] == e {
				s.entries[0] = nil
				s.entries = s.entries[1:]
			}
		}
		e.queued = false
		p.release(e)
	}
	// Compact the FIFO once its dead head dominates.
	if p.head > 1024 && p.head*2 > len(p.queue) {
		k := copy(p.queue, p.queue[p.head:])
		clear(p.queue[k:])
		p.queue = p.queue[:k]
		p.mixHead -= p.head
		p.head = 0
	}
}

// unmix takes e out of its replica's mix-window figures, once.
func (p *E2) unmix(e *e2Entry) {
	if !e.inMix {
		return
	}
	e.inMix = false
	rs := p.rep(int(e.replica))
	rs.mixPrompt -= int(e.prompt)
	rs.mixHit -= int(e.hit)
}

// unwindow takes e out of the windowed statistics: its replica's history
// and its prefix's figures (see expire).
func (p *E2) unwindow(e *e2Entry, ns int64) {
	rs := p.rep(int(e.replica))
	rs.hist -= e.prefill
	if rs.hist < 1e-12 {
		rs.hist = 0
	}
	n := e.node
	if n == nil || n.Evicted() {
		return
	}
	s := stats(n)
	s.count--
	s.prompt -= int(e.prompt)
	s.hit -= int(e.hit)
	s.out -= int(e.out)
	if len(s.entries) > 0 && s.entries[0] == e {
		s.entries[0] = nil
		s.entries = s.entries[1:]
	}
	pr := s.at(int(e.replica))
	pr.count--
	pr.load -= e.prefill
	if pr.count <= 0 {
		*pr = e2NodeReplica{}
		if r := int(e.replica); n.Assigned.Len() > 1 && n.Assigned.Has(r) {
			n.Assigned.Remove(r)
			p.Shrinks++
		}
	}
	if s.count <= 0 {
		n.Assigned.Clear()
		p.deactivate(n, s)
		p.forget(n, s, ns)
	}
}

// drop takes a request that failed before its first token out of the
// windowed statistics now, as its expiry would later: it did no prefill
// work the window should price (L's history, the mix ratio), and it is not
// demand for its prefix (count, miss rate, placement) — the client's retry
// is counted when it is routed. The cache it may have left is the tree's
// business (KV events). A request that produced a token keeps its place:
// its prefill ran. It stays queued, counting nothing, so the FIFO keeps
// its time order; its prefix's entry list keeps it too (overloaded skips
// it: it has no TTFT) until expire takes it.
func (p *E2) drop(e *e2Entry, ns int64) {
	p.unmix(e)
	p.unwindow(e, ns)
	e.dropped = true
}

func (p *E2) deactivate(n *prefixtree.Node, s *e2Node) {
	if s.active < 0 {
		return
	}
	last := len(p.active) - 1
	moved := p.active[last]
	p.active[s.active] = moved
	if ms, ok := moved.Ext.(*e2Node); ok {
		ms.active = s.active
	}
	p.active[last] = nil
	p.active = p.active[:last]
	s.active = -1
	s.entries = s.entries[:0]
}

// forget releases the memory of a prefix unit with no request left in the
// window (s.count == 0): its per-replica figures are all zero and its entry
// list empty, which nil slices say as well. The statistics themselves go
// (stats recreates them on the next request) unless a move cooldown still
// runs, the one thing they remember past the window.
func (p *E2) forget(n *prefixtree.Node, s *e2Node, ns int64) {
	s.per, s.entries = nil, nil
	if !s.everMoved || ns-s.lastMove >= int64(p.cfg.MoveCooldown) {
		n.Ext = nil
	}
}

// rebalance is Preble's load rebalancing (§3.2 "Load rebalancing" and
// "Prefix autoscaling"): pair the heaviest replica with the lightest; while
// the heavy one carries at least Thbal times the light one's load, move its
// cheapest hot prefixes over (several prefixes) or replicate its lone hot
// prefix when that prefix's TTFT has doubled across the window.
func (p *E2) rebalance(v *View, ns int64) {
	n := len(v.Replicas)
	if cap(p.lrb) < n {
		p.lrb = make([]float64, n)
	}
	p.lrb = p.lrb[:n]
	clear(p.lrb)
	// Drop evicted nodes from the active list first.
	for i := 0; i < len(p.active); {
		if p.active[i].Evicted() {
			last := len(p.active) - 1
			p.active[i] = p.active[last]
			if ms, ok := p.active[i].Ext.(*e2Node); ok {
				ms.active = int32(i)
			}
			p.active = p.active[:last]
			continue
		}
		i++
	}
	for _, nd := range p.active {
		s := stats(nd)
		if s.count < p.cfg.MinHotCount {
			continue
		}
		for r := range s.per {
			if r < n {
				p.lrb[r] += s.per[r].load
			}
		}
	}
	if !p.cfg.MovableLoadOnly {
		for r := 0; r < n; r++ {
			p.lrb[r] += p.decodeLoad(v, r)
		}
	}
	p.order = p.order[:0]
	for r := 0; r < n; r++ {
		if v.Replicas[r].Up {
			p.order = append(p.order, r)
		}
	}
	if len(p.order) < 2 {
		return
	}
	slices.SortFunc(p.order, func(a, b int) int {
		if p.lrb[a] != p.lrb[b] {
			if p.lrb[a] > p.lrb[b] {
				return -1
			}
			return 1
		}
		return a - b
	})
	for i, j := 0, len(p.order)-1; i < j; i, j = i+1, j-1 {
		h, l := p.order[i], p.order[j]
		if p.lrb[h] <= 0 || p.lrb[h] < p.cfg.BalanceThreshold*p.lrb[l] {
			break
		}
		p.hot = p.hot[:0]
		for _, nd := range p.active {
			s := stats(nd)
			if s.count >= p.cfg.MinHotCount && h < len(s.per) && s.per[h].count > 0 && nd.Assigned.Has(h) {
				p.hot = append(p.hot, nd)
			}
		}
		switch {
		case len(p.hot) > 1 && p.cfg.Rebalance:
			slices.SortFunc(p.hot, func(a, b *prefixtree.Node) int {
				la, lb := stats(a).per[h].load, stats(b).per[h].load
				switch {
				case la < lb:
					return -1
				case la > lb:
					return 1
				}
				return a.Depth() - b.Depth()
			})
			for _, nd := range p.hot {
				s := stats(nd)
				ld := s.per[h].load
				if p.lrb[h]-ld < p.lrb[l]+ld {
					break // the move would invert the imbalance
				}
				if p.cfg.MoveCooldown > 0 && s.everMoved && ns-s.lastMove < int64(p.cfg.MoveCooldown) {
					continue
				}
				if p.cfg.MovableLoadOnly {
					bt := v.BlockTokens()
					recompute := secs(v.ProfileOf(l).Prefill((nd.Depth()+nd.Own())*bt, (nd.Depth()+nd.Own())*bt))
					if ld <= recompute {
						continue
					}
				}
				nd.Assigned.Clear()
				nd.Assigned.Add(l)
				s.lastMove, s.everMoved = ns, true
				p.lrb[h] -= ld
				p.lrb[l] += ld
				p.Moves++
			}
		case len(p.hot) == 1 && p.cfg.Replicate:
			nd := p.hot[0]
			if !nd.Assigned.Has(l) && p.overloaded(stats(nd)) {
				nd.Assigned.Add(l)
				p.Replications++
			}
		}
	}
}

// overloaded reports whether a prefix's mean TTFT over the newer half of its
// window is at least ReplicateTTFTRatio times the older half's.
func (p *E2) overloaded(s *e2Node) bool {
	var older, newer float64
	var no, nn int
	k := 0
	total := 0
	for _, e := range s.entries {
		if e != nil && e.ttft >= 0 {
			total++
		}
	}
	if total < 4 {
		return false
	}
	for _, e := range s.entries {
		if e == nil || e.ttft < 0 {
			continue
		}
		if k < total/2 {
			older += e.ttft
			no++
		} else {
			newer += e.ttft
			nn++
		}
		k++
	}
	if no == 0 || nn == 0 || older <= 0 {
		return false
	}
	return newer/float64(nn) >= p.cfg.ReplicateTTFTRatio*older/float64(no)
}

// Window reports E2's view of a replica for dashboards and tests: windowed
// prefill seconds, mix-window hit ratio and TPOT median.
func (p *E2) Window(r int) (histLoad, hitRatio float64) {
	if r >= len(p.reps) {
		return 0, 0
	}
	rs := &p.reps[r]
	if rs.mixPrompt > 0 {
		hitRatio = float64(rs.mixHit) / float64(rs.mixPrompt)
	}
	return rs.hist, hitRatio
}

// Prefixes calls fn for every prefix unit with requests in E2's window (its
// active list, in no particular order), with that count. n.Assigned is the
// unit's placement. For dashboards: read under the router owner's lock, and
// do not keep n after fn returns.
func (p *E2) Prefixes(fn func(n *prefixtree.Node, count int)) {
	for _, n := range p.active {
		if s, ok := n.Ext.(*e2Node); ok && s.count > 0 && !n.Evicted() {
			fn(n, s.count)
		}
	}
}
