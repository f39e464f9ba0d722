// Package policy holds prefixlb's routing policies: Preble's E2 and the
// baselines it is measured against (round-robin, random, least-load,
// power-of-two, session affinity, prefix affinity, and the scorers of llm-d,
// SGLang and NVIDIA Dynamo).
//
// A policy is pure: it reads the request and a snapshot of the cluster (the
// View) and returns a Decision; time and randomness are passed in. The same
// code runs inside `prefixlb serve` and inside `prefixlb sim`.
package policy

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// ErrNoReplica is returned when no replica is up to take a request.
var ErrNoReplica = errors.New("policy: no replica is up")

// ErrUnknownPolicy is returned by New for a name it does not know.
var ErrUnknownPolicy = errors.New("policy: unknown policy")

// Request is what a policy knows about one request.
type Request struct {
	// ID identifies the request to observations (unique among in-flight ones).
	ID uint64
	// Keys are the chain keys of the prompt's full blocks (internal/blocks).
	Keys []blocks.Key
	// PromptTokens is the prompt's length in tokens (≥ len(Keys)·block size).
	PromptTokens int
	// Estimated says PromptTokens and the keys' tokens are estimated from
	// the prompt's bytes (text keyed by chunks, keying.ChunkKeyer: four
	// bytes to a unit), not counted by the engine's tokenizer: the router
	// then converts the engine's reports into its units
	// (router.CacheView.UnitsPerToken).
	Estimated bool
	// OutputTokens is the expected output length (max_tokens); 0 if unknown.
	OutputTokens int
	// Session is a session key for affinity ("" if none).
	Session string
	// Unary says the client asked for a response that is not streamed:
	// the front door will see its end but not its first token (the router
	// then cannot time its prefill; internal/calibrate).
	Unary bool
	// Explain asks for the decision's whole explanation: e2 then gives each
	// candidate its cost term by term (Candidate.Terms), at the price of
	// one more allocation. Routing ignores it.
	Explain bool
	// Adapter names the LoRA adapter the request asks for (vLLM serves an
	// adapter under its own model name); "" for the base model. Keys are
	// expected to be the adapter's own (an adapter's blocks never match
	// another's, as vLLM hashes the adapter into each block); policies that
	// price adapter residency read it (Replica.Adapters).
	Adapter string
}

// Replica is a snapshot of one replica as the router sees it.
type Replica struct {
	// ID is the replica's index, stable for its lifetime.
	ID int
	// Name is the replica's display name (an address, a pod name).
	Name string
	// Up is false for replicas that are down or draining: never chosen.
	Up bool
	// InFlight counts requests routed to the replica and not yet finished.
	InFlight int
	// Prefilling counts in-flight requests that have not produced a token.
	Prefilling int
	// PendingPrefill is the predicted GPU time of the prefill still owed by
	// those requests (the router's estimate when it routed them).
	PendingPrefill time.Duration
	// PendingPrefillTokens is the number of prompt tokens those requests
	// still have to compute (not cached on the replica when routed).
	PendingPrefillTokens int
	// PendingTierPrefill is the part of PendingPrefill that is the
	// recompute of prompt tokens the router expected the replica to load
	// from a slower cache tier when it routed them (View.TierHit; their
	// count is PendingTierTokens): the replica copies them beside its
	// batches instead of computing them (vLLM's OffloadingConnector), so
	// a tier-aware policy takes them out of the queue's GPU time. 0
	// without tier sets.
	PendingTierPrefill time.Duration
	PendingTierTokens  int
	// DecodeTokens is the number of output tokens still owed by in-flight
	// requests (their expected output minus what they produced).
	DecodeTokens int
	// Decoding counts in-flight requests past their first token, and
	// DecodeContextTokens the context (prompt + output so far) they hold.
	Decoding, DecodeContextTokens int
	// Waiting and Running are the engine's own queue figures (scraped
	// vllm:num_requests_waiting / running); -1 when unknown.
	Waiting, Running int
	// KVUsage is the engine's KV-cache usage in [0,1]; -1 when unknown.
	// vLLM's and SGLang's count the blocks running requests hold (cached
	// blocks no request uses are free, evictable), so KVUsage ×
	// KVCapacityOf is a floor on what the replica holds.
	KVUsage float64
	// KVCapacity is the replica's KV cache in tokens as its engine reports
	// it (serve and epp: vllm:cache_config_info, SGLang's server info,
	// llama.cpp's /props) or as the simulator configures it; 0 when
	// unknown: View.KVCapacityOf then falls back on the profile's.
	KVCapacity int
	// TPOT is the replica's recent median time per output token (0 unknown).
	TPOT time.Duration
	// Slots is the number of prompt slots of a slot cache (llama.cpp's
	// -np: one cached prompt per slot); 0 for a block cache (vLLM, SGLang).
	Slots int
	// SlotSpan is, for a slot cache, the tokens of KV the replica would
	// hold with the request in the slot it would land on: its prompt and
	// every other slot's cached tokens, idle slots' included. llama.cpp's
	// attention runs over all of them, so a prefill there costs
	// Prefill(missed, SlotSpan), which is what the replica's profile
	// measures (docs/profiles.md, llamacpp-tiny-cpu). 0 for a block cache;
	// set per decision by the router (SeqFor reads it).
	SlotSpan int
	// Role is the replica's role in a disaggregated cluster (RoleBoth, the
	// zero value: it prefills and decodes its own requests).
	Role Role
	// Transfers counts the disaggregated requests in flight whose KV
	// moves from or to this replica and has not yet arrived (routed to it
	// as their prefill or decode replica, no token out of the decode yet):
	// they share its link (View.KVLink).
	Transfers int
	// Adapters lists the LoRA adapters the replica holds in its GPU slots
	// (vLLM's max_loras), most recently used first when the source knows
	// the order; nil when none, or unknown. The router's caller sets it
	// (router.SetAdapters): from vLLM's vllm:lora_requests_info gauge
	// (running_lora_adapters) in serve, from the replica model in sim.
	Adapters []string
	// MaxAdapters is the replica's number of adapter slots (vLLM's
	// max_loras, the gauge's max_lora label); 0 when unknown or when the
	// replica serves no adapters. Policies price adapter loads only where
	// it is positive.
	MaxAdapters int
	// AdapterBytes is the size of an adapter the replica would load, which
	// with its profile's costmodel.AdapterLoad gives the load time
	// (View.AdapterLoadTime); 0 prices only the fixed cost.
	AdapterBytes int64
	// RunningAdapters lists the adapters the engine's running requests use
	// and WaitingAdapters those of its waiting requests (vLLM's
	// vllm:lora_requests_info, labels running_lora_adapters and
	// waiting_lora_adapters; the replica model's in sim): vLLM admits a
	// request for an adapter its running requests do not use only while
	// they use fewer than MaxAdapters (E2's adapter_wait). nil when none or
	// unknown. The router's caller sets them (router.SetRunningAdapters).
	RunningAdapters, WaitingAdapters []string
	// AdapterFlights is the router's own requests in flight on the replica
	// for each adapter that has some (not the base model's), in no
	// particular order: how soon a running adapter's requests drain
	// (E2's adapter_wait). The router keeps it; a snapshot holds a copy.
	AdapterFlights []AdapterFlight
}

// AdapterFlight is the router's in-flight requests on one replica for one
// LoRA adapter (Replica.AdapterFlights).
type AdapterFlight struct {
	// Adapter names the adapter.
	Adapter string
	// InFlight counts its requests routed to the replica and not finished.
	InFlight int
	// DecodeTokens is the output those requests are expected to produce
	// (their expected output: the router does not count tokens as they
	// stream), as Replica.DecodeTokens counts it.
	DecodeTokens int
}

// AdapterFlightOf returns the router's in-flight figures for adapter a on
// the replica (zero when it has none there).
func (r *Replica) AdapterFlightOf(a string) AdapterFlight {
	for _, f := range r.AdapterFlights {
		if f.Adapter == a {
			return f
		}
	}
	return AdapterFlight{Adapter: a}
}

// HoldsAdapter reports whether the replica holds adapter a in a GPU slot;
// true for the base model ("") and when slots are unknown (MaxAdapters 0).
func (r *Replica) HoldsAdapter(a string) bool {
	if a == "" || r.MaxAdapters <= 0 {
		return true
	}
	for _, x := range r.Adapters {
		if x == a {
			return true
		}
	}
	return false
}

// AdapterSlotsFull reports whether every adapter slot of the replica is
// taken (a load would evict another adapter).
func (r *Replica) AdapterSlotsFull() bool {
	return r.MaxAdapters > 0 && len(r.Adapters) >= r.MaxAdapters
}

// Queue is the replica's waiting queue, what GIE's queue scorer and
// saturation detector read (WaitingQueueSize, from vllm:num_requests_waiting
// or sglang:num_queue_reqs): the engine's waiting count when scraped, else
// the router's own count of requests routed to the replica that have not
// produced a token (Prefilling). Running requests do not count. Prefilling
// is the closest the router has to "waiting": like the engine's figure it
// leaves out the decoding requests (which the engine counts as running),
// and it over-counts only by the requests whose prefill is under way.
func (r *Replica) Queue() int {
	if r.Waiting >= 0 {
		return r.Waiting
	}
	return max(r.Prefilling, 0)
}

// View is the cluster as a policy sees it for one decision. The router fills
// it; policies must not keep it after Route returns.
type View struct {
	// Replicas lists every replica slot, by ID (Replicas[i].ID == i).
	Replicas []Replica
	// Tree is the router's global prefix tree; the request's keys are already
	// inserted. Policies read it and may change only routing state
	// (Node.Assigned, Node.Ext).
	Tree *prefixtree.Tree
	// Match is the request's path in Tree, with PerReplica holding how many
	// leading blocks each replica cached before this request.
	Match *prefixtree.Match
	// Profile prices prefill and decode on a replica that has no profile of
	// its own in Profiles.
	Profile costmodel.Profile
	// Profiles, when set, holds each replica's own profile by ID (a
	// heterogeneous cluster, or a cost model calibrated per replica: see
	// internal/calibrate); a nil entry, or an ID past its end, means
	// Profile. Read it through ProfileOf.
	Profiles []costmodel.Profile
	// Rand is the decision's source of randomness (seeded by the caller).
	Rand *rand.Rand
	// Victims, when set, calls fn for the nodes replica r would stop
	// caching if it took this request, for replicas whose cache is not a
	// block LRU (Replica.Slots > 0: a llama.cpp slot is overwritten whole).
	Victims func(r int, fn func(n *prefixtree.Node) bool)
	// KVLink is the network a disaggregated request's KV crosses from its
	// prefill replica to its decode replica (zero: unknown, not priced).
	KVLink KVLink
	// TierHit, when set, is how many of req's prompt tokens after the gpu
	// tokens replica r caches on its GPU it holds in slower cache tiers
	// (CPU, disk: KV events of another medium), block after block, and the
	// seconds loading them to the GPU takes. nil: no tiers known.
	TierHit func(r int, req *Request, gpu int) (tokens int, loadSeconds float64)
	// TierSplit, when set, splits the tokens TierHit counts by tier: those
	// in host memory (medium costmodel.MediumCPU) and those in any other
	// slower tier (disk, an engine's own), as Dynamo's router splits its
	// lower-tier overlap into host and disk blocks. nil: no tiers known.
	TierSplit func(r int, req *Request, gpu int) (host, other int)
}

// TierSplitOf is v.TierSplit, or nothing without one.
func (v *View) TierSplitOf(r int, req *Request, gpu int) (host, other int) {
	if v.TierSplit == nil {
		return 0, 0
	}
	return v.TierSplit(r, req, gpu)
}

// TierHitOf is v.TierHit, or nothing without one.
func (v *View) TierHitOf(r int, req *Request, gpu int) (int, float64) {
	if v.TierHit == nil {
		return 0, 0
	}
	return v.TierHit(r, req, gpu)
}

// BlockTokens is the number of tokens per block key.
func (v *View) BlockTokens() int { return v.Tree.BlockTokens() }

// SeqFor is the sequence length a prefill of req is priced at on replica r:
// the replica's slot span on a slot cache (Replica.SlotSpan), else the
// prompt.
func (v *View) SeqFor(r int, req *Request) int {
	if r >= 0 && r < len(v.Replicas) && v.Replicas[r].SlotSpan > req.PromptTokens {
		return v.Replicas[r].SlotSpan
	}
	return req.PromptTokens
}

// ProfileOf returns the profile that prices work on replica r: its own
// (Profiles[r]) when it has one, else the cluster's (Profile).
func (v *View) ProfileOf(r int) costmodel.Profile {
	if r >= 0 && r < len(v.Profiles) && v.Profiles[r] != nil {
		return v.Profiles[r]
	}
	return v.Profile
}

// KVCapacityOf is replica r's KV cache in tokens: its own figure
// (Replica.KVCapacity) when known, else its profile's (ProfileOf).
func (v *View) KVCapacityOf(r int) int {
	if r >= 0 && r < len(v.Replicas) && v.Replicas[r].KVCapacity > 0 {
		return v.Replicas[r].KVCapacity
	}
	if p := v.ProfileOf(r); p != nil {
		return p.KVCapacity()
	}
	return 0
}

// AdapterLoadTime is the time replica r takes to load req's adapter into a
// GPU slot: 0 when it holds it (Replica.HoldsAdapter), else its profile's
// costmodel.AdapterLoad for Replica.AdapterBytes.
func (v *View) AdapterLoadTime(r int, req *Request) time.Duration {
	rp := &v.Replicas[r]
	if rp.HoldsAdapter(req.Adapter) {
		return 0
	}
	return costmodel.AdapterLoadOf(v.ProfileOf(r)).Time(rp.AdapterBytes)
}

// MatchedTokens is how many prompt tokens replica r caches for this request.
func (v *View) MatchedTokens(r int, req *Request) int {
	if r >= len(v.Match.PerReplica) {
		return 0
	}
	return min(v.Match.PerReplica[r]*v.BlockTokens(), req.PromptTokens)
}

// Up returns the number of replicas that are up.
func (v *View) Up() int {
	n := 0
	for i := range v.Replicas {
		if v.Replicas[i].Up {
			n++
		}
	}
	return n
}

// Decision is a policy's answer, with the explanation the proxy returns in a
// response header and the simulator aggregates.
type Decision struct {
	// Replica is the chosen replica's ID.
	Replica int
	// Branch names the rule that decided (exploit, explore, mixing, ...).
	Branch string
	// MatchedTokens is how many prompt tokens the chosen replica caches.
	MatchedTokens int
	// Candidates explains the scores of the replicas considered (may be empty
	// for policies that score nothing).
	Candidates []Candidate
	// Disaggregated says the request's prompt is prefilled on
	// PrefillReplica and its KV moved to Replica, which decodes it
	// (prefill/decode disaggregation; only policies that implement
	// Disaggregator set it). When false, Replica does both and the
	// PrefillReplica fields mean nothing.
	Disaggregated bool
	// PrefillReplica is the replica that prefills a disaggregated request.
	PrefillReplica int
	// PrefillMatchedTokens is how many prompt tokens PrefillReplica caches.
	PrefillMatchedTokens int
}

// Candidate is one replica's terms in a decision. Cost terms are seconds of
// GPU time (E2); scores are unitless (llm-d, SGLang).
type Candidate struct {
	Replica       int     `json:"replica"`
	MatchedTokens int     `json:"matched_tokens"`
	Load          float64 `json:"load,omitempty"`
	Eviction      float64 `json:"eviction,omitempty"`
	Prefill       float64 `json:"prefill,omitempty"`
	Score         float64 `json:"score"`
	// Terms is E2's cost term by term, each weighted as it enters Score
	// (Load is the sum of the L terms; E2Terms), when the request asked for
	// it (Request.Explain): in JSON an object keyed by the terms' names.
	// Nil, and absent from JSON, otherwise and for the other policies.
	Terms *E2Terms `json:"terms,omitempty"`
	// Leg, in a prefill/decode decision, says which choice the candidate
	// was priced for: "prefill" or "decode" (a leg of a disaggregated
	// request) or "" (the whole request on one replica).
	Leg string `json:"leg,omitempty"`
	// Transfer is, for a decode leg, the seconds its KV takes to arrive
	// from the prefill replica (View.TransferSeconds), part of Score.
	Transfer float64 `json:"transfer,omitempty"`
}

// Explain renders a decision compactly for the x-prefixlb-route header:
// `branch=exploit; matched=4096; r0=0.512(L=0.100,M=0,P=0.412,m=4096); ...`.
func (d *Decision) Explain() string {
	var b strings.Builder
	fmt.Fprintf(&b, "branch=%s; matched=%d", d.Branch, d.MatchedTokens)
	if d.Disaggregated {
		fmt.Fprintf(&b, "; prefill=r%d; prefill_matched=%d", d.PrefillReplica, d.PrefillMatchedTokens)
	}
	for _, c := range d.Candidates {
		leg := ""
		if c.Leg != "" {
			leg = c.Leg + ":" // a disaggregating policy prices each leg: prefill:r0=..., decode:r2=...
		}
		fmt.Fprintf(&b, "; %sr%d=%.4g(L=%.3g,M=%.3g,P=%.3g,m=%d)", leg, c.Replica, c.Score, c.Load, c.Eviction, c.Prefill, c.MatchedTokens)
	}
	return b.String()
}

// ExplainTerms renders the E2 cost terms of each candidate that has them
// (Candidate.Terms: e2, asked with Request.Explain), by name, in the order
// they are summed:
// `r0: decode=0 history=0 pending=0.1 ... eviction=0 prefill=0.412; r1: ...`.
// It is empty otherwise.
func (d *Decision) ExplainTerms() string {
	var b strings.Builder
	for _, c := range d.Candidates {
		if c.Terms == nil {
			continue
		}
		if b.Len() > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "r%d:", c.Replica)
		for t, x := range c.Terms {
			fmt.Fprintf(&b, " %s=%.3g", E2Term(t), x)
		}
	}
	return b.String()
}

// Policy chooses a replica for a request. Route must not block or do I/O.
// Implementations are not safe for concurrent use: the router serialises
// calls (and the observations of Observer) under its lock.
type Policy interface {
	// Name is the policy's name as given on the command line.
	Name() string
	// Route chooses among the replicas of v that are up.
	Route(req *Request, v *View, now time.Time) (Decision, error)
}

// Observer is implemented by policies that learn from what happens to the
// requests they routed (E2's windowed statistics). The router calls these
// methods, under the same lock as Route.
type Observer interface {
	// Routed follows a successful Route once the router has committed it.
	Routed(req *Request, d *Decision, v *View, now time.Time)
	// FirstToken reports a request's first output token.
	FirstToken(id uint64, replica int, ttft time.Duration, now time.Time)
	// Finished reports the end of a request (outputTokens generated; failed
	// requests report ok=false).
	Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time)
	// ReplicaDown reports that a replica left the pool.
	ReplicaDown(replica int, now time.Time)
}

// Speculator is implemented by policies that want the router to count a
// routed prompt as cached on its replica before the engine's KV events
// confirm it (router.Config.SpeculativeTTL). It covers the event lag, but
// it herds a purely sticky scorer: every request for a prefix that is new
// everywhere follows the first one before any replica has computed it.
// llm-d's precise scorer does it only with its speculativeIndexing setting
// (off by default; on in llm-d's newest precise-prefix-cache guide):
// llmd-precise:speculative=true. e2, which prices the holder's queue, does.
type Speculator interface {
	// Speculative reports whether the policy wants speculative entries.
	Speculative() bool
}

// Names lists the policies New knows, sorted.
func Names() []string {
	names := make([]string, 0, len(constructors))
	for n := range constructors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

var constructors = map[string]func(Options) (Policy, error){
	"round-robin":  func(Options) (Policy, error) { return &RoundRobin{}, nil },
	"random":       func(Options) (Policy, error) { return Random{}, nil },
	"least-load":   func(Options) (Policy, error) { return LeastLoad{}, nil },
	"power-of-two": func(Options) (Policy, error) { return PowerOfTwo{}, nil },
	"session":      func(Options) (Policy, error) { return &Session{}, nil },
	"prefix":       func(o Options) (Policy, error) { return NewPrefix(o.PrefixThreshold), nil },
	"llmd-precise": func(Options) (Policy, error) { return NewLLMDPrecise(), nil },
	"llmd-approx":  func(o Options) (Policy, error) { return NewLLMDApprox(o.BlockTokens, o.ApproxCapacityBlocks) },
	"sglang":       func(o Options) (Policy, error) { return NewSGLang(o.BlockTokens, o.ApproxCapacityBlocks) },
	"dynamo":       func(Options) (Policy, error) { return NewDynamo(DefaultDynamoConfig()), nil },
	"lmetric":      func(Options) (Policy, error) { return LMetric{}, nil },
	"e2":           func(o Options) (Policy, error) { return NewE2(o.E2) },
	"e2-preble":    func(o Options) (Policy, error) { return NewE2(o.E2Preble) },
	// Cache tiers: e2 crediting a slower tier's blocks as Dynamo does.
	"e2-fixedtier": func(o Options) (Policy, error) {
		c := o.E2
		c.Name, c.TierCredit = "e2-fixedtier", TierCreditFixed
		return NewE2(c)
	},
	// Prefill/decode disaggregation (pd.go).
	"round-robin-pd": func(Options) (Policy, error) { return &RoundRobinPD{}, nil },
	"llmd-pd":        func(Options) (Policy, error) { return NewLLMDPD(DefaultLLMDPDThreshold), nil },
	"dynamo-pd":      func(Options) (Policy, error) { return NewDynamoPD(DefaultDynamoConfig()), nil },
	"e2-pd":          func(o Options) (Policy, error) { return NewE2PD(o.E2PD) },
	// LoRA adapters (lora.go).
	"gie-lora": func(Options) (Policy, error) { return NewGIELoRA(DefaultGIELoRAWeight), nil },
}

// Options configures the policies New builds. DefaultOptions gives the
// published settings.
type Options struct {
	// BlockTokens is the block size of the keys (for policies with own trees).
	BlockTokens int
	// ApproxCapacityBlocks, when > 0, bounds the per-replica history of
	// llmd-approx and sglang (their record of what they sent where) at that
	// many blocks. 0, the default, leaves each its own bound: llmd-approx
	// each replica's KV capacity (GIE's AutoTune), sglang its max_tree_size.
	ApproxCapacityBlocks int
	// PrefixThreshold is the share of the prompt the `prefix` policy needs
	// matched to stick (else least-load).
	PrefixThreshold float64
	// E2 configures `e2`; E2Preble configures `e2-preble`; E2PD configures
	// `e2-pd`.
	E2, E2Preble, E2PD E2Config
}

// DefaultOptions returns the published settings for every policy.
func DefaultOptions() Options {
	return Options{
		BlockTokens:          blocks.DefaultBlockSize,
		ApproxCapacityBlocks: 0,
		PrefixThreshold:      0.5,
		E2:                   DefaultE2Config(),
		E2Preble:             PrebleE2Config(),
		E2PD:                 DefaultE2PDConfig(),
	}
}

// New builds the policy called name.
func New(name string, o Options) (Policy, error) {
	c, ok := constructors[name]
	if !ok {
		return nil, fmt.Errorf("%w %q (known: %s)", ErrUnknownPolicy, name, strings.Join(Names(), ", "))
	}
	return c(o)
}

// finite reports whether x is a usable number (not NaN, not ±Inf).
func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// argmin returns the up replica with the lowest score(r); ties go to the
// lowest ID (never to list position, which can change as replicas come and go).
func argmin(v *View, score func(r int) float64) (int, error) {
	best, bestScore := -1, math.Inf(1)
	for i := range v.Replicas {
		if !v.Replicas[i].Up {
			continue
		}
		s := score(i)
		if !finite(s) {
			s = math.MaxFloat64
		}
		if best < 0 || s < bestScore {
			best, bestScore = i, s
		}
	}
	if best < 0 {
		return -1, ErrNoReplica
	}
	return best, nil
}
