// Package costmodel gives the GPU time of prefill and decode for a model on a
// GPU: the numbers Preble's E2 (Srivatsa et al., ICLR 2025, §3.2) uses to price
// work in seconds, and that the replica model uses to advance its clock.
//
// Profiles come in three kinds (ALGORITHMS.md §5, docs/profiles.md): Preble's
// fitted Mistral-7B / A6000 model (arXiv 2407.00023 and its prototype,
// WukLab/preble), generic fitted linear forms such as Preble's Llama-3-70B
// fit, and rooflines computed from model and GPU figures. Lookup returns a
// built-in profile by name; Load and Parse read one from YAML; Resolve reads
// a profile spec, a name or file with optional time scaling
// ("llama3.1-8b-h100:time_scale=0.5"). Every profile here also carries its
// engine's batching defaults (Batcher, BatchingOf, VLLMBatching). Everything
// here is pure: no clock, no randomness, no goroutines, no I/O but Load's.
package costmodel

import (
	"reflect"
	"time"
)

// Profile prices the work of one replica. Implementations are pure functions of
// their arguments and safe for concurrent use.
type Profile interface {
	// Name is the profile's name as given on the command line.
	Name() string
	// Prefill is the time to compute newTokens tokens of one request whose
	// sequence (cached context plus new tokens) is seqTokens long, run alone.
	Prefill(newTokens, seqTokens int) time.Duration
	// Iteration is the time of one engine iteration of a continuous batch that
	// computes prefillTokens new prompt tokens (over all requests, whose
	// sequences total prefillContext tokens) and decodes one token for each of
	// decodeSeqs running sequences holding decodeContext tokens in all.
	Iteration(b Batch) time.Duration
	// KVCapacity is how many tokens of KV cache one replica holds.
	KVCapacity() int
}

// Same reports whether a and b are the same profile: the same value, or
// equal values (every profile here is a pure value: two loads of one
// built-in name, spec or file give equal ones). The router pools the
// calibration of replicas told the same profile by it.
func Same(a, b Profile) bool {
	return a == b || (a != nil && b != nil && reflect.DeepEqual(a, b))
}

// Batch describes one engine iteration for Profile.Iteration.
type Batch struct {
	// Prefill lists the prompt chunks computed in this iteration.
	Prefill []Chunk
	// DecodeSeqs is the number of sequences that each decode one token.
	DecodeSeqs int
	// DecodeContext is the total context length of those sequences, in tokens.
	DecodeContext int
}

// Chunk is the part of one request's prompt computed in one iteration.
type Chunk struct {
	New int // tokens computed now
	Seq int // sequence length after this chunk (cached + earlier chunks + New)
}
