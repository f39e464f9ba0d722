package workload

import (
	"math/rand/v2"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// Synthetic token ids are drawn from [VocabLow, VocabHigh): above the ids
// tokenizers reserve for special tokens and below the vocabulary size of current
// models (Qwen3 has 151,643 regular tokens). With ~150k values, two unrelated
// prompts agree on a whole 16-token block with probability ~1e-83: unrelated
// prompts never share a block, and shared prefixes share their ids exactly.
const (
	VocabLow  = 100
	VocabHigh = 150000
)

const vocabSpan = VocabHigh - VocabLow

// tokenSource draws synthetic token ids from a seeded generator.
type tokenSource struct {
	r *rand.Rand
}

// fill writes random token ids into dst, two ids per 64-bit draw.
func (t *tokenSource) fill(dst []uint32) {
	i := 0
	for ; i+1 < len(dst); i += 2 {
		v := t.r.Uint64()
		dst[i] = VocabLow + uint32((v&0xffffffff)%vocabSpan)
		dst[i+1] = VocabLow + uint32((v>>32)%vocabSpan)
	}
	if i < len(dst) {
		dst[i] = VocabLow + uint32(t.r.Uint64()%vocabSpan)
	}
}

// tokens returns n fresh random token ids in a slice of exactly n capacity.
func (t *tokenSource) tokens(n int) []uint32 {
	s := make([]uint32, n)
	t.fill(s)
	return s
}

// arena appends to token slices without copying when it is safe. Prompts that
// grow (an agent re-sending its conversation) are each a prefix of the next, so
// every step can share one backing array: extending a slice in place is safe
// only when nothing was written after its end, which arena tracks per backing
// array (keyed by the address of its first element). Not safe for concurrent use.
type arena struct {
	high map[*uint32]int // backing array → number of elements written
}

func newArena() *arena { return &arena{high: make(map[*uint32]int)} }

// extend returns prefix followed by n new elements for the caller to fill
// (the returned slice's last n elements). It reuses prefix's backing array when
// prefix ends at the array's high-water mark and has room; otherwise it copies
// prefix into a new array of capacity at least capHint.
func (a *arena) extend(prefix []uint32, n, capHint int) []uint32 {
	need := len(prefix) + n
	if len(prefix) > 0 && cap(prefix) >= need {
		key := &prefix[:1][0]
		if a.high[key] == len(prefix) {
			a.high[key] = need
			return prefix[:need]
		}
	}
	c := max(capHint, need)
	s := make([]uint32, need, c)
	copy(s, prefix)
	if need > 0 {
		a.high[&s[0]] = need
	}
	return s
}

// WordTokens turns text into token ids with prefixlb's stand-in tokenizer for
// traces given as text (the `jsonl` format's "text" field): the text is split on
// Unicode white space (strings.Fields) and each word becomes one id,
// VocabLow + xxHash64(word) mod (VocabHigh-VocabLow). It is deterministic and
// prefix-preserving (texts that share their first n words share their first n
// ids) but it is not a real tokenizer: counts are words, not BPE tokens.
func WordTokens(text string) []uint32 {
	words := strings.Fields(text)
	out := make([]uint32, len(words))
	for i, w := range words {
		out[i] = VocabLow + uint32(xxhash.Sum64String(w)%vocabSpan)
	}
	return out
}

// BlockToken is token j of the block whose trace id is id: the deterministic
// expansion of a Mooncake-style hash id (one id per block of tokens) into token
// ids, so that two requests share tokens exactly as far as their leading block
// ids agree. salt separates id spaces (0 for the trace's own ids).
func BlockToken(id uint64, j int, salt uint64) uint32 {
	return VocabLow + uint32(splitmix64(id*0x100000001b3^uint64(j)*0x9e3779b97f4a7c15^salt)%vocabSpan)
}

// splitmix64 is Steele, Lea and Flood's SplitMix64 finalizer: a cheap bijective
// mixer good enough to make block ids into unrelated-looking token ids.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// newRand returns the generator for one seed and stream. Streams keep the draws
// of independent parts of a workload (prompt text, selection, lengths) apart, so
// changing one parameter does not reshuffle everything else.
func newRand(seed int64, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), stream*0x9e3779b97f4a7c15+1))
}

// uniformInt draws an integer uniformly from [lo, hi] (lo when hi <= lo).
func uniformInt(r *rand.Rand, lo, hi int) int {
	if hi <= lo {
		return lo
	}
	return lo + r.IntN(hi-lo+1)
}
