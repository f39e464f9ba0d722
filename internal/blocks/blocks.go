// Package blocks turns a prompt into the chain of block keys that prefixlb's
// prefix tree, policies and replica model all speak.
//
// Inference engines cache KV in fixed-size blocks of B tokens (vLLM's
// --block-size, 16 by default) and reuse a block only when every token before it
// is the same. A block is therefore identified by its own tokens and by the
// identity of the block before it: key_i = H(key_{i-1}, tokens of block i).
// Two prompts share their first n keys exactly when they share their first n·B
// tokens. Only full blocks are keyed: engines never cache a partial block.
//
// The hash is xxHash64 (github.com/cespare/xxhash/v2) over the parent key and the
// block's token ids, both little-endian. It is prefixlb's own key, not vLLM's
// block hash: KV events are mapped onto these keys from the token ids they carry.
//
// A chain starts from a Seed: the base model's, or a LoRA adapter's. vLLM folds
// the adapter into every block's hash (the extra keys of
// vllm/v1/core/kv_cache_utils.py's generate_block_hash_extra_keys: the request's
// lora_name), so the same tokens under two adapters, or under an adapter and the
// base model, are different blocks that never share KV; chains from different
// seeds never share a key either.
//
// A chain may also be salted (SaltedSeed, ChainSeed): vLLM's cache_salt, a
// request body field, is folded into the extra keys of a prompt's first
// block only (generate_block_hash_extra_keys: "[request.cache_salt] if
// (start_token_idx == 0 and request.cache_salt)"; every later block carries
// it through its parent's hash), so the same tokens under two salts never
// share a block and a salted prefix is never served to another salt
// (vllm-project/vllm vllm/v1/core/kv_cache_utils.py at
// 001cabc1be16a59a70d720ed61a13b678c060a18). prefixlb folds the salt into
// the chain's seed, which is the same thing for its keys: every key of a
// salted chain differs from the unsalted chain's and from every other
// salt's.
package blocks

import (
	"encoding/binary"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// Key identifies one full block of tokens together with everything before it.
type Key uint64

// DefaultBlockSize is vLLM's default KV block size in tokens.
const DefaultBlockSize = 16

// DefaultChunkBytes is the size of a text chunk keyed by TextKeys: about one
// 16-token block of English text at ~4 bytes per token.
const DefaultChunkBytes = 64

// rootSeed starts every chain so that an empty parent differs from a key of 0.
const rootSeed uint64 = 0x9e3779b97f4a7c15

// Seed is where a chain of keys starts: the base model's (BaseSeed) or a
// LoRA adapter's (AdapterSeed).
type Seed uint64

// BaseSeed starts the chains of the base model's requests.
const BaseSeed = Seed(rootSeed)

// AdapterSeed is the seed of LoRA adapter's chains (BaseSeed for "", the
// base model): a hash of its name, as vLLM hashes the lora_name into each
// block. The same function seeds a request's keys and the keys of the KV
// events the adapter's blocks produce.
func AdapterSeed(adapter string) Seed {
	if adapter == "" {
		return BaseSeed
	}
	s := Seed(xxhash.Sum64String("prefixlb/lora\x00" + adapter))
	if s == BaseSeed {
		s++
	}
	return s
}

// SaltedSeed is the seed of the chains of requests salted with salt (vLLM's
// cache_salt) whose unsalted chains start from seed: seed itself for ""
// (no salt: every key is unchanged), else a hash of seed and salt. Two
// different salts, or a salt and none, never give the same seed (but by a
// 64-bit collision), so their chains never share a key. The same function
// seeds a request's keys (serve, epp, sim, engine) and the keys of the KV
// events its blocks produce (kvevents reads the salt from the first
// block's extra_keys).
func SaltedSeed(seed Seed, salt string) Seed {
	if salt == "" {
		return seed
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString("prefixlb/salt\x00")
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(seed))
	_, _ = d.Write(b[:])
	_, _ = d.WriteString(salt)
	s := Seed(d.Sum64())
	if s == seed || s == BaseSeed {
		s++
	}
	return s
}

// ChainSeed is the seed of a request's chain: its LoRA adapter's
// (AdapterSeed; "" for the base model) salted with its cache salt
// (SaltedSeed; "" for none). ChainSeed("", "") is BaseSeed.
func ChainSeed(adapter, salt string) Seed {
	return SaltedSeed(AdapterSeed(adapter), salt)
}

// Keys appends to dst one key per full block of blockSize tokens and returns the
// extended slice, the chain starting from BaseSeed when dst is empty. The
// trailing partial block is not keyed. It panics if blockSize < 1, a
// programming error rather than bad input.
func Keys(dst []Key, tokens []uint32, blockSize int) []Key {
	return SeededKeys(dst, BaseSeed, tokens, blockSize)
}

// SeededKeys is Keys for a chain that starts from seed (when dst is empty;
// otherwise from dst's last key, which carries its own seed).
func SeededKeys(dst []Key, seed Seed, tokens []uint32, blockSize int) []Key {
	if blockSize < 1 {
		panic("blocks: block size must be positive")
	}
	n := len(tokens) / blockSize
	if cap(dst)-len(dst) < n {
		grown := make([]Key, len(dst), len(dst)+n)
		copy(grown, dst)
		dst = grown
	}
	parent := uint64(seed)
	if len(dst) > 0 {
		parent = uint64(dst[len(dst)-1])
	}
	var buf [8 + 4*64]byte
	var d xxhash.Digest
	for i := 0; i < n; i++ {
		blk := tokens[i*blockSize : (i+1)*blockSize]
		d.Reset()
		binary.LittleEndian.PutUint64(buf[:8], parent)
		off := 8
		for _, t := range blk {
			if off+4 > len(buf) {
				_, _ = d.Write(buf[:off])
				off = 0
			}
			binary.LittleEndian.PutUint32(buf[off:], t)
			off += 4
		}
		_, _ = d.Write(buf[:off])
		parent = d.Sum64()
		dst = append(dst, Key(parent))
	}
	return dst
}

// Chain extends a chain by one block: the key of block tokens whose parent key
// is parent (ok=false for the first block of a prompt). It agrees with Keys.
func Chain(parent Key, hasParent bool, block []uint32) Key {
	var prev []Key
	if hasParent {
		prev = []Key{parent}
	}
	return Keys(prev, block, len(block))[len(prev)]
}

// TextKeys keys a prompt given as text when no tokenizer is configured: one key
// per full chunk of about chunkBytes bytes, chained like Keys. Chunks end on a
// UTF-8 rune boundary so the same text always cuts the same way. Text-chunk keys
// only agree with other text-chunk keys: they stand in for token blocks when the
// router cannot tokenize exactly (the trailing partial chunk is not keyed, like a
// partial block). TokensPerChunk estimates the tokens each key stands for.
func TextKeys(dst []Key, text string, chunkBytes int) []Key {
	return SeededTextKeys(dst, BaseSeed, text, chunkBytes)
}

// SeededTextKeys is TextKeys for a chain that starts from seed (when dst is
// empty).
func SeededTextKeys(dst []Key, seed Seed, text string, chunkBytes int) []Key {
	if chunkBytes < 1 {
		panic("blocks: chunk size must be positive")
	}
	parent := uint64(seed)
	if len(dst) > 0 {
		parent = uint64(dst[len(dst)-1])
	}
	var pb [8]byte
	var d xxhash.Digest
	for len(text) >= chunkBytes {
		end := chunkBytes
		for end < len(text) && !utf8.RuneStart(text[end]) {
			end++
		}
		d.Reset()
		binary.LittleEndian.PutUint64(pb[:], parent)
		_, _ = d.Write(pb[:])
		_, _ = d.WriteString(text[:end])
		parent = d.Sum64()
		dst = append(dst, Key(parent))
		text = text[end:]
	}
	return dst
}

// TokensPerChunk is the token count prefixlb assumes per text chunk when it keys
// text without a tokenizer: chunkBytes/4, the usual bytes-per-token of BPE
// tokenizers on English text, and at least 1.
func TokensPerChunk(chunkBytes int) int {
	if chunkBytes < 8 {
		return 1
	}
	return chunkBytes / 4
}
