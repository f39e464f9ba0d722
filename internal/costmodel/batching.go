package costmodel

import "strings"

// Batching is the iteration budget of the engine a profile describes, in
// vLLM's terms (ALGORITHMS.md §5; docs/profiles.md, "Built-in profiles").
type Batching struct {
	// MaxBatchedTokens is vLLM's max_num_batched_tokens: the most tokens one
	// iteration computes under chunked prefill, decodes included (one token
	// per decoding sequence), so also the largest prefill chunk.
	MaxBatchedTokens int `json:"max_num_batched_tokens"`
	// MaxSeqs is vLLM's max_num_seqs: the most sequences running (prefilling
	// or decoding) at once.
	MaxSeqs int `json:"max_num_seqs"`
}

// DefaultBatching is what vLLM's OpenAI API server chooses when it cannot
// tell the GPU (device memory read as 0, which fails the ≥ 70 GiB test of
// VLLMBatching): 2,048 batched tokens and 256 sequences. Linear and
// preble-mistral profiles that give no batching get it. Treat it as a
// constant.
var DefaultBatching = Batching{MaxBatchedTokens: 2048, MaxSeqs: 256}

// Batcher is implemented by profiles that know their engine's batching
// defaults; every profile of this package does. It is optional so that any
// Profile (a test fake, another package's) still works: see BatchingOf.
type Batcher interface {
	// Batching is the profile's iteration budget.
	Batching() Batching
}

// Memoizer is implemented by profiles that remember the figures they
// computed (internal/calibrate's Model, whose figures are fits over a
// shared prior): a caller that memoizes figures per decision, as E2 does for
// profiles shared by every replica, need not for these.
type Memoizer interface {
	Memoized() bool
}

// Memoized reports whether p remembers its own figures (Memoizer).
func Memoized(p Profile) bool {
	m, ok := p.(Memoizer)
	return ok && m.Memoized()
}

// BatchingOf returns p's batching if p implements Batcher, else
// DefaultBatching.
func BatchingOf(p Profile) Batching {
	if b, ok := p.(Batcher); ok {
		return b.Batching()
	}
	return DefaultBatching
}

// vllmLargeMemory is the per-device memory from which vLLM uses its larger
// batching defaults: 70 GiB (GiB_bytes = 2^30).
const vllmLargeMemory = 70 << 30

// VLLMBatching is vLLM's default batching for the OpenAI API server (usage
// context OPENAI_API_SERVER) on a replica of GPUs g, with chunked prefill on
// (vLLM V1's default for generative models): if one device's total memory
// (g.MemoryBytes, per GPU) is at least 70 GiB and its lower-cased name does
// not contain "a100", 8,192 batched tokens and 1,024 sequences (H100, H200,
// MI300X); otherwise 2,048 and 256.
//
// Source: vllm-project/vllm, vllm/engine/arg_utils.py at commit
// 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b, EngineArgs._set_default_args;
// newer versions move the same table, with the same numbers, into
// EngineArgs.get_batch_defaults (seen at AndreasKaratzas/vllm commit
// 35966da405f606db7c915c23616b0c64c3133fcd). The A100 exclusion is a
// substring test on the device name because a large budget reduces A100
// throughput (vLLM PR #17885), so an 80 GB A100 gets the small defaults.
// (The LLM class, not modelled here, uses 16,384 and 8,192 tokens. vLLM's
// CPU backend uses 2,048·world_size tokens and 128·world_size sequences;
// this function models GPUs only.)
func VLLMBatching(g GPU) Batching {
	if g.MemoryBytes >= vllmLargeMemory && !strings.Contains(strings.ToLower(g.Name), "a100") {
		return Batching{MaxBatchedTokens: 8192, MaxSeqs: 1024}
	}
	return Batching{MaxBatchedTokens: 2048, MaxSeqs: 256}
}

// validateBatching checks a Config's batching: both figures positive and
// max_num_batched_tokens ≥ max_num_seqs (vLLM's SchedulerConfig rejects a
// token budget below the sequence limit).
func validateBatching(bad badFunc, b Batching) error {
	if err := positiveInt(bad, "batching.max_num_batched_tokens", b.MaxBatchedTokens); err != nil {
		return err
	}
	if err := positiveInt(bad, "batching.max_num_seqs", b.MaxSeqs); err != nil {
		return err
	}
	if b.MaxBatchedTokens < b.MaxSeqs {
		return bad("batching.max_num_batched_tokens", "must be >= batching.max_num_seqs (%d), as vLLM requires, got %d", b.MaxSeqs, b.MaxBatchedTokens)
	}
	return nil
}
