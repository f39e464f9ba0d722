package costmodel

import (
	"math"
	"time"
)

// Model gives the figures of a decoder-only transformer that a roofline
// profile needs (ALGORITHMS.md §5), as found in the model's config.json on
// Hugging Face.
type Model struct {
	// Params is the parameter count, embeddings and LM head included.
	Params float64 `json:"params"`
	// Layers is the number of transformer blocks (num_hidden_layers).
	Layers int `json:"layers"`
	// Heads is the number of query heads (num_attention_heads).
	Heads int `json:"heads"`
	// KVHeads is the number of key/value heads (num_key_value_heads; GQA).
	KVHeads int `json:"kv_heads"`
	// HeadDim is the size of one head (head_dim).
	HeadDim int `json:"head_dim"`
	// DTypeBytes is the size of one weight and one KV element: 2 for bf16.
	DTypeBytes int `json:"dtype_bytes"`
}

// WeightBytes is the memory the weights take: Params·DTypeBytes.
func (m Model) WeightBytes() float64 { return m.Params * float64(m.DTypeBytes) }

// KVBytesPerToken is the KV cache one token takes over all layers:
// 2 (K and V)·Layers·KVHeads·HeadDim·DTypeBytes.
func (m Model) KVBytesPerToken() float64 {
	return 2 * float64(m.Layers) * float64(m.KVHeads) * float64(m.HeadDim) * float64(m.DTypeBytes)
}

// GPU gives the accelerators of one replica, from the vendor's datasheet
// (ALGORITHMS.md §5, "Roofline"). Peak, bandwidth and memory are
// per GPU; a replica of Count GPUs (tensor parallel) has Count times each.
type GPU struct {
	// Count is the number of GPUs in one replica (the tensor-parallel degree).
	Count int `json:"count"`
	// PeakFLOPS is one GPU's dense peak for the model's dtype, in FLOP/s.
	PeakFLOPS float64 `json:"peak_flops"`
	// HBMBandwidth is one GPU's memory bandwidth, in bytes/s.
	HBMBandwidth float64 `json:"hbm_bytes_per_s"`
	// MemoryBytes is one GPU's memory, in bytes.
	MemoryBytes float64 `json:"memory_bytes"`
	// Name is the device name as the driver reports it (nvidia-smi,
	// torch.cuda.get_device_name), e.g. "NVIDIA H100 80GB HBM3" or
	// "NVIDIA A100-SXM4-80GB". Only VLLMBatching reads it (vLLM's A100
	// test); it does not change any time. Optional.
	Name string `json:"name,omitempty"`
}

// Assumptions are the efficiency figures that turn peaks into times
// (ALGORITHMS.md §5: MFU, MBU and the GPU memory fraction).
type Assumptions struct {
	// MFU is the fraction of peak FLOP/s that compute-bound work reaches.
	MFU float64 `json:"mfu"`
	// MBU is the fraction of HBM bandwidth that memory-bound work reaches.
	MBU float64 `json:"mbu"`
	// MemoryFraction is the share of GPU memory left to weights and KV cache
	// (the rest: activations, CUDA graphs, the runtime). vLLM's
	// gpu_memory_utilization less its activation reserve.
	MemoryFraction float64 `json:"memory_fraction"`
	// OverheadMS is a fixed cost per iteration in milliseconds: kernel
	// launches, scheduling, sampling, tensor-parallel all-reduce latency.
	OverheadMS float64 `json:"overhead_ms"`
	// KVBlockTokens rounds the KV capacity down to whole blocks (vLLM's
	// block_size, 16 by default); 0 or 1 means no rounding.
	KVBlockTokens int `json:"kv_block_tokens"`
}

// kvCapacity is (Count·MemoryBytes·MemoryFraction − weights) / KV bytes per
// token, rounded down to whole blocks; 0 when the weights do not fit. This is
// vLLM's arithmetic (memory budget less weights and reserves, divided by the
// bytes of one block) with the reserves folded into MemoryFraction.
func kvCapacity(m Model, g GPU, a Assumptions) int {
	free := float64(g.Count)*g.MemoryBytes*a.MemoryFraction - m.WeightBytes()
	tokens := math.Floor(free / m.KVBytesPerToken())
	if !(tokens > 0) { // also NaN
		return 0
	}
	n := math.MaxInt
	if tokens < float64(math.MaxInt) {
		n = int(tokens)
	}
	if a.KVBlockTokens > 1 {
		n -= n % a.KVBlockTokens
	}
	return n
}

// roofline prices an iteration from model and GPU figures, the estimate of
// ALGORITHMS.md §5 (a roofline in the sense of Williams et al., CACM 2009:
// prefill is bound by FLOPs, decode by reading the weights and the KV cache):
//
//	compute = (2·Params·tokens + 4·Layers·Heads·HeadDim·pairs) / (Count·PeakFLOPS·MFU)
//	memory  = (weights + KVBytesPerToken·context) / (Count·HBMBandwidth·MBU)
//	time    = max(compute, memory) + OverheadMS
//
// tokens counts every token computed (new prefill tokens and one per decoding
// sequence); pairs counts (query, key) pairs under the causal mask: a chunk of
// n new tokens ending a sequence of s has n·(s − (n−1)/2), a decoding
// sequence of context c has c (QKᵀ and AV are 2 FLOPs per multiply-add each
// over Heads·HeadDim, hence 4); context is the KV read or written: every
// chunk's whole sequence and every decoding sequence's context.
type roofline struct {
	name  string
	model Model
	gpu   GPU
	as    Assumptions
	kv    int
	batch Batching

	flopsPerToken float64 // 2·Params
	flopsPerPair  float64 // 4·Layers·Heads·HeadDim
	flopRate      float64 // Count·PeakFLOPS·MFU
	weightBytes   float64
	kvPerToken    float64
	byteRate      float64 // Count·HBMBandwidth·MBU
	adapter       AdapterLoad
}

var (
	_ Profile = (*roofline)(nil)
	_ Batcher = (*roofline)(nil)
)

func newRoofline(name string, m Model, g GPU, a Assumptions, b Batching) *roofline {
	return &roofline{
		name: name, model: m, gpu: g, as: a, batch: b,
		kv:            kvCapacity(m, g, a),
		flopsPerToken: 2 * m.Params,
		flopsPerPair:  4 * float64(m.Layers) * float64(m.Heads) * float64(m.HeadDim),
		flopRate:      float64(g.Count) * g.PeakFLOPS * a.MFU,
		weightBytes:   m.WeightBytes(),
		kvPerToken:    m.KVBytesPerToken(),
		byteRate:      float64(g.Count) * g.HBMBandwidth * a.MBU,
	}
}

func (r *roofline) Name() string    { return r.name }
func (r *roofline) KVCapacity() int { return r.kv }

// Batching is the config's batching, by default vLLM's for the GPU
// (VLLMBatching).
func (r *roofline) Batching() Batching { return r.batch }

func (r *roofline) Prefill(newTokens, seqTokens int) time.Duration {
	c := [1]Chunk{{New: newTokens, Seq: seqTokens}}
	return r.Iteration(Batch{Prefill: c[:]})
}

// Iteration is max(compute, memory) + overhead for the whole batch (see the
// type's comment): the weights are read once per iteration however many
// sequences share it, which is why decode is memory bound and batching it is
// nearly free until the KV reads or the FLOPs catch up.
func (r *roofline) Iteration(b Batch) time.Duration {
	var tokens, pairs, context float64
	for _, c := range b.Prefill {
		if c.New <= 0 {
			continue
		}
		n := float64(c.New)
		s := math.Max(nonNeg(c.Seq), n)
		tokens += n
		// n·(s − (n−1)/2), written with non-negative terms only so that
		// rounding cannot make it fall as n or s grows.
		pairs += n * ((s - n) + (n+1)/2)
		context += s
	}
	if b.DecodeSeqs > 0 {
		c := nonNeg(b.DecodeContext)
		tokens += float64(b.DecodeSeqs)
		pairs += c
		context += c
	}
	if tokens == 0 {
		return 0
	}
	compute := (r.flopsPerToken*tokens + r.flopsPerPair*pairs) / r.flopRate
	memory := (r.weightBytes + r.kvPerToken*context) / r.byteRate
	return fromSeconds(math.Max(compute, memory) + r.as.OverheadMS/1e3)
}
