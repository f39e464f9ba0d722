package policy

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strconv"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// E2's cost of placing a request on replica r is the weighted sum of the
// terms below, in GPU seconds of latency. Preble (Srivatsa et al., "Preble:
// Efficient Distributed Prompt Scheduling for LLM Serving", ICLR 2025, §3.2)
// prices a replica as L + M + P: its load, the eviction the request causes
// and the request's own prefill. Here L is the sum of the terms from
// E2Decode to E2SlotWait, M is E2Eviction plus E2AdapterEviction and P is
// E2Prefill plus E2AdapterLoad (E2AdapterCascade joins M last; the adapter terms are 0 for the base model
// and where adapter slots are unknown; E2AdapterWait, an adapter's wait
// for a slot, is part of L, summed last for the same reason); each term is
// one method (…Term) whose doc comment gives its formula, the weights come
// from the E2Config (termWeights) and cost adds them up.

// E2Term names one term of E2's cost; Candidate.Terms holds a candidate's
// terms by E2Term. The order is the order of the sum.
type E2Term int

// The terms of E2's cost, in the order they are summed: L's, then M, then P.
const (
	E2Decode          E2Term = iota // L: in-flight decode (Preble)
	E2History                       // L: windowed prefill history (Preble)
	E2Pending                       // L: prefill queued now (llm-d's queue)
	E2Interference                  // L: delay this prefill imposes on decodes (prefixlb)
	E2SelfDecode                    // L: this request's own decode (prefixlb)
	E2PrefillSlowdown               // L: decodes' share of prefill iterations (prefixlb)
	E2SlotWait                      // L: wait for a free slot (prefixlb)
	E2Eviction                      // M: eviction (Preble)
	E2Prefill                       // P: this request's prefill (Preble)
	E2AdapterEviction               // M: evicting another LoRA adapter (prefixlb)
	E2AdapterLoad                   // P: loading this request's LoRA adapter (prefixlb)
	E2AdapterWait                   // L: waiting for the running adapters to free a slot (prefixlb)
	E2AdapterCascade                // M: reloads of an adapter placed where this one would evict it (prefixlb)
	NumE2Terms
)

// e2TermNames are the terms' names in explanations and JSON: the E2Config
// field that weighs each less "_weight", or the flag that turns it on.
var e2TermNames = [NumE2Terms]string{
	E2Decode:          "decode",
	E2History:         "history",
	E2Pending:         "pending",
	E2Interference:    "interference",
	E2SelfDecode:      "self_decode",
	E2PrefillSlowdown: "prefill_slowdown",
	E2SlotWait:        "slot_wait",
	E2Eviction:        "eviction",
	E2Prefill:         "prefill",
	E2AdapterEviction: "adapter_eviction",
	E2AdapterLoad:     "adapter_load",
	E2AdapterWait:     "adapter_wait",
	E2AdapterCascade:  "adapter_cascade",
}

// String returns the term's name ("pending", "self_decode", ...).
func (t E2Term) String() string {
	if t < 0 || t >= NumE2Terms {
		return "E2Term(" + strconv.Itoa(int(t)) + ")"
	}
	return e2TermNames[t]
}

// E2Terms is one candidate's E2 cost term by term (indexed by E2Term), each
// as it enters the cost, weight applied: Candidate.Load is the sum of the L
// terms (adapter_wait included), Eviction M and Prefill P, and Score their sum. A
// decision carries them when the request asks (Request.Explain), so that
// routing does not copy them into every decision. In JSON it is an object
// keyed by the terms' names, in term order.
type E2Terms [NumE2Terms]float64

// MarshalJSON implements json.Marshaler: {"decode":0,"history":0,...}.
func (t E2Terms) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, x := range t {
		if i > 0 {
			b.WriteByte(',')
		}
		v, err := json.Marshal(x)
		if err != nil {
			return nil, err
		}
		b.WriteString(strconv.Quote(e2TermNames[i]))
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON implements json.Unmarshaler; names it does not know are
// ignored.
func (t *E2Terms) UnmarshalJSON(data []byte) error {
	var m map[string]float64
	if err := json.Unmarshal(data, &m); err != nil {
		return err
	}
	*t = E2Terms{}
	for i, name := range e2TermNames {
		t[i] = m[name]
	}
	return nil
}

// sum returns L, the sum of the load terms, and the cost, L + M + P. The
// order of the additions is the cost's since before it had named terms: a
// different one could move the last bit of a cost, and so a tie. The
// adapter terms come last, so that for the base model (all 0) the cost is
// the same float it was before them; adapter_wait, a part of L, joins L
// after the rest of it.
func (t *E2Terms) sum() (load, cost float64) {
	for _, x := range t[:E2Eviction] {
		load += x
	}
	cost = load + t[E2Eviction] + t[E2Prefill]
	if t[E2AdapterEviction] != 0 || t[E2AdapterLoad] != 0 || t[E2AdapterWait] != 0 {
		load += t[E2AdapterWait]
		cost += t[E2AdapterEviction] + t[E2AdapterLoad] + t[E2AdapterWait]
	}
	if t[E2AdapterCascade] != 0 {
		cost += t[E2AdapterCascade]
	}
	return load, cost
}

// termWeights returns the weight of each term under c, the one place where
// the configuration becomes weights: a term's …Weight field, or 1 for a term
// a flag turns on (prefill_slowdown, slot_wait) and 0 for one it turns off;
// P weighs PrefillWeight only with IncludePrefill. The doc comments of
// DefaultE2Config and PrebleE2Config tabulate them (TestE2ConfigDocs).
func (c *E2Config) termWeights() [NumE2Terms]float64 {
	flag := func(on bool) float64 {
		if on {
			return 1
		}
		return 0
	}
	var w [NumE2Terms]float64
	w[E2Decode] = c.DecodeWeight
	w[E2History] = c.HistoryWeight
	w[E2Pending] = c.PendingWeight
	w[E2Interference] = c.InterferenceWeight
	w[E2SelfDecode] = c.SelfDecodeWeight
	w[E2PrefillSlowdown] = flag(c.PrefillSlowdown)
	w[E2SlotWait] = flag(c.SlotWait)
	w[E2Eviction] = c.EvictionWeight
	if c.IncludePrefill {
		w[E2Prefill] = c.PrefillWeight
	}
	w[E2AdapterEviction] = c.AdapterEvictionWeight
	w[E2AdapterLoad] = c.AdapterLoadWeight
	w[E2AdapterWait] = c.AdapterWaitWeight
	w[E2AdapterCascade] = c.AdapterCascadeWeight
	return w
}

// cost prices replica r for req into c: each term at its weight, into t,
// then their sum (E2Terms.sum, in E2Term order). prefill_slowdown stretches
// the weighted pending and prefill terms, so it is priced after them.
func (p *E2) cost(c *Candidate, t *E2Terms, r int, req *Request, v *View) {
	m := v.MatchedTokens(r, req)
	missed, load := p.tierMissed(r, req, m, v)
	rp := &v.Replicas[r]
	w := &p.weights
	pf := 0.0 // P_r before its weight, when a term reads it
	if w[E2Prefill] > 0 || w[E2Interference] > 0 {
		pf = p.prefillMemo(v, r, missed, v.SeqFor(r, req))
	}
	t[E2Decode] = p.decodeTerm(w[E2Decode], v, r)
	t[E2History] = p.historyTerm(w[E2History], r)
	t[E2Pending] = pendingTerm(w[E2Pending], rp) - p.pendingTierCredit(w[E2Pending], rp)
	t[E2Interference] = interferenceTerm(w[E2Interference], pf, rp)
	if req.Adapter != "" {
		t[E2Interference] += adapterInterference(w[E2Interference], r, req, v)
	}
	t[E2SelfDecode] = p.selfDecodeTerm(w[E2SelfDecode], r, req, v)
	// Blocks loaded from a slower tier take GPU memory too.
	t[E2Eviction] = p.evictionTerm(w[E2Eviction], r, req.PromptTokens-m, v)
	t[E2Prefill] = prefillTerm(w[E2Prefill], pf)
	if load > 0 && w[E2Prefill] > 0 {
		t[E2Prefill] += load // only this request waits for the copy: weight 1
	}
	t[E2PrefillSlowdown] = p.prefillSlowdownTerm(w[E2PrefillSlowdown], v, r, t[E2Pending]+t[E2Prefill])
	t[E2SlotWait] = p.slotWaitTerm(w[E2SlotWait], r, req, v)
	t[E2AdapterEviction] = adapterEvictionTerm(w[E2AdapterEviction], r, req, v)
	t[E2AdapterLoad] = adapterLoadTerm(w[E2AdapterLoad], r, req, v)
	t[E2AdapterWait] = p.adapterWaitTerm(w[E2AdapterWait], r, req, v)
	t[E2AdapterCascade] = p.adapterCascadeTerm(w[E2AdapterCascade], r, req, v)
	c.Replica, c.MatchedTokens = r, m
	c.Load, c.Score = t.sum()
	c.Eviction, c.Prefill = t[E2Eviction], t[E2Prefill]
	if t[E2AdapterEviction] != 0 || t[E2AdapterLoad] != 0 || t[E2AdapterCascade] != 0 {
		c.Eviction += t[E2AdapterEviction] + t[E2AdapterCascade]
		c.Prefill += t[E2AdapterLoad]
	}
}

// tierMissed is how many of req's prompt tokens r would compute, beyond
// its GPU hit of m tokens, and the seconds it would spend loading the rest
// from a slower cache tier (View.TierHit), under E2Config.TierCredit: a
// block held only in a slower tier is loaded (load), credited as a fixed
// fraction of a GPU hit, Dynamo's, with the rest of its recompute priced
// (fixed), or recomputed (none):
//
//	load:  missed = prompt − m − tier,  load = tier · KV bytes / bandwidth
//	fixed: missed = prompt − m − round(0.75·host + 0.25·other),  load = 0
//	none:  missed = prompt − m,  load = 0
func (p *E2) tierMissed(r int, req *Request, m int, v *View) (missed int, load float64) {
	missed = req.PromptTokens - m
	switch p.cfg.TierCredit {
	case TierCreditNone:
		return missed, 0
	case TierCreditFixed:
		host, other := v.TierSplitOf(r, req, m)
		credit := int(math.Round(DynamoHostCacheHitWeight*float64(host) + DynamoDiskCacheHitWeight*float64(other)))
		return missed - credit, 0
	}
	tier, load := v.TierHitOf(r, req, m)
	return missed - tier, load
}

// loadsTiers reports whether P prices a slower tier's blocks at their load
// (TierCreditLoad, the default).
func (p *E2) loadsTiers() bool {
	return p.cfg.TierCredit == "" || p.cfg.TierCredit == TierCreditLoad
}

// pendingTierCredit is the part of the pending term that is not GPU time
// under TierCreditLoad: the recompute of the prompt tokens the requests
// queued on r load from a slower tier instead (Replica.PendingTierPrefill,
// the router's own in-flight view). P prices such tokens at their copy,
// which runs beside the batches and delays only the request loading them,
// so the queue the next request waits behind holds none of their compute
// (prefixlb's extension; 0 in the other modes, which price them as they
// did):
//
//	pending = w · (Q_r − Q_r^tier)
func (p *E2) pendingTierCredit(w float64, rp *Replica) float64 {
	if w <= 0 || rp.PendingTierPrefill <= 0 || !p.loadsTiers() {
		return 0
	}
	return w * min(secs(rp.PendingTierPrefill), secs(max(rp.PendingPrefill, 0)))
}

// routedMissed is the prompt tokens of req, routed to r with a GPU hit of
// m tokens, that r computes, as the windowed history H counts their
// prefill: under TierCreditLoad the tokens r loads from a slower tier are
// not computed (tierMissed); the other modes count every token past the
// GPU hit, as they did.
func (p *E2) routedMissed(r int, req *Request, m int, v *View) int {
	if !p.loadsTiers() {
		return req.PromptTokens - m
	}
	missed, _ := p.tierMissed(r, req, m, v)
	return missed
}

// adapterLoadTerm is the time r takes to load this request's LoRA adapter
// into a GPU slot when it does not hold it (prefixlb's extension of P): the
// adapter's bytes over the profile's host-to-device bandwidth plus a fixed
// cost (costmodel.AdapterLoad; View.AdapterLoadTime). vLLM loads it before
// the step that admits the request, so the request waits for it. 0 for the
// base model, on a replica holding the adapter, and where the replica's
// slots are unknown (Replica.MaxAdapters 0):
//
//	adapter_load = w · (bytes / h2d bandwidth + fixed)   if r lacks the adapter
func adapterLoadTerm(w float64, r int, req *Request, v *View) float64 {
	if w <= 0 || req.Adapter == "" {
		return 0
	}
	return w * secs(v.AdapterLoadTime(r, req))
}

// adapterEvictionTerm is the part of M an adapter load causes (prefixlb's
// extension): when r lacks the adapter and its max_loras slots are all
// taken, the load evicts another adapter, whose next request on r pays a
// reload. It prices that one reload, at r's load time, as
// EvictionRecompute prices an evicted prefix at one recompute; the victim
// is taken to be still in use (under Zipf popularity nearly every resident
// adapter is). 0 while r has a free slot, holds the adapter, or for the
// base model:
//
//	adapter_eviction = w · T_load(r)   if r lacks the adapter and its slots are full
func adapterEvictionTerm(w float64, r int, req *Request, v *View) float64 {
	rp := &v.Replicas[r]
	if w <= 0 || req.Adapter == "" || !rp.AdapterSlotsFull() || rp.HoldsAdapter(req.Adapter) {
		return 0
	}
	return w * secs(costmodel.AdapterLoadOf(v.ProfileOf(r)).Time(rp.AdapterBytes))
}

// adapterWaitTerm is the time a request for a LoRA adapter waits on r
// before vLLM admits it, because r's running requests already use all its
// max_loras adapters and not this one (prefixlb's extension of L). vLLM's
// scheduler collects the adapters of the running requests it schedules
// (scheduled_loras) and skips a waiting request whose adapter is not among
// them while they number max_loras ("Scheduling would exceed max_loras,
// skip": vllm/v1/core/sched/scheduler.py, Scheduler.schedule,
// vllm-project/vllm @ 00024d314514900f361ad072af6931e403b7f589); the
// requests behind it go on, so it waits until a running adapter's requests
// have all finished and a slot frees. Waiting requests of adapters not
// running are ahead of it for the freed slots, so it needs the k-th slot
// to free, k the slots the running and those waiting adapters overfill:
//
//	k = |running_r| + |waiting_r − running_r − {a}| − max_r + 1
//	adapter_wait = w · drain_(min(k, |running_r|))(r)   if a ∉ running_r and k > 0
//	drain_b(r) = D_b/(n_b+1) · T_step(inflight_r, ctx_r)
//
// drain_(i) is the i-th shortest drain of r's running adapters. An adapter
// b drains when its last running request ends: the router's n_b requests
// for b in flight on r owe D_b output tokens as expected when routed (it
// does not count streamed tokens), so each owes an unknown share of its
// output, taken as uniform; the last of n of them ends after n/(n+1) of
// the mean output D_b/n_b, at r's decode step. An adapter r runs without
// any of the router's requests (another router's, or a stale report)
// counts as one request of r's mean output; one on an idle replica, 0.
// Requests that arrive for b meanwhile and keep it running are not
// counted: the wait is a lower bound. 0 for the base model, where the
// slots are unknown (MaxAdapters 0), and when a is running on r or a slot
// is free for it.
func (p *E2) adapterWaitTerm(w float64, r int, req *Request, v *View) float64 {
	rp := &v.Replicas[r]
	a := req.Adapter
	if w <= 0 || a == "" || rp.MaxAdapters <= 0 || len(rp.RunningAdapters) == 0 || slices.Contains(rp.RunningAdapters, a) {
		return 0
	}
	k := len(rp.RunningAdapters) - rp.MaxAdapters + 1
	for i, b := range rp.WaitingAdapters {
		if b != a && !slices.Contains(rp.RunningAdapters, b) && !slices.Contains(rp.WaitingAdapters[:i], b) {
			k++
		}
	}
	if k <= 0 {
		return 0
	}
	step := p.stepMemo(v, r, max(rp.InFlight, 1), decodeContext(rp, req))
	p.drains = p.drains[:0]
	for _, b := range rp.RunningAdapters {
		f := rp.AdapterFlightOf(b)
		n, d := f.InFlight, f.DecodeTokens
		if n <= 0 {
			n, d = 1, 0
			if rp.InFlight > 0 {
				d = max(rp.DecodeTokens, 0) / rp.InFlight
			}
		}
		p.drains = append(p.drains, float64(max(d, 0))/float64(n+1)*step)
	}
	slices.Sort(p.drains)
	return w * p.drains[min(k, len(p.drains))-1]
}

// decodeTerm is Preble's in-flight decode part of L (§3.2: the decode time
// of the requests running on r), with TPOT the replica's median observed
// time per output token, or with MarginalDecode the time one more sequence
// adds to a batched iteration of inflight_r (prefixlb):
//
//	decode = w · decode tokens owed on r · (TPOT_r | T_marginal(inflight_r))
func (p *E2) decodeTerm(w float64, v *View, r int) float64 {
	if w <= 0 {
		return 0
	}
	return w * p.decodeLoad(v, r)
}

// historyTerm is Preble's windowed part of L (§3.2: the prefill time of the
// requests routed to r over the last H minutes), in GPU seconds:
//
//	history = w · Σ_{window H} T_prefill of the requests routed to r
func (p *E2) historyTerm(w float64, r int) float64 {
	if w <= 0 {
		return 0
	}
	return w * p.rep(r).hist
}

// pendingTerm is the prefill queued on r now, Q_r, in GPU seconds: llm-d's
// "queue now" in Preble's currency (prefixlb's extension of L):
//
//	pending = w · Q_r
func pendingTerm(w float64, rp *Replica) float64 {
	if w <= 0 {
		return 0
	}
	return w * secs(rp.PendingPrefill)
}

// interferenceTerm is the delay this request's prefill imposes on the
// requests decoding on r: every iteration that carries a chunk of its prompt
// also carries one token of each, so its prefill time is added to each of
// their latencies (prefixlb's extension). P_r includes a LoRA adapter's
// load (adapterInterference):
//
//	interference = w · P_r · decoding_r
//
// (computed as (w·P_r)·decoding_r, as it always was: the order of the
// product fixes the last bit of the cost).
func interferenceTerm(w, pf float64, rp *Replica) float64 {
	if w <= 0 {
		return 0
	}
	return w * pf * float64(rp.Decoding)
}

// adapterInterference is the interference term's share of a LoRA adapter's
// load: the load is part of P (adapter_load), and vLLM loads a step's
// adapters before its forward pass, so every request decoding on r waits
// for it as it waits for a prefill chunk (the replica model adds the load
// to the iteration's time):
//
//	interference += w · T_load(r) · decoding_r   if r lacks the adapter
//
// It is added after the prefill's share, and only for an adapter's
// request, so that the base model's cost is the same float as before.
func adapterInterference(w float64, r int, req *Request, v *View) float64 {
	if w <= 0 {
		return 0
	}
	l := secs(v.AdapterLoadTime(r, req))
	if l <= 0 {
		return 0
	}
	return interferenceTerm(w, l, &v.Replicas[r])
}

// selfDecodeTerm is this request's own decode on r (prefixlb's extension;
// Preble leaves a request's own decode out): its output after the first
// token at the decode step of the batch it joins, the requests decoding on
// r (DecodeBatchInFlight: every request in flight there) plus itself, at
// most Slots on a slot cache, stretched with DecodePrefillRate by r's
// windowed prefill rate ρ_r = history/H (prefill that arrives meanwhile
// shares its iterations):
//
//	self_decode = w · (out−1) · T_step(batch_r+1, ctx_r) · (1 + ρ_r)
func (p *E2) selfDecodeTerm(w float64, r int, req *Request, v *View) float64 {
	if w <= 0 || req.OutputTokens <= 1 {
		return 0
	}
	rp := &v.Replicas[r]
	batch := rp.Decoding + 1
	if p.cfg.DecodeBatchInFlight {
		batch = rp.InFlight + 1
	}
	if rp.Slots > 0 {
		batch = min(batch, rp.Slots) // a slot cache decodes at most Slots at once
	}
	d := float64(req.OutputTokens-1) * p.stepMemo(v, r, batch, decodeContext(rp, req))
	if p.cfg.DecodePrefillRate {
		d *= 1 + p.rep(r).hist/p.cfg.Window.Seconds()
	}
	return w * d
}

// prefillSlowdownTerm stretches the queue ahead and this prompt's own
// prefill by s_r, the share of each chunked-prefill iteration r's running
// decodes take (decodeShare): chunked prefill carries one token of every
// running decode in each iteration (prefixlb's extension). stretched is the
// weighted pending + prefill terms:
//
//	prefill_slowdown = w · s_r · (pending + prefill)
func (p *E2) prefillSlowdownTerm(w float64, v *View, r int, stretched float64) float64 {
	if w <= 0 {
		return 0
	}
	return w * (p.decodeShare(v, r) * stretched)
}

// slotWaitTerm is, on a slot cache (Replica.Slots > 0, llama.cpp), the time
// this request would wait for a free slot when all are taken (prefixlb's
// extension; Preble's engines queue in a block cache):
//
//	slot_wait = w · slotWait(r)
func (p *E2) slotWaitTerm(w float64, r int, req *Request, v *View) float64 {
	if w <= 0 {
		return 0
	}
	return w * p.slotWait(r, req, v)
}

// evictionTerm is Preble's M (§3.2): the windowed prefill work of the cached
// prefixes that r would evict to make room for the tokens it misses
// (eviction), or with EvictionRecompute one recompute of each:
//
//	eviction = w · Σ_{evicted n} missRate_n · count_n · T_prefill(n)
func (p *E2) evictionTerm(w float64, r, missed int, v *View) float64 {
	if w <= 0 || missed <= 0 {
		return 0
	}
	return w * p.eviction(r, missed, v)
}

// prefillTerm is Preble's P (§3.2): this request's prefill on r, of the
// tokens r does not cache (credits each replica's cache). Above 1 its
// weight charges the recompute's delay to the requests that queue behind it
// (prefixlb); with IncludePrefill off (Preble's prototype) its weight is 0:
//
//	prefill = w · T_prefill(missed on r, prompt)
func prefillTerm(w, pf float64) float64 {
	if w <= 0 {
		return 0
	}
	return w * pf
}

// decodeContext is the context per sequence of the decode batch on rp: its
// decoding requests' mean, or the prompt's when none decodes.
func decodeContext(rp *Replica, req *Request) int {
	if rp.Decoding > 0 {
		return rp.DecodeContextTokens / rp.Decoding
	}
	return req.PromptTokens
}

// decodeShare is s_r, how much longer an iteration of a full prefill chunk
// of replica r's engine budget (vLLM's max_num_batched_tokens: 512 in
// Preble's runs, 8192 on an H100) takes with r's running decodes than alone,
// relative to alone: the bigger the chunk, the smaller the decodes' share.
// 0 while nothing decodes.
func (p *E2) decodeShare(v *View, r int) float64 {
	rp := &v.Replicas[r]
	if rp.Decoding <= 0 {
		return 0
	}
	ctx := rp.DecodeContextTokens / rp.Decoding
	prof := v.ProfileOf(r)
	budget := costmodel.BatchingOf(prof).MaxBatchedTokens
	if budget <= 0 {
		budget = costmodel.DefaultBatching.MaxBatchedTokens
	}
	// The chunk lives in p: a slice literal would escape through the
	// profile's interface, one allocation per candidate.
	p.chunk[0] = costmodel.Chunk{New: budget, Seq: budget}
	ch := p.chunk[:]
	chunk := secs(prof.Iteration(costmodel.Batch{Prefill: ch}))
	mixed := secs(prof.Iteration(costmodel.Batch{Prefill: ch, DecodeSeqs: rp.Decoding, DecodeContext: ctx * rp.Decoding}))
	if chunk <= 0 {
		return 0
	}
	return mixed/chunk - 1
}

// tpot returns replica r's median observed time per output token, seeded
// from its profile's single-sequence decode step (as the profile prices it
// now: a calibrated one moves as it learns).
func (p *E2) tpot(v *View, r int) float64 {
	rs := p.rep(r)
	if len(rs.tpot) == 0 {
		return p.stepMemo(v, r, 1, 1024)
	}
	if rs.tpotDirty > 0 {
		buf := slices.Clone(rs.tpot)
		slices.Sort(buf)
		rs.tpotMedian = buf[len(buf)/2]
		rs.tpotDirty = 0
	}
	return rs.tpotMedian
}

// decodeLoad is the in-flight decode on replica r, unweighted (decodeTerm;
// rebalancing adds it to the load it compares unless MovableLoadOnly).
func (p *E2) decodeLoad(v *View, r int) float64 {
	rp := &v.Replicas[r]
	if rp.DecodeTokens <= 0 {
		return 0
	}
	if p.cfg.MarginalDecode {
		n := max(rp.InFlight, 1)
		ctx := 1024
		if rp.Decoding > 0 {
			ctx = rp.DecodeContextTokens / rp.Decoding
		}
		m := secs(costmodel.MarginalDecode(v.ProfileOf(r), n-1, ctx))
		return float64(rp.DecodeTokens) * m
	}
	return float64(rp.DecodeTokens) * p.tpot(v, r)
}

// eviction is M(r) unweighted (evictionTerm): if replica r's cache cannot
// take the tokens this request misses on it, the windowed prefill work of
// the prefixes it would push out (pretend LRU eviction among nodes no
// in-flight request on r uses).
func (p *E2) eviction(r int, missedTokens int, v *View) float64 {
	bt, prof := v.BlockTokens(), v.ProfileOf(r)
	if v.Replicas[r].Slots > 0 {
		// A slot cache overwrites one slot's prompt whole, whatever the
		// replica's capacity: price the prefixes of that prompt that no
		// other slot and not this request keep. On a slot cache eviction is
		// routine (every request overwrites a slot), so a prefix another
		// replica still holds is not lost to the cluster and costs nothing.
		if v.Victims == nil {
			return 0
		}
		cost := 0.0
		v.Victims(r, func(n *prefixtree.Node) bool {
			if n.CachedCount() <= 1 {
				cost += p.evictionCost(n, prof, bt)
			}
			return true
		})
		return cost
	}
	// The replica's own capacity (the engine's, else the profile's); what
	// it holds is at least the blocks the tree says it caches and at least
	// the blocks its running requests hold by its own KV usage (output
	// blocks included, which the tree does not see).
	capBlocks := v.KVCapacityOf(r) / bt
	held := v.Tree.CachedBlocks(r)
	if u := v.Replicas[r].KVUsage; u > 0 && finite(u) {
		held = max(held, int(min(u, 1)*float64(capBlocks)))
	}
	need := held + (missedTokens+bt-1)/bt - capBlocks
	if need <= 0 {
		return 0
	}
	cost := 0.0
	freed := 0
	// The unreferenced nodes in LRU order, as EachLRU skipping Ref > 0
	// would give them, without walking the referenced ones: on a full,
	// loaded replica nearly all of its LRU end (docs/performance.md,
	// "E2 on full caches").
	v.Tree.EachUnreferencedLRU(r, func(n *prefixtree.Node) bool {
		freed += n.Own()
		cost += p.evictionCost(n, prof, bt)
		return freed < need
	})
	return cost
}

// evictionCost is what evicting node n costs in M, priced by the evicting
// replica's profile prof: for an important prefix used in the window, one
// recompute of it (EvictionRecompute) or the paper's missRate·count·T_prefill;
// nothing for other nodes.
func (p *E2) evictionCost(n *prefixtree.Node, prof costmodel.Profile, bt int) float64 {
	s, ok := n.Ext.(*e2Node)
	if !ok || !n.Important() || s.count <= 0 {
		return 0
	}
	t := secs(prof.Prefill(n.Own()*bt, (n.Depth()+n.Own())*bt))
	if p.cfg.EvictionRecompute {
		return t
	}
	miss := 1 - float64(s.hit)/float64(max(s.prompt, 1))
	return miss * float64(s.count) * t
}

// slotWait is how long a request would wait on replica rp for a free slot:
// nothing while it has one (InFlight < Slots, or a block cache). Else it
// waits for InFlight−Slots+1 of the requests there to finish, Slots of them
// at a time, each owing on average the replica's remaining work divided by
// its requests — the remaining prefill, and the remaining output at one
// batched decode step per token (an M/G/c-style estimate):
//
//	wait = (InFlight−Slots+1)/Slots · (pending prefill + decode tokens · T_step(Slots)) / InFlight
func (p *E2) slotWait(r int, req *Request, v *View) float64 {
	rp := &v.Replicas[r]
	if rp.Slots <= 0 || rp.InFlight < rp.Slots {
		return 0
	}
	owed := secs(rp.PendingPrefill) + float64(max(rp.DecodeTokens, 0))*p.stepMemo(v, r, rp.Slots, decodeContext(rp, req))
	ahead := float64(rp.InFlight - rp.Slots + 1)
	return ahead / float64(rp.Slots) * owed / float64(rp.InFlight)
}
