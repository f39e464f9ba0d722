package blocks

import (
	"encoding/binary"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// refKey is the documented key, computed the obvious way: xxHash64 over the
// parent key and the block's tokens, little-endian.
func refKey(parent uint64, block []uint32) Key {
	buf := binary.LittleEndian.AppendUint64(nil, parent)
	for _, t := range block {
		buf = binary.LittleEndian.AppendUint32(buf, t)
	}
	return Key(xxhash.Sum64(buf))
}

func seq(n int, start uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = start + uint32(i)*2654435761
	}
	return t
}

func TestKeysMatchesReference(t *testing.T) {
	for _, bs := range []int{1, 2, 16, 62, 63, 64, 65, 100, 129} {
		toks := seq(3*bs+bs/2, 7)
		got := Keys(nil, toks, bs)
		if len(got) != 3 {
			t.Fatalf("bs=%d: %d keys, want 3 (the partial block is not keyed)", bs, len(got))
		}
		parent := rootSeed
		for i := range got {
			want := refKey(parent, toks[i*bs:(i+1)*bs])
			if got[i] != want {
				t.Errorf("bs=%d key %d = %x, want %x", bs, i, got[i], want)
			}
			parent = uint64(want)
		}
	}
}

func TestKeysPartialBlock(t *testing.T) {
	tests := []struct {
		tokens, bs, want int
	}{
		{0, 16, 0},
		{15, 16, 0},
		{16, 16, 1},
		{31, 16, 1},
		{32, 16, 2},
		{5, 1, 5},
	}
	for _, tt := range tests {
		if got := len(Keys(nil, seq(tt.tokens, 1), tt.bs)); got != tt.want {
			t.Errorf("Keys(%d tokens, bs=%d): %d keys, want %d", tt.tokens, tt.bs, got, tt.want)
		}
	}
}

// TestKeysChainProperty: two prompts share their first n keys exactly when
// they share their first n full blocks of tokens.
func TestKeysChainProperty(t *testing.T) {
	const bs = 4
	base := seq(40, 3)
	for diverge := 0; diverge < len(base); diverge++ {
		other := append([]uint32(nil), base...)
		other[diverge]++
		a, b := Keys(nil, base, bs), Keys(nil, other, bs)
		shared := 0
		for shared < len(a) && shared < len(b) && a[shared] == b[shared] {
			shared++
		}
		if want := diverge / bs; shared != want {
			t.Errorf("prompts differing at token %d share %d keys, want %d", diverge, shared, want)
		}
		for i := shared; i < len(a); i++ {
			if a[i] == b[i] {
				t.Errorf("diverge %d: key %d equal after the divergence", diverge, i)
			}
		}
	}
	// A prefix of a prompt keys to a prefix of its keys.
	full := Keys(nil, base, bs)
	for n := 0; n <= len(base); n++ {
		p := Keys(nil, base[:n], bs)
		for i := range p {
			if p[i] != full[i] {
				t.Fatalf("prefix of %d tokens: key %d differs", n, i)
			}
		}
	}
	// The same block at another position keys differently (the chain).
	rep := append(append([]uint32(nil), base[:bs]...), base[:bs]...)
	k := Keys(nil, rep, bs)
	if k[0] == k[1] {
		t.Error("a repeated block has the same key at positions 0 and 1")
	}
}

func TestKeysAppendsAndContinuesChain(t *testing.T) {
	const bs = 16
	toks := seq(5*bs, 11)
	whole := Keys(nil, toks, bs)
	head := Keys(nil, toks[:2*bs], bs)
	got := Keys(head, toks[2*bs:], bs)
	if len(got) != len(whole) {
		t.Fatalf("continued chain has %d keys, want %d", len(got), len(whole))
	}
	for i := range whole {
		if got[i] != whole[i] {
			t.Errorf("key %d = %x, want %x", i, got[i], whole[i])
		}
	}
	// With spare capacity, Keys appends in place.
	dst := make([]Key, 0, 10)
	out := Keys(dst, toks, bs)
	if &out[0] != &dst[:1][0] {
		t.Error("Keys reallocated a slice with enough capacity")
	}
}

func TestChainAgreesWithKeys(t *testing.T) {
	for _, bs := range []int{1, 16, 100} {
		toks := seq(4*bs, 5)
		keys := Keys(nil, toks, bs)
		for i := range keys {
			var parent Key
			if i > 0 {
				parent = keys[i-1]
			}
			if got := Chain(parent, i > 0, toks[i*bs:(i+1)*bs]); got != keys[i] {
				t.Errorf("bs=%d: Chain for block %d = %x, want %x", bs, i, got, keys[i])
			}
		}
	}
}

func TestKeysPanicsOnBadBlockSize(t *testing.T) {
	for _, f := range []func(){
		func() { Keys(nil, seq(4, 1), 0) },
		func() { TextKeys(nil, "abc", 0) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Error("no panic for a block size of 0")
				}
			}()
			f()
		}()
	}
}

// textChunks cuts text the way TextKeys documents: chunkBytes bytes, pushed
// forward to the next rune start; the tail shorter than chunkBytes is dropped.
func textChunks(text string, chunkBytes int) []string {
	var out []string
	for len(text) >= chunkBytes {
		end := chunkBytes
		for end < len(text) && !utf8.RuneStart(text[end]) {
			end++
		}
		out = append(out, text[:end])
		text = text[end:]
	}
	return out
}

func TestTextKeys(t *testing.T) {
	tests := []struct {
		name       string
		text       string
		chunkBytes int
		wantChunks []string
	}{
		{"ascii", "abcdefgh", 3, []string{"abc", "def"}},
		{"exact", "abcdef", 3, []string{"abc", "def"}},
		{"short", "ab", 3, nil},
		{"two-byte runes", "éééé", 3, []string{"éé", "éé"}},
		{"cut inside a 3-byte rune", "a€b€", 2, []string{"a€", "b€"}},
		{"4-byte rune", "😀x😀", 1, []string{"😀", "x", "😀"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := TextKeys(nil, tt.text, tt.chunkBytes)
			if chunks := textChunks(tt.text, tt.chunkBytes); strings.Join(chunks, "|") != strings.Join(tt.wantChunks, "|") {
				t.Fatalf("reference cut %q, want %q", chunks, tt.wantChunks)
			}
			if len(got) != len(tt.wantChunks) {
				t.Fatalf("%d keys, want %d", len(got), len(tt.wantChunks))
			}
			parent := rootSeed
			for i, c := range tt.wantChunks {
				if !utf8.ValidString(c) {
					t.Fatalf("chunk %q is not valid UTF-8", c)
				}
				want := Key(xxhash.Sum64(append(binary.LittleEndian.AppendUint64(nil, parent), c...)))
				if got[i] != want {
					t.Errorf("key %d = %x, want %x (chunk %q)", i, got[i], want, c)
				}
				parent = uint64(want)
			}
		})
	}
}

func TestTextKeysChain(t *testing.T) {
	a := strings.Repeat("system prompt ", 20) + "question one"
	b := strings.Repeat("system prompt ", 20) + "another question"
	ka, kb := TextKeys(nil, a, DefaultChunkBytes), TextKeys(nil, b, DefaultChunkBytes)
	shared := 0
	for shared < len(ka) && shared < len(kb) && ka[shared] == kb[shared] {
		shared++
	}
	if want := 280 / DefaultChunkBytes; shared != want {
		t.Errorf("texts sharing 280 bytes share %d keys, want %d", shared, want)
	}
	// Continuing a chain equals keying the whole text.
	head := TextKeys(nil, a[:128], DefaultChunkBytes)
	if got, want := TextKeys(head, a[128:], DefaultChunkBytes), ka; len(got) != len(want) || got[len(got)-1] != want[len(want)-1] {
		t.Errorf("continued text chain differs from the whole text's")
	}
}

func TestTokensPerChunk(t *testing.T) {
	for _, tt := range []struct{ in, want int }{{0, 1}, {1, 1}, {7, 1}, {8, 2}, {64, 16}, {65, 16}} {
		if got := TokensPerChunk(tt.in); got != tt.want {
			t.Errorf("TokensPerChunk(%d) = %d, want %d", tt.in, got, tt.want)
		}
	}
}

// TestAdapterSeeds: the base model's chains are Keys'; an adapter's share no
// key with the base model's or another adapter's over the same tokens, and
// continue from their own parent as any chain does.
func TestAdapterSeeds(t *testing.T) {
	tokens := seq(64, 7)
	base := Keys(nil, tokens, 16)
	if got := SeededKeys(nil, AdapterSeed(""), tokens, 16); !slices.Equal(got, base) {
		t.Fatalf("the base model's seeded keys %v differ from Keys %v", got, base)
	}
	a := SeededKeys(nil, AdapterSeed("sql-lora"), tokens, 16)
	b := SeededKeys(nil, AdapterSeed("chat-lora"), tokens, 16)
	for i := range base {
		if a[i] == base[i] || b[i] == base[i] || a[i] == b[i] {
			t.Errorf("block %d: keys meet across adapters: base %x, a %x, b %x", i, base[i], a[i], b[i])
		}
	}
	if again := SeededKeys(nil, AdapterSeed("sql-lora"), tokens, 16); !slices.Equal(again, a) {
		t.Error("an adapter's keys are not deterministic")
	}
	// A chain continued from its own keys ignores the seed: the parent
	// carries it.
	half := SeededKeys(nil, AdapterSeed("sql-lora"), tokens[:32], 16)
	if rest := SeededKeys(half, BaseSeed, tokens[32:], 16); !slices.Equal(rest, a) {
		t.Errorf("continued chain %v, want %v", rest, a)
	}
	ta := SeededTextKeys(nil, AdapterSeed("sql-lora"), strings.Repeat("x", 256), 64)
	tb := TextKeys(nil, strings.Repeat("x", 256), 64)
	if ta[0] == tb[0] {
		t.Error("text keys meet across an adapter and the base model")
	}
}

// TestSaltedSeeds: no salt keeps every seed (and so every existing key)
// exactly; a salt gives a chain that shares no key with the unsalted one,
// with another salt's, or with another adapter's, from the first block on.
func TestSaltedSeeds(t *testing.T) {
	tokens := seq(64, 7)
	for _, a := range []string{"", "sql-lora"} {
		if got := SaltedSeed(AdapterSeed(a), ""); got != AdapterSeed(a) {
			t.Errorf("adapter %q: SaltedSeed(seed, \"\") = %x, want the seed %x", a, got, AdapterSeed(a))
		}
	}
	if ChainSeed("", "") != BaseSeed {
		t.Fatalf("ChainSeed(\"\", \"\") = %x, want BaseSeed", ChainSeed("", ""))
	}
	if got, want := Keys(nil, tokens, 16)[0], refKey(rootSeed, tokens[:16]); got != want {
		t.Fatalf("unsalted first key %x, want the documented %x", got, want)
	}
	// Pinned: the salted seed is a documented hash, not an accident.
	if got := SaltedSeed(BaseSeed, "tenant-a"); got != refSalted(BaseSeed, "tenant-a") {
		t.Errorf("SaltedSeed(BaseSeed, tenant-a) = %x, want %x", got, refSalted(BaseSeed, "tenant-a"))
	}
	chains := map[string][]Key{}
	for _, c := range []struct{ adapter, salt string }{
		{"", ""}, {"", "a"}, {"", "b"}, {"", "A"}, {"", "a "}, {"sql-lora", ""}, {"sql-lora", "a"}, {"a", ""},
	} {
		chains[c.adapter+"|"+c.salt] = SeededKeys(nil, ChainSeed(c.adapter, c.salt), tokens, 16)
	}
	seen := map[Key]string{}
	for name, keys := range chains {
		for i, k := range keys {
			if other, ok := seen[k]; ok {
				t.Errorf("chain %s block %d shares its key with %s", name, i, other)
			}
			seen[k] = name
		}
	}
	if again := SeededKeys(nil, ChainSeed("", "a"), tokens, 16); !slices.Equal(again, chains["|a"]) {
		t.Error("a salted chain is not deterministic")
	}
	// A salted chain continued from its own keys stays salted (the salt,
	// like vLLM's, is in the first block only and carried by the parents).
	half := SeededKeys(nil, ChainSeed("", "a"), tokens[:32], 16)
	if rest := Keys(half, tokens[32:], 16); !slices.Equal(rest, chains["|a"]) {
		t.Error("a salted chain continued from its keys differs from the whole chain")
	}
	// Text chunks (no tokenizer) are salted the same way.
	text := strings.Repeat("y", 256)
	if SeededTextKeys(nil, ChainSeed("", "a"), text, 64)[0] == TextKeys(nil, text, 64)[0] {
		t.Error("salted text keys meet the unsalted ones")
	}
}

// refSalted is SaltedSeed as documented: xxHash64 of "prefixlb/salt\x00",
// the seed little-endian and the salt.
func refSalted(seed Seed, salt string) Seed {
	buf := append([]byte("prefixlb/salt\x00"), binary.LittleEndian.AppendUint64(nil, uint64(seed))...)
	return Seed(xxhash.Sum64(append(buf, salt...)))
}
