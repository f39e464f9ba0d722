package prompttext

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	tiktokenloader "github.com/pkoukk/tiktoken-go-loader"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// tokenizers are the tokenizers the properties are checked under: the
// bundled Qwen3 and cl100k_base as a Llama-3-style tokenizer.json (built
// from tiktoken's ranks, as internal/tokenize's cl100k tests do), whose
// pre-tokenizer regex differs from Qwen's (letters after a non-letter,
// digits in threes).
func tokenizers(t *testing.T) map[string]*tokenize.Tokenizer {
	t.Helper()
	q, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	c, err := cl100k()
	if err != nil {
		t.Fatal(err)
	}
	return map[string]*tokenize.Tokenizer{"qwen3": q, "cl100k": c}
}

var cl100k = sync.OnceValues(func() (*tokenize.Tokenizer, error) {
	ranks, err := tiktokenloader.NewOfflineLoader().LoadTiktokenBpe("cl100k_base.tiktoken")
	if err != nil {
		return nil, fmt.Errorf("load cl100k_base ranks: %w", err)
	}
	return tokenize.New(cl100kJSON(ranks), nil)
})

// cl100kPattern is tiktoken's cl100k_base regex (also Llama 3's).
const cl100kPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

// cl100kJSON writes cl100k_base as a byte-level BPE tokenizer.json with
// ignore_merges and the merges of transformers' TikTokenConverter (every
// split of a token into two tokens, in the token's rank order).
func cl100kJSON(ranks map[string]int) []byte {
	byRank := make([]string, len(ranks))
	for tok, r := range ranks {
		byRank[r] = tok
	}
	// byteRune is GPT-2's byte-to-printable-rune table.
	var byteRune [256]rune
	n := 0
	for b := range 256 {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			byteRune[b] = rune(b)
		} else {
			byteRune[b] = rune(256 + n)
			n++
		}
	}
	enc := func(raw string) string {
		var b strings.Builder
		for i := 0; i < len(raw); i++ {
			b.WriteRune(byteRune[raw[i]])
		}
		return b.String()
	}
	vocab := make(map[string]int, len(byRank))
	var merges []string
	for r, tok := range byRank {
		vocab[enc(tok)] = r
		type split struct{ l, r int }
		var local []split
		for i := 1; i < len(tok); i++ {
			l, okL := ranks[tok[:i]]
			rr, okR := ranks[tok[i:]]
			if okL && okR {
				local = append(local, split{l, rr})
			}
		}
		slices.SortFunc(local, func(a, b split) int {
			if a.l != b.l {
				return a.l - b.l
			}
			return a.r - b.r
		})
		for _, sp := range local {
			merges = append(merges, enc(byRank[sp.l])+" "+enc(byRank[sp.r]))
		}
	}
	js, err := json.Marshal(map[string]any{
		"version": "1.0", "added_tokens": []any{}, "normalizer": nil,
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]string{"Regex": cl100kPattern}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
		}},
		"decoder": map[string]any{"type": "ByteLevel"},
		"model": map[string]any{"type": "BPE", "ignore_merges": true, "byte_fallback": false,
			"vocab": vocab, "merges": merges},
	})
	if err != nil {
		panic(err)
	}
	return js
}

// randomIDs returns n ids below 1<<20.
func randomIDs(rng *rand.Rand, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = rng.Uint32N(1 << 20)
	}
	return ids
}

// TestRenderExact is the property the load generator relies on, over
// thousands of random prompts under each tokenizer: a rendered prompt
// encodes to exactly one token per id, each id's word's own token, so its
// length is exact and a prompt that shares n ids with another shares a
// text prefix encoding to the same n tokens.
func TestRenderExact(t *testing.T) {
	for name, tok := range tokenizers(t) {
		t.Run(name, func(t *testing.T) {
			r, err := FromTokenizer(tok)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d whole-word tokens", r.Words())
			wordID := func(id uint32) uint32 {
				got := tok.Encode(r.Word(id))
				if len(got) != 1 {
					t.Fatalf("word %q of id %d encodes to %v", r.Word(id), id, got)
				}
				return got[0]
			}
			rng := rand.New(rand.NewPCG(7, uint64(len(name))))
			prompts := 2000
			if testing.Short() {
				prompts = 300
			}
			for p := range prompts {
				a := randomIDs(rng, 1+rng.IntN(256))
				// b shares a's first n ids, then goes its own way.
				n := rng.IntN(len(a) + 1)
				b := append(slices.Clip(a[:n]), randomIDs(rng, rng.IntN(128))...)
				encA, encB := tok.Encode(r.Render(a)), tok.Encode(r.Render(b))
				if len(encA) != len(a) || len(encB) != len(b) {
					t.Fatalf("prompt %d: %d and %d ids encode to %d and %d tokens", p, len(a), len(b), len(encA), len(encB))
				}
				prefix := tok.Encode(r.Render(a[:n]))
				if !slices.Equal(prefix, encA[:n]) || !slices.Equal(prefix, encB[:n]) {
					t.Fatalf("prompt %d: the shared %d-id prefix encodes to %v, a to %v…, b to %v…", p, n, prefix, encA[:n], encB[:n])
				}
				if p%100 == 0 {
					for i, id := range a {
						if w := wordID(id); encA[i] != w {
							t.Fatalf("prompt %d: token %d is %d, want %d (the word %q)", p, i, encA[i], w, r.Word(id))
						}
					}
				}
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	words := make([]string, MinWords)
	for i := range words {
		words[i] = " w" + strings.Repeat("a", i%5+1)
	}
	tests := []struct {
		name  string
		words []string
	}{
		{"too few", words[:MinWords-1]},
		{"no space", append(slices.Clone(words[1:]), "word")},
		{"digit", append(slices.Clone(words[1:]), " t12")},
		{"two spaces", append(slices.Clone(words[1:]), "  word")},
		{"space only", append(slices.Clone(words[1:]), " ")},
	}
	for _, tt := range tests {
		if _, err := New(tt.words); !errors.Is(err, ErrVocabulary) {
			t.Errorf("%s: New error = %v, want ErrVocabulary", tt.name, err)
		}
	}
	if _, err := New(words); err != nil {
		t.Errorf("New(valid words): %v", err)
	}
}

func TestRenderDeterministic(t *testing.T) {
	words := make([]string, MinWords)
	for i := range words {
		words[i] = " w" + strconv.Itoa(i) // not valid: check New catches digits
	}
	if _, err := New(words); err == nil {
		t.Fatal("New accepted words with digits")
	}
	for i := range words {
		words[i] = " " + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	r, err := New(words)
	if err != nil {
		t.Fatal(err)
	}
	ids := []uint32{0, 1, 2, 1 << 31, 7, 7}
	got := r.Render(ids)
	if got != r.Render(ids) {
		t.Fatal("Render is not deterministic")
	}
	var want strings.Builder
	for _, id := range ids {
		want.WriteString(r.Word(id))
	}
	if got != want.String() {
		t.Errorf("Render = %q, want the words %q", got, want.String())
	}
	if r.Render(nil) != "" {
		t.Errorf("Render(nil) = %q, want empty", r.Render(nil))
	}
	// The hash spreads consecutive ids over the vocabulary.
	seen := map[string]bool{}
	for id := range uint32(MinWords) {
		seen[r.Word(id)] = true
	}
	if len(seen) < MinWords/2 {
		t.Errorf("%d consecutive ids render as %d distinct words, want ≥ %d", MinWords, len(seen), MinWords/2)
	}
}

// TestCheckCatchesMerges: a vocabulary whose words a tokenizer splits
// fails Check with ErrMismatch.
func TestCheckCatchesMerges(t *testing.T) {
	tok, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	words := make([]string, MinWords)
	for i := range words {
		words[i] = " zqxj" + string(rune('a'+i%26)) + string(rune('a'+i/26%26)) // rare letter runs: several tokens each
	}
	r, err := New(words)
	if err != nil {
		t.Fatal(err)
	}
	count := func(text string) (int, error) { return len(tok.Encode(text)), nil }
	if err := r.Check(count, 1, 4, 50); !errors.Is(err, ErrMismatch) {
		t.Errorf("Check = %v, want ErrMismatch", err)
	}
	boom := errors.New("boom")
	if err := r.Check(func(string) (int, error) { return 0, boom }, 1, 4, 50); !errors.Is(err, boom) {
		t.Errorf("Check with a failing counter = %v, want it wrapped", err)
	}
}
