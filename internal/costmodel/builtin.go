package costmodel

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

// ErrUnknownProfile is wrapped by Lookup's and BuiltinConfig's error for a
// name that is not a built-in profile (ARCHITECTURE.md lists the names).
var ErrUnknownProfile = errors.New("costmodel: unknown profile")

// Names of the built-in profiles (ARCHITECTURE.md, "Names used on the command
// line").
const (
	Mistral7BA6000   = "mistral-7b-a6000"
	Llama3_70BH100x2 = "llama3-70b-h100x2"
	Qwen3_32BH100x2  = "qwen3-32b-h100x2"
	Llama31_8BH100   = "llama3.1-8b-h100"
	// Llama31_8BA100 is Llama-3.1-8B on one A100 SXM4 80GB, a roofline with
	// the H100 profiles' assumptions and vLLM's A100 batching defaults.
	Llama31_8BA100 = "llama3.1-8b-a100"
	// LlamaCppTinyCPU is llama.cpp's llama-server on one CPU thread with the
	// tiny random-weight model of make_tiny_gguf.py (docs/profiles.md), for
	// `prefixlb sim --engine llamacpp` against the real server.
	LlamaCppTinyCPU = "llamacpp-tiny-cpu"
)

// llamaCppTinyCPU is the fit of llama-server (llama.cpp c392e50, CPU build,
// -t 1 -np 2 -c 16384, n_batch 2048) serving make_tiny_gguf.py's default
// model (Llama architecture, dim 256, 4 layers, Qwen3's 151,669-token
// vocabulary, q8_0) on this project's 2-core machine, measured from
// timings.prompt_ms and timings.predicted_per_token_ms (docs/profiles.md has
// the 63 prefill and 35 decode measurements and the residuals;
// testdata/llamacpp-tiny-cpu holds them with the scripts that took and fitted
// them).
//
// The seq of both fits is llama.cpp's attention span, every used cell of
// the KV buffer its slots share, which is what the replica model's slot
// cache passes (internal/replica, slots.go): prefill per 2,048-token batch
// is 9.037 + 0.08167·new + 2.1479e−4·new·span ms (mean error 5.6%, worst
// +35% on a cold 2,048-token prompt beside an empty slot, since the fit
// prices a batch at its final span where llama.cpp's 512-token ubatches see
// it grow); a decode step is 2.718 + 0.4664·sequences + 8.064e−4·span ms
// (mean error 6.9%; the span is read once per step, not per sequence). The
// KV capacity is the -c context, 16,384 tokens (8,192 per slot with -np 2).
func llamaCppTinyCPU() Config {
	return Config{
		Name: LlamaCppTinyCPU, Kind: KindLinear,
		PrefillMS:        &PrefillFit{C0: 9.037, New: 0.08167, NewSeq: 2.1479e-4},
		DecodeMS:         &DecodeFit{C0: 2.718, PerSeq: 0.4664, PerContextToken: 8.064e-4},
		KVCapacityTokens: 16_384,
		// llama.cpp's n_batch (common.h, n_batch = 2048) is the most tokens
		// one llama_decode takes, the chunk budget of this engine. max_num_seqs
		// has no llama.cpp counterpart: the replica model's slot cache
		// (sim --engine llamacpp) takes its sequences from -np and does not
		// read it; 2 is the -np 2 of the measured server, so a block-cache
		// replica given this profile runs as many sequences as it did.
		Batching: &Batching{MaxBatchedTokens: 2048, MaxSeqs: 2},
	}
}

// h100SXM is one NVIDIA H100 SXM5 80GB (NVIDIA H100 datasheet): 989 TFLOP/s
// dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3, 80 GiB of HBM3
// (nvidia-smi shows 81,559 MiB usable; the calibrated memory fraction
// below absorbs the difference). Name is what the driver reports for it; vLLM's batching rule gives it
// 8,192 batched tokens and 1,024 sequences (VLLMBatching).
func h100SXM(count int) *GPU {
	return &GPU{Count: count, PeakFLOPS: 989.4e12, HBMBandwidth: 3.35e12, MemoryBytes: 80 << 30, Name: "NVIDIA H100 80GB HBM3"}
}

// a100SXM is one NVIDIA A100 SXM4 80GB (NVIDIA A100 datasheet): 312 TFLOP/s
// dense BF16 (624 with sparsity), 2,039 GB/s HBM2e, 80 GiB (nvidia-smi
// shows 81,920 MiB). Name is what the driver reports for it; vLLM's
// batching rule excludes A100s by name from the large defaults despite
// their 80 GiB, so it gets 2,048 batched tokens and 256 sequences
// (VLLMBatching).
func a100SXM(count int) *GPU {
	return &GPU{Count: count, PeakFLOPS: 312e12, HBMBandwidth: 2.039e12, MemoryBytes: 80 << 30, Name: "NVIDIA A100-SXM4-80GB"}
}

// h100Assumptions are the efficiency figures of every H100 profile, and of
// llama3.1-8b-a100 so that the A100 and H100 profiles of Llama-3.1-8B differ
// only in their GPU figures (assumed, not measured on an A100).
//
//   - MFU 0.55: large prefill chunks in vLLM/SGLang on Hopper reach about half
//     of dense peak once attention, norms and TP all-reduce are counted.
//   - MBU 0.65: decode kernels read weights and KV at about two thirds of HBM
//     bandwidth at these batch sizes.
//   - MemoryFraction 0.85036: calibrated so that Qwen3-32B on 2×H100 holds
//     exactly the 307,328 KV tokens per replica that llm-d's benchmark of
//     prefix-cache-aware routing reports (ALGORITHMS.md §5):
//     (2·80 GiB·0.85036 − 65.52 GB of weights) / 256 KiB per token
//     = 307,336 tokens, 307,328 in whole 16-token blocks. It stands for vLLM's
//     gpu_memory_utilization (0.9 by default) less its activation and CUDA
//     graph reserve, and is used for every H100 profile so that they agree.
//   - KVBlockTokens 16: vLLM's default block size.
//
// overheadMS is per profile: a fixed cost per iteration for launches,
// scheduling and sampling, plus 128 NVLink all-reduces per step under TP 2.
func h100Assumptions(overheadMS float64) *Assumptions {
	return &Assumptions{MFU: 0.55, MBU: 0.65, MemoryFraction: 0.85036, OverheadMS: overheadMS, KVBlockTokens: 16}
}

// qwen3_32B is Qwen/Qwen3-32B's config.json: hidden 5120, 64 layers, 64 query
// heads, 8 KV heads, head_dim 128, intermediate 25600, vocab 151936, untied
// embeddings, bf16. Params = 64·487,598,336 per layer (q 5120·8192,
// k and v 5120·1024, o 8192·5120, MLP 3·5120·25600, norms) + 2·151936·5120
// (embeddings and LM head) + 5120 = 32,762,123,264 ("32.8B").
func qwen3_32B() *Model {
	return &Model{Params: 32_762_123_264, Layers: 64, Heads: 64, KVHeads: 8, HeadDim: 128, DTypeBytes: 2}
}

// llama31_8B is meta-llama/Llama-3.1-8B's config.json: 32 layers, 32 query
// heads, 8 KV heads, head_dim 128, bf16, 8,030,261,248 parameters.
func llama31_8B() *Model {
	return &Model{Params: 8_030_261_248, Layers: 32, Heads: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2}
}

// llama3_70B is meta-llama/Meta-Llama-3-70B's config.json: 80 layers, 64
// query heads, 8 KV heads, head_dim 128, bf16, 70,553,706,496 parameters.
// The llama3-70b-h100x2 profile is a fit, not a roofline; these figures give
// its decode KV-read cost and its KV capacity.
func llama3_70B() *Model {
	return &Model{Params: 70_553_706_496, Layers: 80, Heads: 64, KVHeads: 8, HeadDim: 128, DTypeBytes: 2}
}

// llama70BDecode is the decode step of llama3-70b-h100x2 in ms:
// 18.667 + 0.079879·sequences + (KV read time per context token)·context.
//
// The published fit is per request and was measured on prefill. Used for
// decode as is (new = 1 per sequence), its seq term (2.6853e−3 ms per context
// token) would make a batch of 32 sequences of 2k context take 197 ms, while
// reading their 21.5 GB of KV from two H100s takes about 5 ms and the whole
// step is measured at 25–30 ms; the term captures prefill's compute-bound
// attention and per-request overheads, not the KV read of a decode step, and
// E2 would charge 5.6 ms of marginal decode per sequence instead of 0.2 ms.
// So decode keeps the fit's constant (18.667 ms, paid once per iteration; it
// matches reading the 141 GB of weights at 6.7 TB/s, about 21 ms) and its
// per-token linear cost (0.079879 ms per sequence), and prices the context
// as the memory time of reading its KV: 327,680 bytes per token at
// 2·3.35 TB/s·MBU 0.65 = 7.52e−5 ms per token. The fit's new·seq term at
// new = 1 (7.4e−7 ms per token) is below that and left out.
func llama70BDecode() *DecodeFit {
	g, a := h100SXM(2), h100Assumptions(0)
	perToken := llama3_70B().KVBytesPerToken() / (float64(g.Count) * g.HBMBandwidth * a.MBU) * 1e3
	return &DecodeFit{C0: 18.667, PerSeq: 0.079879, PerContextToken: perToken}
}

// builtins returns the configs of the built-in profiles, fresh on each call.
func builtins() map[string]Config {
	return map[string]Config{
		// Preble's fit (arXiv 2407.00023; WukLab/preble
		// multi_node/benchmarks/exp_configs/model_equations_numpy.py).
		// KV capacity 198,516 tokens on one 48 GB A6000, as ALGORITHMS.md §5
		// gives it for Preble's setup.
		//
		// Batching is Preble's, not vLLM's: max_num_batched_tokens 512 is the
		// chunk_prefill_budget: 512 of the "ours" server configs of Preble's
		// experiments (multi_node/benchmarks/multi_exp_configs/,
		// e2e_toolbench_config.py @ 678f6e6d3a5ec8a6f32f7c44a8584c13f5821368,
		// e2e_loogle_config.py @ dfd7611c9fc75f9cb3b2ff2555d96f70a6083485).
		// max_num_seqs stays vLLM's 256: Preble's SGLang fork has no
		// max_running_requests; it derives max_num_running_seq =
		// max_total_num_token / 2 (about 99k here) in
		// python/sglang/srt/managers/router/model_rpc.py
		// @ 594fc9475e5c9eb95df582e5aa377b322844ca04, a limit that never binds
		// at the simulated loads. (Preble's SGLang baseline ran without
		// chunking; the simulator uses one batching per profile, see
		// docs/profiles.md.)
		Mistral7BA6000: {
			Name: Mistral7BA6000, Kind: KindPrebleMistral, KVCapacityTokens: 198_516,
			Batching: &Batching{MaxBatchedTokens: 512, MaxSeqs: 256},
		},
		// Preble's published fit, ms per request (ALGORITHMS.md §5; the
		// prototype's model_equations_numpy.py has the same form for A100,
		// llama3_70b_A100_tp2_sglang_extend_flashinfer). Decode: see
		// llama70BDecode. KV capacity: the roofline memory arithmetic on the
		// same 2×H100 figures as qwen3-32b-h100x2 (kvCapacity):
		// (2·80 GiB·0.85036 − 141.1 GB) / 320 KiB = 15,200 tokens.
		// Batching: vLLM's default on H100s, 8,192 tokens and 1,024
		// sequences (VLLMBatching), given explicitly since a linear profile
		// has no GPU to derive it from.
		Llama3_70BH100x2: {
			Name: Llama3_70BH100x2, Kind: KindLinear,
			PrefillMS:        &PrefillFit{C0: 18.667, New: 0.079879, Seq: 2.6853e-3, NewSeq: 7.4434e-7},
			DecodeMS:         llama70BDecode(),
			KVCapacityTokens: kvCapacity(*llama3_70B(), *h100SXM(2), *h100Assumptions(0)),
			Batching:         &Batching{MaxBatchedTokens: 8192, MaxSeqs: 1024},
		},
		// Roofline, 2×H100 tensor parallel; KV capacity 307,328 tokens as in
		// llm-d's benchmark. Overhead 4 ms: 128 all-reduces at ~15 µs plus
		// ~2 ms of launch, scheduling and sampling.
		Qwen3_32BH100x2: {Name: Qwen3_32BH100x2, Kind: KindRoofline, Model: qwen3_32B(), GPU: h100SXM(2), Assume: h100Assumptions(4)},
		// Roofline, one H100; 1.5 ms of launch, scheduling and sampling.
		// Batching by vLLM's rule: 8,192 / 1,024 (as for qwen3-32b-h100x2).
		Llama31_8BH100: {Name: Llama31_8BH100, Kind: KindRoofline, Model: llama31_8B(), GPU: h100SXM(1), Assume: h100Assumptions(1.5)},
		// Roofline, one A100 SXM4 80GB (a100SXM) with the H100 profiles'
		// assumptions and the same 1.5 ms overhead as llama3.1-8b-h100:
		// prefill is bound by 312 TFLOP/s·0.55, decode by 2.039 TB/s·0.65.
		// KV capacity as on the H100, which has the same 80 GiB:
		// (80 GiB·0.85036 − 16.06 GB) / 128 KiB = 434,752 tokens in
		// 16-token blocks. Batching by vLLM's rule, which names the A100:
		// 2,048 / 256.
		Llama31_8BA100: {Name: Llama31_8BA100, Kind: KindRoofline, Model: llama31_8B(), GPU: a100SXM(1), Assume: h100Assumptions(1.5)},
		// Measured on llama-server, CPU (llamaCppTinyCPU).
		LlamaCppTinyCPU: llamaCppTinyCPU(),
	}
}

// BuiltinConfig returns the config of the built-in profile name (a copy the
// caller may change), or an error wrapping ErrUnknownProfile.
func BuiltinConfig(name string) (Config, error) {
	c, ok := builtins()[name]
	if !ok {
		return Config{}, fmt.Errorf("%w %q (known: %s)", ErrUnknownProfile, name, strings.Join(Names(), ", "))
	}
	return c, nil
}

// Lookup returns the built-in profile name (ALGORITHMS.md §5; the figures
// and their sources are in builtins and docs/profiles.md), or an error
// wrapping ErrUnknownProfile that lists the known names.
func Lookup(name string) (Profile, error) {
	c, err := BuiltinConfig(name)
	if err != nil {
		return nil, err
	}
	return New(c)
}

// Names lists the built-in profiles, sorted (the names of ARCHITECTURE.md's
// command-line contract).
func Names() []string {
	b := builtins()
	names := make([]string, 0, len(b))
	for n := range b {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
