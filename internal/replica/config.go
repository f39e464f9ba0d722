package replica

import (
	"errors"
	"fmt"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// Names of the local schedulers, as given to Config.Local and on the command
// line (--local).
const (
	// LocalFCFS admits waiting requests in arrival order (vLLM's default
	// policy), stopping at the first that does not fit.
	LocalFCFS = "fcfs"
	// LocalLPM admits the waiting request with the longest cached prefix first
	// (SGLang's default "lpm" schedule policy), ties in arrival order.
	LocalLPM = "lpm"
	// LocalPriority is Preble's "fcfs-mpq" local scheduler: waiting requests
	// fall into PriorityGroups groups by cache-hit ratio and the groups take
	// turns (Srivatsa et al., ICLR 2025, and its prototype WukLab/preble).
	LocalPriority = "priority"
)

// Roles a replica can have in a disaggregated cluster (Config.Role): where a
// request's prefill and decode run. vLLM's disaggregated serving
// (NixlConnector, docs/features/disagg_prefill.md) runs one engine per role
// and a proxy that sends each request's prompt to a prefill engine with
// max_tokens 1, then the request to a decode engine that pulls the prompt's
// KV from it; llm-d labels its pods llm-d.ai/role prefill, decode or both.
const (
	// RoleBoth prefills and decodes its own requests (an aggregated
	// replica, today's). "" means RoleBoth.
	RoleBoth = "both"
	// RolePrefill only prefills: it takes requests of one output token
	// (the prefill leg of a disaggregated request, max_tokens 1) and never
	// receives KV from another replica.
	RolePrefill = "prefill"
	// RoleDecode decodes requests whose prompt's KV it pulls from a
	// prefill replica (Request.RemoteKV), and, when the router so decides,
	// prefills and decodes a request itself (conditional disaggregation).
	RoleDecode = "decode"
)

// Defaults filled in by Config.Default.
const (
	// DefaultChunkBudget is the prefill token budget of an iteration,
	// decodes included, of a replica whose profile gives none: vLLM's
	// max_num_batched_tokens when it cannot tell the GPU
	// (costmodel.DefaultBatching). A profile's own (costmodel.BatchingOf:
	// vLLM's rule by GPU memory for a roofline) comes first.
	DefaultChunkBudget = 2048
	// DefaultMaxRunning is vLLM's max_num_seqs for the same case.
	DefaultMaxRunning = 256
	// DefaultPriorityGroups is Preble's number of priority groups.
	DefaultPriorityGroups = 10
	// DefaultPriorityQuota is Preble's k: group g admits at most k·(g+1)
	// requests on its turn (k = 10 in the prototype's chunked-prefill path).
	DefaultPriorityQuota = 10
	// DefaultSlotSimilarity is llama.cpp's --slot-prompt-similarity default
	// (common.h, slot_prompt_similarity = 0.5f).
	DefaultSlotSimilarity = 0.5
	// LlamaCppBatch is llama.cpp's default n_batch, the most tokens one
	// llama_decode of update_slots takes (common.h, n_batch = 2048): the
	// ChunkBudget that models llama-server.
	LlamaCppBatch = 2048
)

// NoSlotSimilarity, as Config.SlotSimilarity, turns similarity matching off:
// a request takes the least recently used idle slot (llama.cpp's
// --slot-prompt-similarity 0).
const NoSlotSimilarity = -1

// NoChunking, as Config.ChunkBudget, turns chunked prefill off: a prompt is
// prefilled in one iteration and an iteration has no token limit.
const NoChunking = -1

// ErrInvalidConfig is wrapped by every error Config.Validate returns.
var ErrInvalidConfig = errors.New("replica: invalid config")

// Config configures one replica. Fill what you need, call Default for the
// rest; New does both and validates.
type Config struct {
	// Profile prices each iteration (costmodel.Profile.Iteration) and, when
	// KVCapacity is 0, gives the KV capacity. Required.
	Profile costmodel.Profile
	// BlockSize is the number of tokens per KV block (vLLM's --block-size).
	// It must equal the block size the request keys were made with.
	// Default blocks.DefaultBlockSize (16).
	BlockSize int
	// KVCapacity is the KV cache size in tokens; the replica holds
	// KVCapacity/BlockSize blocks (a partial block is dropped). 0 means
	// Profile.KVCapacity().
	KVCapacity int
	// ChunkBudget is the most tokens one iteration computes, running decodes
	// (one token each) included, like vLLM's max_num_batched_tokens with
	// chunked prefill; a prompt longer than what is left is prefilled over
	// several iterations. NoChunking (-1) disables chunking and the limit.
	// When chunking, it must be at least MaxRunning (vLLM requires
	// max_num_batched_tokens >= max_num_seqs). Default: the profile's
	// engine batching (costmodel.BatchingOf: 8192 on an H100, 2048 on an
	// A100, 512 for Preble's A6000 runs), DefaultChunkBudget without a
	// profile.
	ChunkBudget int
	// MaxRunning is the most requests admitted at once (prefilling or
	// decoding), vLLM's max_num_seqs. Default: the profile's (1024 on an
	// H100, 256 elsewhere), DefaultMaxRunning without a profile.
	MaxRunning int
	// Local names the local scheduler that orders admission: LocalFCFS,
	// LocalLPM or LocalPriority. Default LocalFCFS.
	Local string
	// PriorityGroups is the number of Preble priority groups (LocalPriority
	// only). Default DefaultPriorityGroups.
	PriorityGroups int
	// PriorityQuota is Preble's k: on its turn group g admits at most
	// PriorityQuota·(g+1) requests (LocalPriority only). Default
	// DefaultPriorityQuota.
	PriorityQuota int
	// Slots, when positive, replaces the block cache by llama.cpp's slot
	// cache (llama-server -np Slots; slots.go): the KV capacity is split
	// evenly between Slots slots, each keeping the last prompt it served,
	// at most Slots requests run and the rest wait in arrival order.
	// MaxRunning is then not used, ChunkBudget (llama.cpp's n_batch) must be
	// at least Slots and Local must be LocalFCFS. 0 (the default) is the
	// block cache.
	Slots int
	// SlotSimilarity is llama.cpp's --slot-prompt-similarity: a request goes
	// to the idle slot whose cache it shares more than this fraction of (of
	// the slot's cached tokens). Slot cache only; in [0, 1), 0 meaning
	// DefaultSlotSimilarity, or NoSlotSimilarity.
	SlotSimilarity float64
	// Role is the replica's role in a disaggregated cluster: RoleBoth (or
	// ""; the default), RolePrefill or RoleDecode. A prefill replica
	// rejects requests of more than one output token and requests with
	// RemoteKV; RemoteKV needs a block cache (Slots 0).
	Role string
	// MaxLoras is vLLM's --max-loras: how many LoRA adapters the replica
	// holds in GPU slots at once (lora.go). Requests for other adapters
	// wait for a slot their load can take, and loading one takes the
	// profile's costmodel.AdapterLoad. 0 (the default) does not model
	// slots: every adapter is resident and loads cost nothing. A block
	// cache only.
	MaxLoras int
	// CPUOffloadTokens is the size, in tokens, of a CPU offload tier like
	// vLLM's OffloadingConnector with its CPU backend (offload.go): full
	// blocks are written through to it, evicted LRU, and a request whose
	// prompt continues there past its GPU hit loads those blocks (their KV
	// bytes over the profile's CPU bandwidth, costmodel.TierBandwidth)
	// instead of recomputing them. Its changes are events with Medium
	// costmodel.MediumCPU. 0 (the default) is no tier. A block cache only;
	// the profile must give KV bytes per token (costmodel.KVBytesOf).
	CPUOffloadTokens int
}

// DefaultConfig returns a Config with every default filled in but those that
// come from the profile (ChunkBudget and MaxRunning stay 0: New fills them
// from the Profile set later) and no Profile.
func DefaultConfig() Config {
	var c Config
	c.Default()
	return c
}

// Default fills the zero fields that have a default. It leaves Profile and
// KVCapacity (0 means the profile's) alone, and ChunkBudget and MaxRunning
// too while there is no Profile to take them from.
func (c *Config) Default() {
	if c.BlockSize == 0 {
		c.BlockSize = blocks.DefaultBlockSize
	}
	if c.Profile != nil {
		b := costmodel.BatchingOf(c.Profile)
		if c.ChunkBudget == 0 {
			c.ChunkBudget = cmpOr(b.MaxBatchedTokens, DefaultChunkBudget)
		}
		if c.MaxRunning == 0 {
			c.MaxRunning = cmpOr(b.MaxSeqs, DefaultMaxRunning)
		}
	}
	if c.Local == "" {
		c.Local = LocalFCFS
	}
	if c.PriorityGroups == 0 {
		c.PriorityGroups = DefaultPriorityGroups
	}
	if c.PriorityQuota == 0 {
		c.PriorityQuota = DefaultPriorityQuota
	}
	if c.Slots > 0 && c.SlotSimilarity == 0 {
		c.SlotSimilarity = DefaultSlotSimilarity
	}
}

// cmpOr is v when positive, else def.
func cmpOr(v, def int) int {
	if v > 0 {
		return v
	}
	return def
}

// Validate reports the first rule the config breaks, as an error wrapping
// ErrInvalidConfig that names the field. It checks the config as given: call
// Default first if zero fields should mean their defaults.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.Profile == nil:
		return bad("Profile is nil")
	case c.BlockSize < 1:
		return bad("BlockSize must be at least 1, got %d", c.BlockSize)
	case c.KVCapacity < 0:
		return bad("KVCapacity must be 0 (the profile's) or positive, got %d", c.KVCapacity)
	case c.Slots < 0:
		return bad("Slots must be 0 (a block cache) or positive, got %d", c.Slots)
	case c.Role != "" && c.Role != RoleBoth && c.Role != RolePrefill && c.Role != RoleDecode:
		return bad("Role must be %q, %q or %q, got %q", RoleBoth, RolePrefill, RoleDecode, c.Role)
	case c.MaxLoras < 0:
		return bad("MaxLoras must be 0 (adapters not modelled) or positive, got %d", c.MaxLoras)
	case c.MaxLoras > 0 && c.Slots > 0:
		return bad("MaxLoras needs a block cache (Slots 0)")
	case c.CPUOffloadTokens < 0:
		return bad("CPUOffloadTokens must be 0 (no CPU tier) or positive, got %d", c.CPUOffloadTokens)
	case c.CPUOffloadTokens > 0 && c.Slots > 0:
		return bad("CPUOffloadTokens needs a block cache (Slots 0)")
	case c.CPUOffloadTokens > 0 && c.CPUOffloadTokens < c.BlockSize:
		return bad("CPUOffloadTokens (%d) must hold at least one block of %d tokens", c.CPUOffloadTokens, c.BlockSize)
	case c.CPUOffloadTokens > 0 && !(costmodel.KVBytesOf(c.Profile) > 0):
		return bad("CPUOffloadTokens needs a profile that gives KV bytes per token (a roofline does); %s does not", c.Profile.Name())
	case c.Role == RoleDecode && c.Slots > 0:
		return bad("Role %q needs a block cache (Slots 0): llama.cpp's slots do not receive KV", RoleDecode)
	}
	if c.Slots > 0 {
		return c.validateSlots(bad)
	}
	if capTokens := c.capacity(); capTokens/c.BlockSize < 2 {
		return bad("KV capacity of %d tokens holds %d blocks of %d tokens; need at least 2",
			capTokens, capTokens/c.BlockSize, c.BlockSize)
	}
	switch {
	case c.MaxRunning < 1:
		return bad("MaxRunning must be at least 1, got %d", c.MaxRunning)
	case c.ChunkBudget != NoChunking && c.ChunkBudget < 1:
		return bad("ChunkBudget must be positive or %d (no chunking), got %d", NoChunking, c.ChunkBudget)
	case c.ChunkBudget != NoChunking && c.ChunkBudget < c.MaxRunning:
		return bad("ChunkBudget (%d) must be at least MaxRunning (%d) so every running decode fits an iteration",
			c.ChunkBudget, c.MaxRunning)
	case c.Local != LocalFCFS && c.Local != LocalLPM && c.Local != LocalPriority:
		return bad("Local must be %q, %q or %q, got %q", LocalFCFS, LocalLPM, LocalPriority, c.Local)
	case c.PriorityGroups < 1:
		return bad("PriorityGroups must be at least 1, got %d", c.PriorityGroups)
	case c.PriorityQuota < 1:
		return bad("PriorityQuota must be at least 1, got %d", c.PriorityQuota)
	}
	return nil
}

// validateSlots checks a slot-cache config (Slots > 0).
func (c Config) validateSlots(bad func(format string, args ...any) error) error {
	capTokens := c.capacity()
	switch {
	case capTokens/c.Slots/c.BlockSize < 2:
		return bad("KV capacity of %d tokens split between %d slots holds %d blocks of %d tokens per slot; need at least 2",
			capTokens, c.Slots, capTokens/c.Slots/c.BlockSize, c.BlockSize)
	case c.ChunkBudget != NoChunking && c.ChunkBudget < 1:
		return bad("ChunkBudget must be positive or %d (no chunking), got %d", NoChunking, c.ChunkBudget)
	case c.ChunkBudget != NoChunking && c.ChunkBudget < c.Slots:
		return bad("ChunkBudget (%d) must be at least Slots (%d) so every decoding slot fits an iteration",
			c.ChunkBudget, c.Slots)
	case c.Local != LocalFCFS:
		return bad("Local must be %q with Slots (llama.cpp serves waiting requests in arrival order), got %q", LocalFCFS, c.Local)
	case c.SlotSimilarity != NoSlotSimilarity && !(c.SlotSimilarity >= 0 && c.SlotSimilarity < 1):
		return bad("SlotSimilarity must be in [0, 1) or %d (off), got %v", NoSlotSimilarity, c.SlotSimilarity)
	}
	return nil
}

// capacity is the KV capacity in tokens; Profile must be set.
func (c Config) capacity() int {
	if c.KVCapacity > 0 {
		return c.KVCapacity
	}
	return c.Profile.KVCapacity()
}
