package costmodel

import (
	"math"
	"time"
)

// The Mistral-7B-on-A6000 fit is Preble's (Srivatsa et al., arXiv 2407.00023,
// §3.2 and Appendix), as coded in the prototype WukLab/preble,
// multi_node/benchmarks/exp_configs/model_equations_numpy.py
// (mistral_7b_A6000_sglang_linear, mistral_7b_A6000_sglang_attention,
// mistral_7b_A6000_sglang_extend_flashinfer). All constants are milliseconds.
const (
	// Linear layers, N ≥ 384 batched tokens: 0.10842571·N + 4.2097770548
	// (ALGORITHMS.md §5 rounds these to 0.10843 and 4.21).
	mistralLinSlope     = 0.10842571
	mistralLinIntercept = 4.209777054806409
	mistralLinLarge     = 384 // batched tokens from which the linear fit holds
	// 192 ≤ N < 384: −118 + 1.25·N − 2.56e−3·N², floored at 22.
	mistralQuadC0     = -118
	mistralQuadC1     = 1.25
	mistralQuadC2     = -2.56e-3
	mistralLinSmall   = 192 // batched tokens below which the linear time is flat
	mistralLinFloorMS = 22  // N < 192 (and the floor of the quadratic piece)
	// Attention over the batch's total context: 0.32 up to 1024 tokens, else
	// 1.86e−4·context + 0.159.
	mistralAttnShortMS   = 0.32
	mistralAttnShortMax  = 1024
	mistralAttnSlope     = 1.86e-4
	mistralAttnIntercept = 0.159
	// Long prefill (new·seq > 1024²), per request:
	// 1.13e−3·new + 1.75e−3·seq + 2.19e−6·new·seq.
	mistralLongMin    = 1024 * 1024
	mistralLongNew    = 1.13e-3
	mistralLongSeq    = 1.75e-3
	mistralLongNewSeq = 2.19e-6
	// The whole sum is divided by 0.9 (the prototype's efficiency factor).
	mistralEfficiency = 0.9
)

// mistralQuadVertex is where the quadratic piece peaks (N ≈ 244). The
// prototype's quadratic falls from there to −15.5 ms at N = 383; we hold it at
// its peak (34.6 ms) beyond the vertex so that Iteration is monotone in the
// batch size, as the Profile contract requires. Below the vertex the fit is
// unchanged.
const mistralQuadVertex = -mistralQuadC1 / (2 * mistralQuadC2)

// prebleMistral is the Preble prototype's Mistral-7B / A6000 / SGLang profile.
type prebleMistral struct {
	name     string
	kv       int
	batching Batching
	adapter  AdapterLoad
}

var (
	_ Profile = (*prebleMistral)(nil)
	_ Batcher = (*prebleMistral)(nil)
)

func (p *prebleMistral) Name() string    { return p.name }
func (p *prebleMistral) KVCapacity() int { return p.kv }

// Batching is the config's batching, by default DefaultBatching.
func (p *prebleMistral) Batching() Batching { return p.batching }

func (p *prebleMistral) Prefill(newTokens, seqTokens int) time.Duration {
	c := [1]Chunk{{New: newTokens, Seq: seqTokens}}
	return p.Iteration(Batch{Prefill: c[:]})
}

// Iteration prices a batch the way the prototype's
// mistral_7b_A6000_sglang_extend_flashinfer does: the linear layers once over
// all batched tokens (every prefill chunk's new tokens plus one per decoding
// sequence), attention once over the total context of every sequence in the
// batch (memory bound, so linear in the KV read), plus a compute-bound term
// for each prefill chunk with new·seq > 1024²; the sum divided by 0.9.
//
// Deviations, both forced by the Profile contract (monotone in every input):
// the quadratic piece is held at its peak (see mistralQuadVertex), and the
// prototype's halving of attention when sequences share a prefix
// ("num_unique_kv") is left out: Batch carries no unique-KV count, and the
// halving made the time fall when the context grew.
func (p *prebleMistral) Iteration(b Batch) time.Duration {
	var tokens, context, long float64
	for _, c := range b.Prefill {
		if c.New <= 0 {
			continue // nothing computed
		}
		n := float64(c.New)
		s := math.Max(nonNeg(c.Seq), n)
		tokens += n
		context += s
		if n*s > mistralLongMin {
			long += mistralLongNew*n + mistralLongSeq*s + mistralLongNewSeq*n*s
		}
	}
	if b.DecodeSeqs > 0 {
		tokens += float64(b.DecodeSeqs)
		context += nonNeg(b.DecodeContext)
	}
	if tokens == 0 {
		return 0
	}
	ms := (mistralLinearMS(tokens) + mistralAttentionMS(context) + long) / mistralEfficiency
	return fromMS(ms)
}

// mistralLinearMS is the linear-layer time of a forward pass over n batched
// tokens (monotone envelope of the prototype's piecewise fit).
func mistralLinearMS(n float64) float64 {
	switch {
	case n >= mistralLinLarge:
		return mistralLinSlope*n + mistralLinIntercept
	case n >= mistralLinSmall:
		q := math.Min(n, mistralQuadVertex)
		return math.Max(mistralLinFloorMS, mistralQuadC0+mistralQuadC1*q+mistralQuadC2*q*q)
	default:
		return mistralLinFloorMS
	}
}

// mistralAttentionMS is the attention time over a batch holding context
// tokens of KV in all.
func mistralAttentionMS(context float64) float64 {
	if context <= mistralAttnShortMax {
		return mistralAttnShortMS
	}
	return mistralAttnSlope*context + mistralAttnIntercept
}

// PrefillFit is a per-request prefill regression in milliseconds:
// C0 + New·new + Seq·seq + NewSeq·new·seq. It is the form of the prototype's
// Llama-3-70B fits (WukLab/preble model_equations_numpy.py,
// llama3_70b_A100_tp2_sglang_extend_flashinfer) and of the published
// Llama-3-70B / 2×H100 fit in ALGORITHMS.md §5.
type PrefillFit struct {
	C0     float64 `json:"c0"`      // ms per iteration
	New    float64 `json:"new"`     // ms per new token
	Seq    float64 `json:"seq"`     // ms per token of the sequence (cached + new)
	NewSeq float64 `json:"new_seq"` // ms per new token per sequence token
}

// DecodeFit is a decode-step regression in milliseconds:
// C0 + PerSeq·sequences + PerContextToken·total context.
type DecodeFit struct {
	C0              float64 `json:"c0"`                // ms per iteration
	PerSeq          float64 `json:"per_seq"`           // ms per decoding sequence
	PerContextToken float64 `json:"per_context_token"` // ms per token of KV read
}

// linear is a profile made of a PrefillFit and a DecodeFit.
type linear struct {
	name     string
	prefill  PrefillFit
	decode   DecodeFit
	kv       int
	batching Batching
	adapter  AdapterLoad
}

var (
	_ Profile = (*linear)(nil)
	_ Batcher = (*linear)(nil)
)

func (l *linear) Name() string    { return l.name }
func (l *linear) KVCapacity() int { return l.kv }

// Batching is the config's batching, by default DefaultBatching.
func (l *linear) Batching() Batching { return l.batching }

func (l *linear) Prefill(newTokens, seqTokens int) time.Duration {
	c := [1]Chunk{{New: newTokens, Seq: seqTokens}}
	return l.Iteration(Batch{Prefill: c[:]})
}

// Iteration sums the per-token terms of every prefill chunk and of the
// decoding sequences, and pays the fixed cost once per iteration: the larger
// of the two constants of the kinds of work present. The prototype charges
// the constant once per request in a batch; a batched forward pass pays its
// fixed costs (reading the weights, launching kernels) once, so a request run
// alone costs exactly the published per-request fit and a batch of them less.
func (l *linear) Iteration(b Batch) time.Duration {
	var ms, c0 float64
	work := false
	for _, c := range b.Prefill {
		if c.New <= 0 {
			continue
		}
		n := float64(c.New)
		s := math.Max(nonNeg(c.Seq), n)
		ms += l.prefill.New*n + l.prefill.Seq*s + l.prefill.NewSeq*n*s
		c0 = l.prefill.C0
		work = true
	}
	if b.DecodeSeqs > 0 {
		ms += l.decode.PerSeq*float64(b.DecodeSeqs) + l.decode.PerContextToken*nonNeg(b.DecodeContext)
		c0 = math.Max(c0, l.decode.C0)
		work = true
	}
	if !work {
		return 0
	}
	return fromMS(ms + c0)
}
