package policy

import (
	"fmt"
	"math"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// Prefill/decode disaggregation (issue 16). A disaggregated request's prompt
// is prefilled on a prefill replica, its KV moves to a decode replica over
// the network, and the decode replica generates its tokens (vLLM's
// NixlConnector: docs/features/disagg_prefill.md; llm-d and Dynamo route it
// so). A policy that implements Disaggregator picks both in one Decision
// (Decision.Disaggregated, PrefillReplica); the router hides the prefill
// replicas from every other policy.

// Role is a replica's role in a disaggregated cluster. The zero value,
// RoleBoth, is an aggregated replica that prefills and decodes its own
// requests.
type Role uint8

// The roles, as llm-d labels its pods (llm-d.ai/role: prefill, decode, both).
const (
	RoleBoth Role = iota
	RolePrefill
	RoleDecode
)

var roleNames = [...]string{RoleBoth: "both", RolePrefill: "prefill", RoleDecode: "decode"}

// String returns the role's name: "both", "prefill" or "decode".
func (r Role) String() string {
	if int(r) < len(roleNames) {
		return roleNames[r]
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// ParseRole reads a role's name; "" is RoleBoth.
func ParseRole(s string) (Role, error) {
	if s == "" {
		return RoleBoth, nil
	}
	for r, n := range roleNames {
		if n == s {
			return Role(r), nil
		}
	}
	return RoleBoth, fmt.Errorf("policy: unknown role %q (both, prefill, decode)", s)
}

// Decodes reports whether a replica of role r decodes requests: every role
// but RolePrefill, whose replicas only run the prefill leg.
func (r Role) Decodes() bool { return r != RolePrefill }

// Disaggregator is implemented by policies that choose the prefill and the
// decode replica of a request together (Decision.Disaggregated). The router
// shows them every replica; other policies never see the prefill replicas.
type Disaggregator interface {
	// Disaggregates reports whether the policy picks prefill replicas.
	Disaggregates() bool
}

// KVLink is the network a disaggregated request's KV crosses: each replica
// has a link of BytesPerSecond, shared equally by the transfers from or to
// it (Replica.Transfers), and every transfer pays Latency once.
type KVLink struct {
	// BytesPerSecond is one replica's link bandwidth (0: unknown; transfers
	// are then priced at Latency alone).
	BytesPerSecond float64
	// Latency is the fixed time of one transfer: the decode side's request
	// for the blocks and the first byte's way back.
	Latency time.Duration
}

// PullTokens is the KV, in tokens, that decode replica d must receive for
// req: the prompt's blocks it does not cache, whole blocks (NixlConnector
// reads the blocks the decode side lacks; it always lacks the block of the
// last prompt token, which an engine recomputes for its logits).
func (v *View) PullTokens(d int, req *Request) int {
	bt := v.BlockTokens()
	total := (req.PromptTokens + bt - 1) / bt
	hit := min(at(v.Match.PerReplica, d), (req.PromptTokens-1)/bt, len(req.Keys))
	return max(total-hit, 0) * bt
}

// TransferSeconds is how long req's KV takes to reach decode replica d from
// prefill replica p: Latency, plus the bytes d lacks (PullTokens × the
// profile's KV bytes per token, costmodel.KVBytesOf) at the link's rate
// shared with the transfers already on either end:
//
//	transfer = Latency + PullTokens·KVBytesPerToken·(1 + max(Transfers_p, Transfers_d)) / BytesPerSecond
func (v *View) TransferSeconds(p, d int, req *Request) float64 {
	t := v.KVLink.Latency.Seconds()
	bpt := costmodel.KVBytesOf(v.ProfileOf(d))
	if bpt <= 0 || v.KVLink.BytesPerSecond <= 0 {
		return t
	}
	share := 1 + max(v.Replicas[p].Transfers, v.Replicas[d].Transfers)
	return t + float64(v.PullTokens(d, req))*bpt*float64(share)/v.KVLink.BytesPerSecond
}

// pool returns v with only the up replicas of one side shown up: the
// prefill replicas (prefill true) or those that decode. buf holds the
// masked replicas between calls.
func (v *View) pool(buf *[]Replica, prefill bool) View {
	w := *v
	*buf = append((*buf)[:0], v.Replicas...)
	for i := range *buf {
		rp := &(*buf)[i]
		rp.Up = rp.Up && (rp.Role == RolePrefill) == prefill
	}
	w.Replicas = *buf
	return w
}

// pd fills the prefill leg of d from the prefill pool's decision p.
func (d *Decision) pd(p Decision) {
	d.Disaggregated, d.PrefillReplica, d.PrefillMatchedTokens = true, p.Replica, p.MatchedTokens
	for _, c := range p.Candidates {
		c.Leg = "prefill"
		d.Candidates = append(d.Candidates, c)
	}
}

// legs marks d's candidates as the decode leg's.
func (d *Decision) legs(leg string) {
	for i := range d.Candidates {
		d.Candidates[i].Leg = leg
	}
}

// RoundRobinPD takes the prefill replicas in turn and the decode replicas in
// turn, and disaggregates every request while a prefill replica is up (the
// round-robin proxies of vLLM's disaggregated examples,
// tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in
// vllm-project/vllm, cycle through each pool so). Without prefill replicas
// it is round-robin over the others.
type RoundRobinPD struct {
	nextP, nextD int
}

var (
	_ Policy        = (*RoundRobinPD)(nil)
	_ Disaggregator = (*RoundRobinPD)(nil)
)

// Name implements Policy.
func (p *RoundRobinPD) Name() string { return "round-robin-pd" }

// Disaggregates implements Disaggregator.
func (p *RoundRobinPD) Disaggregates() bool { return true }

// Route implements Policy.
func (p *RoundRobinPD) Route(req *Request, v *View, now time.Time) (Decision, error) {
	next := func(at *int, prefill bool) int {
		n := len(v.Replicas)
		for i := 0; i < n; i++ {
			r := (*at + i) % n
			if rp := &v.Replicas[r]; rp.Up && (rp.Role == RolePrefill) == prefill {
				*at = r + 1
				return r
			}
		}
		return -1
	}
	dr := next(&p.nextD, false)
	if dr < 0 {
		return Decision{}, ErrNoReplica
	}
	d := Decision{Replica: dr, Branch: "local", MatchedTokens: v.MatchedTokens(dr, req)}
	if pr := next(&p.nextP, true); pr >= 0 {
		d.Branch = "pd"
		d.Disaggregated, d.PrefillReplica, d.PrefillMatchedTokens = true, pr, v.MatchedTokens(pr, req)
	}
	return d, nil
}

// DefaultLLMDPDThreshold is the nonCachedTokens of llm-d's documented P/D
// configurations (16; llm-d-inference-scheduler docs/architecture.md and the
// e2e test configs): disaggregate when at least that many prompt tokens are
// not cached on the chosen decode pod.
const DefaultLLMDPDThreshold = 16

// LLMDPD is llm-d's P/D scheduling: the pd-profile-handler runs the decode
// profile first and picks a decode pod, then the prefix-based-pd-decider
// disaggregates only if the prompt has at least Threshold tokens that pod
// does not cache, and then the prefill profile picks a prefill pod
// (llm-d/llm-d-inference-scheduler pkg/plugins/profile/pd_profile_handler.go
// and prefix_based_pd_decider.go @ 06c08c08d5726662ae5a4bc40b45a458e45c22c2;
// the lifecycle in docs/disaggregation.md @
// 164925228217a1826acff02ab55e3ee2731cebc6). Each profile is a filter
// (prefill-filter, decode-filter: the pods of its role) and the weighted
// scorers of the documented configuration, prefix-cache-scorer 2 and
// queue-scorer 1, under the max-score picker (scoreLLMD):
//
//	score(r) = 2·prefix(r) + 1·queue(r)    over the pool's pods
//	disaggregate ⇔ prompt ≥ T and prompt − cached on D ≥ T   (T = 16)
//
// Departure: the prefix score is the engines' KV events normalised as
// llm-d's precise scorer does (LLMDPrecise), not GIE's approximate index of
// what was sent where; a decode pod caches what it was sent after the
// transfer, so the two agree here but for eviction.
type LLMDPD struct {
	// Threshold is the decider's nonCachedTokens (0: always disaggregate).
	Threshold int
	// PrefixWeight and QueueWeight weigh the two scorers in both profiles.
	PrefixWeight, QueueWeight float64
	prefix                    []float64
	buf                       []Replica
}

var (
	_ Policy        = (*LLMDPD)(nil)
	_ Disaggregator = (*LLMDPD)(nil)
)

// NewLLMDPD returns llm-d's P/D scheduling with decider threshold t and the
// documented weights (prefix 2, queue 1).
func NewLLMDPD(t int) *LLMDPD { return &LLMDPD{Threshold: t, PrefixWeight: 2, QueueWeight: 1} }

// Name implements Policy.
func (p *LLMDPD) Name() string { return "llmd-pd" }

// Disaggregates implements Disaggregator.
func (p *LLMDPD) Disaggregates() bool { return true }

func (p *LLMDPD) profile(req *Request, v *View, prefill bool, branch string) (Decision, error) {
	w := v.pool(&p.buf, prefill)
	p.prefix = precisePrefixScores(p.prefix, nil, &w) // its pools renumber replicas: GPU blocks only
	return scoreLLMD(req, &w, p.prefix, w.Match.PerReplica, p.PrefixWeight, 0, p.QueueWeight, branch)
}

// Route implements Policy.
func (p *LLMDPD) Route(req *Request, v *View, now time.Time) (Decision, error) {
	d, err := p.profile(req, v, false, "local")
	if err != nil || d.Replica < 0 {
		return Decision{}, ErrNoReplica
	}
	d.legs("decode")
	if t := p.Threshold; t > 0 && (req.PromptTokens < t || req.PromptTokens-d.MatchedTokens < t) {
		return d, nil // the decider: decode only
	}
	pd, err := p.profile(req, v, true, "pd")
	if err != nil || pd.Replica < 0 {
		return d, nil // no prefill pod up: the decode pod prefills
	}
	d.Branch = "pd"
	d.pd(pd)
	return d, nil
}

// DynamoPD is NVIDIA Dynamo's disaggregated routing: the frontend's
// PrefillRouter picks a prefill worker with the KV router (cache overlap and
// load, Dynamo's cost with overlap weight 1) and then a decode worker, and
// every request is disaggregated while prefill workers are registered
// (ai-dynamo/dynamo docs/design_docs/disagg_serving.md @
// 66e265b812bf87745f85355790c1a86754dff691). The decode worker is chosen
// by load: Dynamo's example runs the decode router with
// --kv-overlap-score-weight 0 "for pure load balancing", and its decode
// workers publish no KV events (examples/backends/vllm/launch/disagg_router.sh
// @ 00640f4bbb37cd6a4355b2ef610256d3b93c3418), so the decode cost is the
// active blocks alone:
//
//	prefill worker = argmin 1·prefill(r) + decode(r)   over prefill workers (Dynamo)
//	decode worker  = argmin decode(r)                  over decode workers
type DynamoPD struct {
	prefill, decode *Dynamo
	buf             []Replica
}

var (
	_ Policy        = (*DynamoPD)(nil)
	_ Disaggregator = (*DynamoPD)(nil)
)

// NewDynamoPD returns Dynamo's disaggregated routing, cfg configuring the
// prefill router (the decode router takes its temperature, overlap 0).
func NewDynamoPD(cfg DynamoConfig) *DynamoPD {
	return &DynamoPD{prefill: NewDynamo(cfg), decode: NewDynamo(DynamoConfig{Temperature: cfg.Temperature})}
}

// Name implements Policy.
func (p *DynamoPD) Name() string { return "dynamo-pd" }

// Disaggregates implements Disaggregator.
func (p *DynamoPD) Disaggregates() bool { return true }

// Route implements Policy.
func (p *DynamoPD) Route(req *Request, v *View, now time.Time) (Decision, error) {
	w := v.pool(&p.buf, false)
	d, err := p.decode.Route(req, &w, now)
	if err != nil {
		return Decision{}, err
	}
	d.Branch = "local"
	d.legs("decode")
	w = v.pool(&p.buf, true)
	pd, err := p.prefill.Route(req, &w, now)
	if err != nil {
		return d, nil // no prefill worker: the decode worker prefills
	}
	d.Branch = "pd"
	d.pd(pd)
	return d, nil
}

// DefaultE2PDConfig returns `e2-pd`'s configuration: `e2`'s
// (DefaultE2Config), named e2-pd.
func DefaultE2PDConfig() E2Config {
	c := DefaultE2Config()
	c.Name = "e2-pd"
	return c
}

// E2PD is E2 for a disaggregated cluster: it prices the request's two
// placements in E2's currency, GPU seconds of latency, and takes the
// cheaper (prefixlb's extension of Preble's E2; issue 16):
//
//   - local on a decode replica D: E2's whole cost there (E2.cost): its
//     queue, the prefill of what D does not cache (weight 3), the delay that
//     prefill imposes on D's running decodes (interference), the request's
//     own decode and the eviction it causes;
//
//   - disaggregated, P then D: the prefill leg on the prefill replica P
//     that costs least — E2.cost for a one-token request: P's queue, its
//     own prefill net of P's cache, P's eviction — plus the decode leg on
//     the decode replica D that costs least:
//
//     decode_leg(D) = pending_D + self_decode_D + prefill_slowdown_D(pending_D) + eviction_D(PullTokens_D) + crowding_D + TransferSeconds(P, D)
//
// with E2's weights (DefaultE2Config) on each term: the batch the request
// joins (self_decode), the memory its KV takes (eviction of what D must
// receive), the transfer of what D lacks at the link's shared rate
// (View.TransferSeconds), and D's queued prefill that its first iteration
// waits behind. So the choice of disaggregating is conditional and priced,
// not a token threshold: a prompt D already holds costs almost nothing to
// prefill locally and never crosses the network, while a long uncached
// prompt on a D with many decodes pays E2's interference term locally and
// goes to P. Without prefill replicas up E2PD is E2 over the others.
//
// While a prefill replica is up, both the local cost and the decode leg add
// crowding_D (E2PD.crowding), what this request's decode does to the
// streams already on D: the two placements differ in where the prompt's
// prefill stalls D's streams (E2's interference term, local only), and both
// slow D's steps by this request's context.
//
// The prefill leg's windowed history is recorded on P (where the prefill
// ran), a local request's on D, so that D's prefill rate ρ (self_decode's
// stretch) counts the prefills it runs itself.
type E2PD struct {
	e   *E2
	buf []Replica
	// per-decision scratch
	legP, legD []Candidate
	tp, td     []E2Terms
}

var (
	_ Policy        = (*E2PD)(nil)
	_ Observer      = (*E2PD)(nil)
	_ Speculator    = (*E2PD)(nil)
	_ Disaggregator = (*E2PD)(nil)
)

// NewE2PD returns E2PD over E2 with cfg, which it validates.
func NewE2PD(cfg E2Config) (*E2PD, error) {
	e, err := NewE2(cfg)
	if err != nil {
		return nil, err
	}
	return &E2PD{e: e}, nil
}

// Name implements Policy.
func (p *E2PD) Name() string { return p.e.Name() }

// Disaggregates implements Disaggregator.
func (p *E2PD) Disaggregates() bool { return true }

// Speculative implements Speculator, as E2's.
func (p *E2PD) Speculative() bool { return p.e.Speculative() }

// Route implements Policy.
func (p *E2PD) Route(req *Request, v *View, now time.Time) (Decision, error) {
	e := p.e
	e.pfMemo, e.stepMemos = e.pfMemo[:0], e.stepMemos[:0]
	e.expire(now.UnixNano())
	e.cands, e.terms = e.cands[:0], e.terms[:0]

	d := Decision{Replica: -1, Branch: "local"}
	if !v.anyPrefill() {
		// No prefill replica up: E2 over the others.
		dv := v.pool(&p.buf, false)
		e.pick(req, &dv, nil, &d)
		if d.Replica < 0 {
			return Decision{}, ErrNoReplica
		}
		d.Candidates = append(d.Candidates, e.cands...)
		d.Candidates = p.explain(req, d.Candidates)
		return d, nil
	}

	// Local: E2's cost on each decode replica, plus what its decode does to
	// the streams already there (crowding).
	bestL := -1
	for r := range v.Replicas {
		if rp := &v.Replicas[r]; !rp.Up || !rp.Role.Decodes() {
			continue
		}
		c := e.price(r, req, v)
		x := p.crowding(r, req, v)
		c.Load += x
		c.Score += x
		if !finite(c.Score) {
			c.Score = math.MaxFloat64
		}
		if bestL < 0 || better(c, &e.cands[bestL], v) {
			bestL = len(e.cands) - 1
		}
	}
	if bestL < 0 {
		return Decision{}, ErrNoReplica
	}
	local := e.cands[bestL].Score
	d.Replica, d.MatchedTokens = e.cands[bestL].Replica, e.cands[bestL].MatchedTokens
	d.Candidates = append(d.Candidates, e.cands...)

	// Disaggregated: the cheapest prefill leg, then the cheapest decode leg.
	one := *req
	one.OutputTokens = 1
	p.legP, p.tp = p.legP[:0], p.tp[:0]
	bestP := -1
	for r := range v.Replicas {
		if rp := &v.Replicas[r]; !rp.Up || rp.Role != RolePrefill {
			continue
		}
		p.legP = append(p.legP, Candidate{Leg: "prefill"})
		p.tp = append(p.tp, E2Terms{})
		i := len(p.legP) - 1
		e.cost(&p.legP[i], &p.tp[i], r, &one, v)
		if !finite(p.legP[i].Score) {
			p.legP[i].Score = math.MaxFloat64
		}
		if bestP < 0 || better(&p.legP[i], &p.legP[bestP], v) {
			bestP = i
		}
	}
	if bestP < 0 {
		d.Candidates = p.explain(req, d.Candidates)
		return d, nil
	}
	pr := p.legP[bestP].Replica
	p.legD, p.td = p.legD[:0], p.td[:0]
	bestD := -1
	for r := range v.Replicas {
		if rp := &v.Replicas[r]; !rp.Up || !rp.Role.Decodes() {
			continue
		}
		p.legD = append(p.legD, Candidate{})
		p.td = append(p.td, E2Terms{})
		i := len(p.legD) - 1
		p.decodeLeg(&p.legD[i], &p.td[i], pr, r, req, v)
		if bestD < 0 || better(&p.legD[i], &p.legD[bestD], v) {
			bestD = i
		}
	}
	d.Candidates = append(d.Candidates, p.legP...)
	d.Candidates = append(d.Candidates, p.legD...)
	if bestD >= 0 && p.legP[bestP].Score+p.legD[bestD].Score < local {
		c := &p.legD[bestD]
		d.Replica, d.MatchedTokens, d.Branch = c.Replica, c.MatchedTokens, "pd"
		d.Disaggregated, d.PrefillReplica, d.PrefillMatchedTokens = true, pr, p.legP[bestP].MatchedTokens
	}
	d.Candidates = p.explain(req, d.Candidates)
	return d, nil
}

// better reports whether candidate a beats b: a lower score beyond E2's tie
// tolerance, else more cached tokens, then fewer requests in flight, then
// the lower ID (E2.pick's rules).
func better(a, b *Candidate, v *View) bool {
	tol := tieTolerance * math.Max(b.Score, 0)
	switch {
	case a.Score < b.Score-tol:
		return true
	case a.Score > b.Score+tol:
		return false
	case a.MatchedTokens != b.MatchedTokens:
		return a.MatchedTokens > b.MatchedTokens
	}
	fa, fb := v.Replicas[a.Replica].InFlight, v.Replicas[b.Replica].InFlight
	return fa < fb || (fa == fb && a.Replica < b.Replica)
}

// decodeLeg prices replica r as the decode leg of req prefilled on pr (the
// formula in E2PD's doc comment) into c, its E2 terms into t.
func (p *E2PD) decodeLeg(c *Candidate, t *E2Terms, pr, r int, req *Request, v *View) {
	e := p.e
	w := &e.weights
	rp := &v.Replicas[r]
	pull := v.PullTokens(r, req)
	t[E2Pending] = pendingTerm(w[E2Pending], rp)
	t[E2SelfDecode] = e.selfDecodeTerm(w[E2SelfDecode], r, req, v)
	t[E2PrefillSlowdown] = e.prefillSlowdownTerm(w[E2PrefillSlowdown], v, r, t[E2Pending])
	t[E2SlotWait] = e.slotWaitTerm(w[E2SlotWait], r, req, v)
	t[E2Eviction] = e.evictionTerm(w[E2Eviction], r, pull, v)
	c.Replica, c.MatchedTokens, c.Leg = r, v.MatchedTokens(r, req), "decode"
	c.Load, c.Score = t.sum()
	x := p.crowding(r, req, v)
	c.Load += x
	c.Score += x
	c.Eviction = t[E2Eviction]
	c.Transfer = v.TransferSeconds(pr, r, req)
	c.Score += c.Transfer
	if !finite(c.Score) {
		c.Score = math.MaxFloat64
	}
}

// crowding is what req's decode on replica r costs the requests already in
// flight there, in E2's currency (seconds of their latency): one more
// sequence of req's context makes each of r's decode iterations ΔT longer
// (the profile's step with it against without it: a decode step reads every
// sequence's KV, so a long context slows the whole batch), and every token
// they still owe during req's decode waits that much longer:
//
//	crowding = ΔT_r · min(DecodeTokens_r, InFlight_r·(out−1))
//	ΔT_r = T_step(n+1, C_r + prompt) − T_step(n, C_r)   n = decoding_r, C_r their context
//
// It is the decode side of E2's interference term (a local prefill delays
// r's streams by its prefill time; this request's decode delays them by ΔT
// a token), and the benefit a disaggregated decision buys by decoding on a
// less crowded replica than the one holding the prompt. E2 leaves it out
// (prefixlb's extension for P/D; docs/pd.md).
func (p *E2PD) crowding(r int, req *Request, v *View) float64 {
	rp := &v.Replicas[r]
	if rp.InFlight <= 0 || rp.DecodeTokens <= 0 || req.OutputTokens <= 1 {
		return 0
	}
	// The batch now; while nothing decodes yet, the requests in flight as
	// they will decode, each with a context like req's.
	n, ctx := rp.Decoding, rp.DecodeContextTokens
	if n <= 0 {
		n, ctx = rp.InFlight, rp.InFlight*req.PromptTokens
	}
	before := p.step(v, r, n, ctx)
	after := p.step(v, r, n+1, ctx+req.PromptTokens)
	owed := min(rp.DecodeTokens, rp.InFlight*(req.OutputTokens-1))
	return max(after-before, 0) * float64(owed)
}

// step is the seconds of a decode-only iteration on r of seqs sequences
// holding ctx tokens of context in all.
func (p *E2PD) step(v *View, r, seqs, ctx int) float64 {
	return secs(v.ProfileOf(r).Iteration(costmodel.Batch{DecodeSeqs: seqs, DecodeContext: ctx}))
}

// anyPrefill reports whether a prefill replica is up.
func (v *View) anyPrefill() bool {
	for i := range v.Replicas {
		if rp := &v.Replicas[i]; rp.Up && rp.Role == RolePrefill {
			return true
		}
	}
	return false
}

// explain attaches E2's terms to the candidates when the request asks
// (Request.Explain), in the order they were priced: the local ones (E2's
// terms slice), the prefill legs, the decode legs.
func (p *E2PD) explain(req *Request, cands []Candidate) []Candidate {
	if !req.Explain {
		return cands
	}
	terms := make([]E2Terms, 0, len(cands))
	terms = append(terms, p.e.terms...)
	terms = append(terms, p.tp...)
	terms = append(terms, p.td...)
	for i := range cands {
		if i < len(terms) {
			cands[i].Terms = &terms[i]
		}
	}
	return cands
}

// Routed implements Observer: E2's window records the request on the
// replica that prefills it (the prefill replica when disaggregated).
func (p *E2PD) Routed(req *Request, d *Decision, v *View, now time.Time) {
	if d.Disaggregated {
		dd := *d
		dd.Replica, dd.MatchedTokens = d.PrefillReplica, d.PrefillMatchedTokens
		p.e.Routed(req, &dd, v, now)
		return
	}
	p.e.Routed(req, d, v, now)
}

// FirstToken implements Observer.
func (p *E2PD) FirstToken(id uint64, replica int, ttft time.Duration, now time.Time) {
	p.e.FirstToken(id, replica, ttft, now)
}

// Finished implements Observer.
func (p *E2PD) Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time) {
	p.e.Finished(id, replica, outputTokens, ok, now)
}

// ReplicaDown implements Observer.
func (p *E2PD) ReplicaDown(r int, now time.Time) { p.e.ReplicaDown(r, now) }
