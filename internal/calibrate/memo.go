package calibrate

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// memoSlots is the size of a priorMemo's two direct-mapped tables.
const memoSlots = 64

// priorMemo remembers a prior's most recent prefill and decode-step figures,
// for the Models of every replica that share that prior (Sibling): a policy
// that prices a request on each of N replicas asks each replica's model, and
// without it each would evaluate the same prior figure again. A profile is a
// pure function, so an entry never goes stale. Not safe for concurrent use
// (the router serialises its models).
type priorMemo struct {
	prior   costmodel.Profile
	prefill [memoSlots]memoEntry
	decode  [memoSlots]memoEntry
	mixed   [memoSlots]mixedEntry
}

type memoEntry struct {
	a, b int
	ok   bool
	v    time.Duration
}

// mixedEntry is an iteration of one prefill chunk with decodes: the prior's
// time of the whole, of the chunk alone and of the decodes alone.
type mixedEntry struct {
	n, s, seqs, ctx int
	ok              bool
	all, p, d       time.Duration
}

func newPriorMemo(p costmodel.Profile) *priorMemo { return &priorMemo{prior: p} }

// fitMemo remembers one Model's own fitted figures, each stamped with the
// version of the coefficients it was computed with: a policy asks a replica's
// model the same few figures decision after decision, and the coefficients
// change only when they are solved (every few observations). Not safe for
// concurrent use.
type fitMemo struct {
	prefill [memoSlots]fitEntry
	decode  [memoSlots]fitEntry
	mixed   [memoSlots]fitMixed
}

type fitEntry struct {
	a, b int
	ver  uint64 // 0: empty (versions start at 1)
	v    time.Duration
}

type fitMixed struct {
	n, s, seqs, ctx int
	ver             uint64
	v               time.Duration
}

func slot(a, b int) int {
	h := uint64(a)*0x9e3779b97f4a7c15 ^ uint64(b)*0xc2b2ae3d27d4eb4f
	return int(h>>58) % memoSlots
}

// prefillOf is prior.Prefill(n, s).
func (m *priorMemo) prefillOf(n, s int) time.Duration {
	e := &m.prefill[slot(n, s)]
	if e.ok && e.a == n && e.b == s {
		return e.v
	}
	v := m.prior.Prefill(n, s)
	*e = memoEntry{a: n, b: s, ok: true, v: v}
	return v
}

// mixedOf is the prior's time of an iteration computing a chunk of n new
// tokens ending a sequence of s beside seqs decoding sequences holding ctx
// tokens, with its prefill part alone and its decode part alone.
func (m *priorMemo) mixedOf(n, s, seqs, ctx int) (all, p, d time.Duration) {
	e := &m.mixed[slot(n^seqs<<20, s^ctx<<7)]
	if e.ok && e.n == n && e.s == s && e.seqs == seqs && e.ctx == ctx {
		return e.all, e.p, e.d
	}
	ch := [1]costmodel.Chunk{{New: n, Seq: s}}
	all = m.prior.Iteration(costmodel.Batch{Prefill: ch[:], DecodeSeqs: seqs, DecodeContext: ctx})
	p = m.prior.Iteration(costmodel.Batch{Prefill: ch[:]})
	d = m.decodeOf(seqs, ctx)
	*e = mixedEntry{n: n, s: s, seqs: seqs, ctx: ctx, ok: true, all: all, p: p, d: d}
	return all, p, d
}

// decodeOf is the prior's decode-only iteration of seqs sequences holding
// ctx tokens of context in all.
func (m *priorMemo) decodeOf(seqs, ctx int) time.Duration {
	e := &m.decode[slot(seqs, ctx)]
	if e.ok && e.a == seqs && e.b == ctx {
		return e.v
	}
	v := m.prior.Iteration(costmodel.Batch{DecodeSeqs: seqs, DecodeContext: ctx})
	*e = memoEntry{a: seqs, b: ctx, ok: true, v: v}
	return v
}
