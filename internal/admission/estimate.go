package admission

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// Estimator predicts, for the saturation test and the deadline shed, how
// long a request routed now to a replica waits for its first token before
// its own prefill starts (Wait), and how long its own prefill then takes
// (Service). Both are read under the router's lock; Wait is on the
// pass-through path and must not allocate.
type Estimator interface {
	// Wait is the predicted wait on replica i (r is its view).
	Wait(i int, r *policy.Replica) time.Duration
	// Service is ticket t's own time to first token once it starts, at
	// the replica the pool judged best (0: unknown). It is asked only of a
	// request that is not let straight through and has a deadline.
	Service(t *Ticket, best int) time.Duration
}

// DecodeAware is the Estimator that prices decode interference as E2
// does (internal/policy/e2cost.go, prefillSlowdownTerm and decodeShare):
// chunked prefill carries one token of every running decode in each
// iteration, so each queued prefill chunk takes longer by s_r, the share
// the replica's decodes add to an iteration of a full chunk of its budget
// (vLLM's max_num_batched_tokens):
//
//	s_r  = T_iter(chunk + decoding_r seqs at ctx_r) / T_iter(chunk) − 1
//	wait = Q_r · (1 + s_r) + admit_r
//
// and, while the engine holds requests waiting (vLLM's
// num_requests_waiting > 0: its running batch is at max_num_seqs or its
// KV cache is full), a new request is admitted only after Waiting_r + 1
// running requests have finished, Running_r of them decoding at once,
// each owing the mean of the decode this router's requests owe there at
// the batch's step, as E2's slotWait prices a slot cache's wait
// (internal/policy/e2cost.go):
//
//	admit_r = (Waiting_r + 1)/Running_r · DecodeTokens_r · T_step(Running_r, ctx_r) / InFlight_r
//
// Q_r is the replica's queued prefill (E2's pending term), and a
// request's Service its own uncached prefill at the best replica,
// stretched alike. Profile gives replica i's cost profile (the router's
// PricedProfile); a nil profile prices the wait as Q_r. Not safe for
// concurrent use (it keeps a scratch chunk, as E2 does, so that the
// profile's interface does not make it escape).
type DecodeAware struct {
	// Profile returns replica i's cost profile (nil: unknown).
	Profile func(i int) costmodel.Profile
	// Prefill returns ticket t's own prefill time on replica i, its
	// cache hit there credited (0: unknown).
	Prefill func(t *Ticket, i int) time.Duration
	// Reps is the view Service reads the best replica's decodes from (the
	// router's Load, set by the owner).
	Reps func() []policy.Replica

	chunk [1]costmodel.Chunk
}

// Wait implements Estimator: Q_r · (1 + s_r) + admit_r.
func (e *DecodeAware) Wait(i int, r *policy.Replica) time.Duration {
	var w time.Duration
	if r.PendingPrefill > 0 {
		w = stretch(r.PendingPrefill, e.share(i, r))
	}
	return w + e.admit(i, r)
}

// admit is admit_r: 0 while the engine has no waiting queue, or its
// figures or profile are unknown.
func (e *DecodeAware) admit(i int, r *policy.Replica) time.Duration {
	if r.Waiting <= 0 || r.Running <= 0 || r.InFlight <= 0 || r.DecodeTokens <= 0 || e.Profile == nil {
		return 0
	}
	prof := e.Profile(i)
	if prof == nil {
		return 0
	}
	ctx := 1024
	if r.Decoding > 0 {
		ctx = r.DecodeContextTokens / r.Decoding
	}
	step := prof.Iteration(costmodel.Batch{DecodeSeqs: r.Running, DecodeContext: ctx * r.Running})
	owed := float64(r.DecodeTokens) * float64(step) / float64(r.InFlight)
	return time.Duration(float64(r.Waiting+1) / float64(r.Running) * owed)
}

// Service implements Estimator: P_t(best) · (1 + s_best).
func (e *DecodeAware) Service(t *Ticket, best int) time.Duration {
	if e.Prefill == nil || best < 0 {
		return 0
	}
	p := e.Prefill(t, best)
	if e.Reps != nil {
		if reps := e.Reps(); best < len(reps) {
			p = stretch(p, e.share(best, &reps[best]))
		}
	}
	return p
}

func stretch(d time.Duration, s float64) time.Duration {
	return d + time.Duration(float64(d)*s)
}

// share is s_r (E2's decodeShare): 0 while nothing decodes or the profile
// is unknown.
func (e *DecodeAware) share(i int, r *policy.Replica) float64 {
	if r.Decoding <= 0 || e.Profile == nil {
		return 0
	}
	prof := e.Profile(i)
	if prof == nil {
		return 0
	}
	budget := costmodel.BatchingOf(prof).MaxBatchedTokens
	if budget <= 0 {
		budget = costmodel.DefaultBatching.MaxBatchedTokens
	}
	ctx := r.DecodeContextTokens / r.Decoding
	e.chunk[0] = costmodel.Chunk{New: budget, Seq: budget}
	ch := e.chunk[:]
	alone := prof.Iteration(costmodel.Batch{Prefill: ch})
	if alone <= 0 {
		return 0
	}
	mixed := prof.Iteration(costmodel.Batch{Prefill: ch, DecodeSeqs: r.Decoding, DecodeContext: ctx * r.Decoding})
	return float64(mixed)/float64(alone) - 1
}
