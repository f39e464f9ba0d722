package keying

import (
	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/openai"
)

// Keyer turns a parsed request into the router's block keys and an estimate
// of its prompt length in tokens. Text-chunk keying stands in until
// token-exact tokenization lands; a tokenizer will implement the same
// interface. Implementations must be safe for concurrent use.
type Keyer interface {
	// Keys returns the keys of the request's (first) prompt and the prompt
	// tokens of the whole request (every prompt of a batch), ≥ 1 and ≥
	// len(keys)·block size.
	Keys(r *openai.Request) (keys []blocks.Key, promptTokens int, err error)
}

// ChunkKeyer keys text by chunks of 4·BlockTokens bytes (blocks.TextKeys)
// and token ids by blocks of BlockTokens (blocks.Keys), so that one key
// stands for BlockTokens tokens either way, as the router requires.
type ChunkKeyer struct {
	// BlockTokens is the tokens per key (the router's block size).
	BlockTokens int
}

var _ Keyer = ChunkKeyer{}

// ChunkBytes is the text chunk size: blocks.TokensPerChunk of it is
// BlockTokens (about 4 bytes per token of English text).
func (k ChunkKeyer) ChunkBytes() int { return 4 * k.BlockTokens }

// Keys implements Keyer. A batch is keyed by its first prompt (the one the
// engine schedules first); its prompt tokens count every prompt. A LoRA
// adapter's request (Request.Adapter) is keyed from the adapter's seed,
// and a salted one (Request.CacheSalt) from that seed salted
// (blocks.ChainSeed), text chunks as token blocks. A request with text
// is marked Request.TokensEstimated.
func (k ChunkKeyer) Keys(r *openai.Request) ([]blocks.Key, int, error) {
	var keys []blocks.Key
	total := 0
	seed := blocks.ChainSeed(r.Adapter, r.CacheSalt)
	for i, text := range r.Texts {
		if i == 0 {
			keys = blocks.SeededTextKeys(nil, seed, text, k.ChunkBytes())
		}
		total += (len(text) + 3) / 4
	}
	r.TokensEstimated = len(r.Texts) > 0
	for i, ids := range r.TokenIDs {
		if i == 0 && len(keys) == 0 {
			keys = blocks.SeededKeys(nil, seed, ids, k.BlockTokens)
		}
		total += len(ids)
	}
	total = max(total, len(keys)*k.BlockTokens, 1)
	return keys, total, nil
}
