package replica

import (
	"strconv"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// Kind says what an Event reports.
type Kind uint8

// Event kinds. Step returns them in the order they happen: first those dated
// at the start of the iteration (Admitted, KVPull, Preempted, BlocksRemoved), then
// those dated at its end (BlocksStored, FirstToken, Token, Finished).
const (
	// Admitted: the request left the waiting queue and its prefill was
	// scheduled. HitTokens holds the prompt tokens found in the prefix cache;
	// Resumed is true when it is re-admitted after a preemption. At is the
	// start of the iteration.
	Admitted Kind = iota + 1
	// FirstToken: the iteration that completed the prompt's prefill produced
	// output token 1 (N = 1). At is the end of that iteration.
	FirstToken
	// Token: output token N (N ≥ 2) was produced at At, the end of an
	// iteration. A request resumed after a preemption recomputes its prompt
	// and earlier output, then continues at Token N+1: tokens are never
	// reported twice.
	Token
	// Finished: the request produced its last token (N = OutputTokens) and
	// released its blocks. It follows that token's event, with the same At.
	Finished
	// Preempted: the replica ran out of KV blocks while growing a decode and
	// dropped this request's KV (vLLM's recompute preemption); it is waiting
	// again at the front of the queue. N is the tokens generated so far. At
	// is the start of the iteration.
	Preempted
	// Cancelled: Cancel aborted the request; N is the tokens generated so far.
	Cancelled
	// BlocksStored: Keys (a consecutive run of one prompt's chain, Parent the
	// key before it when HasParent) entered the prefix cache at At, the end of
	// the iteration that computed them.
	BlocksStored
	// BlocksRemoved: Keys were evicted from the prefix cache at At, the start
	// of the iteration that needed their space.
	BlocksRemoved
	// AllCleared: the prefix cache was emptied (ResetPrefixCache), like
	// vLLM's AllBlocksCleared KV event.
	AllCleared
	// KVPull: a remote request (Request.RemoteKV) was admitted and its
	// blocks reserved; N of its prompt blocks, those the replica does not
	// cache, must now come from the prefill replica. The caller reports
	// their arrival with KVArrived. At is the start of the iteration; it
	// follows the request's Admitted event.
	KVPull
	// AdapterLoaded: admitting request RequestID loaded LoRA adapter
	// Adapter into a GPU slot (Config.MaxLoras); the iteration that admits
	// it takes the load's time longer. At is the start of the iteration;
	// it precedes the request's Admitted event.
	AdapterLoaded
	// AdapterEvicted: Adapter left its GPU slot for another adapter's load
	// (the least recently used one no running request uses). At is the
	// start of the iteration; it precedes the AdapterLoaded event.
	AdapterEvicted
)

var kindNames = [...]string{
	Admitted:       "Admitted",
	FirstToken:     "FirstToken",
	Token:          "Token",
	Finished:       "Finished",
	Preempted:      "Preempted",
	Cancelled:      "Cancelled",
	BlocksStored:   "BlocksStored",
	BlocksRemoved:  "BlocksRemoved",
	AllCleared:     "AllCleared",
	KVPull:         "KVPull",
	AdapterLoaded:  "AdapterLoaded",
	AdapterEvicted: "AdapterEvicted",
}

// String returns the kind's name.
func (k Kind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// Event is something that happened on the replica. Which fields are set
// depends on Kind (see the Kind constants).
//
// Applying the BlocksStored, BlocksRemoved and AllCleared events in order to
// an empty set of keys gives exactly the replica's prefix cache after the
// call that returned them: the same information vLLM publishes as KV events
// (BlockStored, BlockRemoved, AllBlocksCleared). Events with a Medium apply
// to that tier's set instead (AllCleared empties every tier).
type Event struct {
	// Kind says what happened.
	Kind Kind
	// At is when it happened, on the caller's clock.
	At time.Time
	// RequestID is the request concerned (not set for cache events).
	RequestID uint64
	// HitTokens (Admitted) is the number of prompt tokens found in the prefix
	// cache and not recomputed: whole blocks, at most PromptTokens-1 (on a
	// resumed admission, prompt plus generated tokens minus 1), since the
	// engine always recomputes the last token to get its logits. As in vLLM
	// v1 the cap is block-aligned: a fully cached prompt whose length is a
	// multiple of the block size recomputes its whole last block. With a
	// slot cache (Config.Slots) it is the common prefix with the request's
	// slot, in whole blocks, capped at the prompt less one token as llama.cpp
	// caps it (so not always block-aligned), counted from where truncation
	// starts a long prompt.
	HitTokens int
	// TierTokens (Admitted) is the number of prompt tokens after HitTokens
	// loaded from the CPU offload tier instead of recomputed
	// (Config.CPUOffloadTokens; offload.go): the request waits for their
	// copy before it prefills the rest.
	TierTokens int
	// LoadEnd (Admitted, TierTokens > 0) is when the copy of those tokens
	// ends, after the copies queued before it on the replica's
	// host-to-device link: the request prefills from then on.
	LoadEnd time.Time
	// Resumed (Admitted) is true when the request was preempted before.
	Resumed bool
	// N (FirstToken, Token, Finished, Preempted, Cancelled) is the number of
	// output tokens generated so far; for KVPull, the blocks to pull.
	N int
	// Keys (BlocksStored, BlocksRemoved) are the block keys concerned. For
	// BlocksStored they alias the request's Keys slice; for BlocksRemoved the
	// slice is new. Do not modify them.
	Keys []blocks.Key
	// Parent (BlocksStored) is the key of the block before Keys[0], when
	// HasParent is true; otherwise Keys[0] is a prompt's first block.
	Parent blocks.Key
	// HasParent says whether Parent is set.
	HasParent bool
	// Medium (BlocksStored, BlocksRemoved) is the cache tier concerned:
	// "" for the GPU prefix cache, costmodel.MediumCPU for the CPU offload
	// tier (Config.CPUOffloadTokens), whose BlocksStored events have no
	// parent, as vLLM's OffloadingConnector publishes them.
	Medium string
	// Adapter (BlocksStored, AdapterLoaded, AdapterEvicted) is the LoRA
	// adapter concerned: the adapter of the request whose blocks were
	// stored ("" for the base model), as vLLM's BlockStored carries
	// lora_name.
	Adapter string
	// Salt (BlocksStored) is the cache salt of the request whose blocks
	// were stored ("" for none), as vLLM's BlockStored carries it in the
	// extra keys of a prompt's first block (kvevents.ExtraKeys).
	Salt string
}
