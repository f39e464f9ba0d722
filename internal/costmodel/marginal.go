package costmodel

import "time"

// MarginalDecode is the GPU time one more decoding sequence adds to an
// iteration that already decodes batch sequences, every sequence holding
// contextPerSeq tokens: Iteration with batch+1 decoding sequences less
// Iteration with batch. E2 charges in-flight decode at this marginal cost
// times the output length (ALGORITHMS.md §8, finding 2: charging outLen·TPOT
// instead overstates decode load by the batch size). Negative arguments count
// as 0; the result is never negative.
func MarginalDecode(p Profile, batch, contextPerSeq int) time.Duration {
	batch, contextPerSeq = max(batch, 0), max(contextPerSeq, 0)
	more := satAdd(batch, 1)
	with := p.Iteration(Batch{DecodeSeqs: more, DecodeContext: satMul(more, contextPerSeq)})
	without := p.Iteration(Batch{DecodeSeqs: batch, DecodeContext: satMul(batch, contextPerSeq)})
	return max(with-without, 0)
}
