// Package kvevents keeps prefixlb's view of each replica's prefix cache exact by
// following the KV-cache event stream vLLM publishes, and publishes the same
// stream from prefixlb's simulated engine.
//
// The wire format is vLLM's (vllm/distributed/kv_events.py): a ZeroMQ PUB socket
// sends three-frame messages [topic, seq, payload], seq an 8-byte big-endian
// counter from 0, payload a msgpack EventBatch; a ROUTER socket replays the last
// N batches to a DEALER that asks for them. docs/kv-events.md describes every
// variant this package accepts and the recovery rules.
//
// The package has four parts, usable separately:
//   - DecodeBatch / EncodeBatch: the msgpack codec, both event encodings;
//   - Index: engine block hash → router key per replica, feeding a Sink;
//   - Subscriber: one replica's stream, in order, with gap replay, publisher
//     restarts and re-dialling;
//   - Publisher: the engine side, PUB plus ROUTER replay.
package kvevents

// Event is one KV-cache event: a BlockStored, a BlockRemoved or an
// AllBlocksCleared value (vLLM's KVCacheEvent subclasses).
type Event interface {
	// Type is the event's msgspec tag: "BlockStored", "BlockRemoved" or
	// "AllBlocksCleared".
	Type() string
}

// Event type names, as vLLM tags them.
const (
	TypeBlockStored      = "BlockStored"
	TypeBlockRemoved     = "BlockRemoved"
	TypeAllBlocksCleared = "AllBlocksCleared"
)

// Media vLLM names in the medium field. A missing medium (releases before the
// field existed, or nil) means MediumGPU.
const (
	MediumGPU = "GPU"
	MediumCPU = "CPU"
)

// BlockStored says the engine cached len(BlockHashes) new full blocks, chained
// after ParentHash, whose tokens are TokenIDs (BlockSize ids per block).
// Fields follow vLLM's BlockStored in array order.
type BlockStored struct {
	// BlockHashes are the engine's hashes of the new blocks, folded to uint64
	// (see FoldHash).
	BlockHashes []uint64
	// ParentHash is the engine hash of the block before the first new one;
	// meaningful only when HasParent (vLLM sends nil for a prompt's first block).
	ParentHash uint64
	HasParent  bool
	// TokenIDs covers the new blocks: len(BlockHashes)·BlockSize ids.
	TokenIDs  []uint32
	BlockSize int
	// LoRAID is deprecated in vLLM but still sent; nil when nil or absent.
	LoRAID *int64
	// Medium is "GPU" or "CPU"; "" when nil or absent (read as GPU).
	Medium string
	// LoRAName is the adapter the blocks were computed under (nil: the
	// base model): their router keys start from its seed
	// (blocks.AdapterSeed), as a request for that model's do.
	LoRAName *string
	// ExtraKeys is the raw msgpack value of extra_keys (per block: None or
	// a tuple of LoRA name, multimodal hashes, cache salt, prompt-embedding
	// hashes); nil when absent or nil. prefixlb reads only the cache salt
	// of a chain's first block (Salt), which seeds the chain's router keys
	// as a salted request's are (blocks.SaltedSeed); the rest of a key
	// comes from token ids. ExtraKeys builds it as vLLM does.
	ExtraKeys []byte
	// GroupIdx is the KV-cache group of hybrid models; nil when absent.
	GroupIdx                 *int64
	KVCacheSpecKind          *string
	KVCacheSpecSlidingWindow *int64
}

// Type implements Event.
func (BlockStored) Type() string { return TypeBlockStored }

// BlockRemoved says the engine evicted the blocks with these hashes from Medium.
type BlockRemoved struct {
	BlockHashes []uint64
	Medium      string
	GroupIdx    *int64
}

// Type implements Event.
func (BlockRemoved) Type() string { return TypeBlockRemoved }

// AllBlocksCleared says the engine's whole prefix cache is gone (vLLM's
// reset_prefix_cache).
type AllBlocksCleared struct{}

// Type implements Event.
func (AllBlocksCleared) Type() string { return TypeAllBlocksCleared }

// Batch is one published message: vLLM's KVEventBatch.
type Batch struct {
	// TS is the publisher's wall clock at publication, in seconds since the
	// Unix epoch (Python time.time()).
	TS     float64
	Events []Event
	// DataParallelRank is the publishing DP rank; nil when absent.
	DataParallelRank *int64
	// Unknown counts events of a type this package does not know; they are
	// skipped by the decoder, not returned in Events.
	Unknown int
}

// mediumName normalises a decoded medium: absent means GPU.
func mediumName(m string) string {
	if m == "" {
		return MediumGPU
	}
	return m
}
