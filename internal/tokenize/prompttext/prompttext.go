// Package prompttext renders a workload's token ids as text that a real
// tokenizer encodes back to exactly as many tokens, so that a load generator
// sending text (or chats) asks the engine for the prefill the workload names.
//
// A Renderer holds a vocabulary of whole-word tokens: strings " word" (one
// space, then ASCII letters) that the tokenizer encodes, alone, to exactly
// one id. Each workload token id becomes one such word, chosen by a hash of
// the id, so equal ids give equal words and a prompt's text is the
// concatenation of its ids' words. Byte-level BPE tokenizers (GPT-2, Qwen2
// and Qwen3, Llama 3, cl100k) pre-tokenize with a regex whose
// ` ?\p{L}+`-style alternative makes every " word" a piece of its own, and
// BPE never merges across pieces, so
//
//   - encode(render(ids)) has exactly len(ids) tokens, and
//   - two prompts that share their first n ids share a text prefix,
//     render(ids[:n]), that encodes to the same n tokens: no merge crosses
//     the join, because the next word starts a new piece with its space.
//
// The first word keeps its space too, so a prompt never starts with a word
// the tokenizer would see differently at the start of the text. These
// properties are a consequence of the pre-tokenizer, so they are checked,
// not assumed: [FromTokenizer] keeps only words that round-trip, and
// [Renderer.Check] encodes sample prompts and compares their lengths.
package prompttext

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"unsafe"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// MinWords is the smallest vocabulary a Renderer accepts: with fewer words,
// two different ids too often render as the same word, and prompts the
// workload says differ would share text.
const MinWords = 256

// ErrVocabulary is wrapped by the errors about a vocabulary that is too
// small or holds a word that is not " " followed by ASCII letters.
var ErrVocabulary = errors.New("prompttext: vocabulary")

// ErrMismatch is wrapped by Check's error when a rendered prompt does not
// encode to its workload's length.
var ErrMismatch = errors.New("prompttext: rendered prompt does not encode to its length")

// MaxWordLen is the longest word a vocabulary may hold, in bytes with its
// space: each word lives in a 16-byte slot with its length in the last
// byte, so rendering a token is one aligned load and one 16-byte copy.
const MaxWordLen = slot - 1

// slot is the bytes a word takes in a Renderer's table.
const slot = 16

// Renderer renders token ids as words. It is immutable after New and safe
// for concurrent use.
type Renderer struct {
	// table holds word i in table[i][:table[i][slot-1]], its length in
	// the slot's last byte.
	table [][slot]byte
	// bytes is the length of all the words together.
	bytes int
}

// New returns a Renderer over words, each a space followed by one or more
// ASCII letters (" word"). It does not check that a tokenizer encodes them
// as one token each: FromTokenizer does, and Check does for any tokenizer.
func New(words []string) (*Renderer, error) {
	if len(words) < MinWords {
		return nil, fmt.Errorf("%w: %d words, want ≥ %d", ErrVocabulary, len(words), MinWords)
	}
	r := &Renderer{table: make([][slot]byte, len(words))}
	for i, w := range words {
		if !isWord(w) {
			return nil, fmt.Errorf("%w: %q is not a space and ASCII letters", ErrVocabulary, w)
		}
		if len(w) > MaxWordLen {
			return nil, fmt.Errorf("%w: %q is longer than %d bytes", ErrVocabulary, w, MaxWordLen)
		}
		copy(r.table[i][:], w)
		r.table[i][slot-1] = byte(len(w))
		r.bytes += len(w)
	}
	return r, nil
}

// isWord reports whether w is " " followed by one or more ASCII letters.
func isWord(w string) bool {
	if len(w) < 2 || w[0] != ' ' {
		return false
	}
	for i := 1; i < len(w); i++ {
		if c := w[i] | 0x20; c < 'a' || c > 'z' {
			return false
		}
	}
	return true
}

// Words returns the number of words in the vocabulary.
func (r *Renderer) Words() int { return len(r.table) }

// Word returns the word that token id id renders as.
func (r *Renderer) Word(id uint32) string {
	w := &r.table[r.index(id)]
	return string(w[:w[slot-1]])
}

// index maps a token id to a word: a multiplicative hash (Knuth's, with
// the 32-bit golden ratio) scrambles ids that share low bits, then the
// product, taken as a fraction of 2³², is scaled to the vocabulary
// (Lemire's multiply-shift instead of a division).
func (r *Renderer) index(id uint32) int {
	h := id * 0x9E3779B1
	h ^= h >> 15
	return int(uint64(h) * uint64(len(r.table)) >> 32)
}

// Append appends the text of ids to dst and returns it. It makes room for
// the longest words (MaxWordLen bytes a token) before it starts.
func (r *Renderer) Append(dst []byte, ids []uint32) []byte {
	n := len(dst)
	dst = slices.Grow(dst, len(ids)*slot)
	return dst[:n+r.fill(dst[n:n+len(ids)*slot], ids)]
}

// fill writes the text of ids at the start of buf and returns its length.
// Each word is written as its whole slot, so buf must hold slot−1 bytes
// beyond the text's end (len(ids)*slot always does).
func (r *Renderer) fill(buf []byte, ids []uint32) int {
	n := 0
	for _, id := range ids {
		w := &r.table[r.index(id)]
		*(*[slot]byte)(buf[n:]) = *w
		n += int(w[slot-1])
	}
	return n
}

// Len returns the length in bytes of the text of ids.
func (r *Renderer) Len(ids []uint32) int {
	n := 0
	for _, id := range ids {
		n += int(r.table[r.index(id)][slot-1])
	}
	return n
}

// Render returns the text of ids. It measures the text first (Len), so
// that the string is allocated once at its size.
func (r *Renderer) Render(ids []uint32) string {
	if len(ids) == 0 {
		return ""
	}
	buf := make([]byte, r.Len(ids)+slot)
	n := r.fill(buf, ids)
	// buf is never written again: the string may share its bytes, as
	// strings.Builder's does.
	return unsafe.String(unsafe.SliceData(buf), n)
}

// Counter returns how many tokens the target's tokenizer makes of text.
type Counter func(text string) (int, error)

// Check renders samples random prompts (lengths 1 to maxLen tokens, ids
// below 1<<20, drawn from seed) and returns an error wrapping ErrMismatch
// naming the first whose count differs from its length. Each prompt is
// counted with and without its last half, so a merge across the join of
// two prompts sharing a prefix would show too.
func (r *Renderer) Check(count Counter, seed uint64, samples, maxLen int) error {
	rng := rand.New(rand.NewPCG(seed, 0x70726f6d7074))
	ids := make([]uint32, 0, maxLen)
	for s := range samples {
		n := 1 + rng.IntN(max(maxLen, 1))
		ids = ids[:0]
		for range n {
			ids = append(ids, rng.Uint32N(1<<20))
		}
		for _, k := range []int{n, (n + 1) / 2} {
			got, err := count(r.Render(ids[:k]))
			if err != nil {
				return fmt.Errorf("prompttext: check sample %d: %w", s, err)
			}
			if got != k {
				return fmt.Errorf("%w: sample %d of %d ids encodes to %d tokens", ErrMismatch, s, k, got)
			}
		}
	}
	return nil
}

// TokenizerWords returns tok's whole-word tokens in id order: the
// vocabulary entries " word" (a space and 1 to MaxWordLen-1 ASCII
// letters) that tok encodes to their own id alone, and twice repeated
// to that id twice.
func TokenizerWords(tok *tokenize.Tokenizer) []string {
	var words []string
	for id := range tok.VocabSize() {
		w := tok.Decode([]uint32{uint32(id)})
		if len(w) > MaxWordLen || !isWord(w) {
			continue
		}
		if got := tok.Encode(w + w); len(got) != 2 || got[0] != uint32(id) || got[1] != uint32(id) {
			continue
		}
		if got := tok.Encode(w); len(got) != 1 || got[0] != uint32(id) {
			continue
		}
		words = append(words, w)
	}
	return words
}

// FromTokenizer returns a Renderer over tok's whole-word tokens
// (TokenizerWords), checked with 64 sample prompts of up to 512 tokens
// (Check). It takes about as long as encoding the vocabulary once.
func FromTokenizer(tok *tokenize.Tokenizer) (*Renderer, error) {
	r, err := New(TokenizerWords(tok))
	if err != nil {
		return nil, err
	}
	count := func(text string) (int, error) { return len(tok.Encode(text)), nil }
	if err := r.Check(count, 1, 64, 512); err != nil {
		return nil, err
	}
	return r, nil
}

// renderers holds the Renderer of each tokenizer built in this process
// (*tokenize.Tokenizer → *Renderer), so that runs over the same tokenizer
// (the bundled Qwen3 is shared) build it once.
var renderers sync.Map

// Shared returns tok's Renderer (FromTokenizer), built on first use and
// kept for the process.
func Shared(tok *tokenize.Tokenizer) (*Renderer, error) {
	if r, ok := renderers.Load(tok); ok {
		return r.(*Renderer), nil
	}
	r, err := FromTokenizer(tok)
	if err != nil {
		return nil, err
	}
	v, _ := renderers.LoadOrStore(tok, r)
	return v.(*Renderer), nil
}
