package keying

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

func TestChunkKeyer(t *testing.T) {
	k := ChunkKeyer{BlockTokens: 16}
	text := strings.Repeat("x", 200)
	tr := &openai.Request{Texts: []string{text}}
	keys, n, err := k.Keys(tr)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 3 || n != 50 || !tr.TokensEstimated {
		t.Errorf("text: %d keys, %d tokens, estimated %v; want 3, 50, true", len(keys), n, tr.TokensEstimated)
	}
	if want := blocks.TextKeys(nil, text, 64); keys[2] != want[2] {
		t.Error("text keys differ from blocks.TextKeys")
	}
	ids := make([]uint32, 40)
	ir := &openai.Request{TokenIDs: [][]uint32{ids, {1}}}
	keys, n, _ = k.Keys(ir)
	if len(keys) != 2 || n != 41 || ir.TokensEstimated {
		t.Errorf("ids: %d keys, %d tokens, estimated %v; want 2, 41, false", len(keys), n, ir.TokensEstimated)
	}
	_, n, _ = k.Keys(&openai.Request{})
	if n != 1 {
		t.Errorf("empty request: %d tokens, want 1", n)
	}
}

// TestKeyMemo checks that the keyer's memo of recent prompts returns
// exactly blocks.Keys for prompts that share prefixes of every length with
// earlier ones, including while it evicts.
func TestKeyMemo(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	m := newKeyMemo(16)
	var prompts [][]uint32
	base := make([]uint32, 40000)
	for i := range base {
		base[i] = rng.Uint32() % 1000
	}
	for i := range 300 {
		var ids []uint32
		switch {
		case i%3 == 0 || len(prompts) == 0: // a prefix of the base and a new tail
			ids = append(ids, base[:rng.IntN(len(base))]...)
		default: // an earlier prompt, cut, and extended
			p := prompts[rng.IntN(len(prompts))]
			ids = append(ids, p[:rng.IntN(len(p)+1)]...)
		}
		for range rng.IntN(3000) {
			ids = append(ids, rng.Uint32()%1000)
		}
		prompts = append(prompts, ids)
		got, want := m.keys(blocks.BaseSeed, ids), blocks.Keys(nil, ids, 16)
		if !slices.Equal(got, want) {
			t.Fatalf("prompt %d (%d ids): keys differ from blocks.Keys", i, len(ids))
		}
		if m.held > memoMaxKeys {
			t.Fatalf("memo holds %d keys, over its bound", m.held)
		}
	}
	// Eviction keeps the bound and the map consistent.
	for i := range 2*memoMaxKeys/(len(base)/16) + 4 {
		ids := append([]uint32{uint32(i) + 5000}, base...)
		if got := m.keys(blocks.BaseSeed, ids); !slices.Equal(got, blocks.Keys(nil, ids, 16)) {
			t.Fatal("keys differ after eviction")
		}
	}
	if m.held > memoMaxKeys {
		t.Fatalf("memo holds %d keys, over its bound", m.held)
	}
	for p, e := range m.byPrint {
		if e.prev == nil || !slices.Contains(e.prints, p) {
			t.Fatal("the fingerprint map points to an evicted or foreign entry")
		}
	}
}

// TestKeyMemoConcurrent keys prompts that share prefixes from several
// goroutines at once (run it with -race).
func TestKeyMemoConcurrent(t *testing.T) {
	m := newKeyMemo(16)
	base := make([]uint32, 8000)
	for i := range base {
		base[i] = uint32(i * 7919 % 1000)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for g := range 4 {
		wg.Go(func() {
			for i := range 30 {
				ids := append(base[:len(base)-i*100:len(base)-i*100], uint32(g), uint32(i))
				if !slices.Equal(m.keys(blocks.BaseSeed, ids), blocks.Keys(nil, ids, 16)) {
					errs <- "keys differ from blocks.Keys"
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
}

// FuzzChunkKeys holds ChunkKeyer's promise on whatever ParseRequest
// accepts: at least one prompt token, and at least a block's worth per key.
func FuzzChunkKeys(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","prompt":"hello world"}`,
		`{"model":"m","prompt":["a","b"],"n":3,"max_tokens":7}`,
		`{"model":"m","prompt":[[1,2],[3,4]],"max_tokens":5,"n":2}`,
		`{"model":"m","prompt":[` + strings.Repeat("7,", 40) + `7]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
	} {
		f.Add(uint8(1), []byte(s))
		f.Add(uint8(2), []byte(s))
	}
	k := ChunkKeyer{BlockTokens: 16}
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		r, err := openai.ParseRequest(openai.Kind(kind%3), body)
		if err != nil {
			return
		}
		keys, n, err := k.Keys(r)
		if err != nil {
			t.Fatal(err)
		}
		if n < 1 || n < len(keys)*16 {
			t.Fatalf("%d prompt tokens for %d keys", n, len(keys))
		}
	})
}

// TestAdapterKeys: a LoRA adapter's request is keyed from the adapter's
// seed by both keyers — never the base model's or another adapter's keys —
// and the memo never hands one seed's keys to another.
func TestAdapterKeys(t *testing.T) {
	ids := make([]uint32, 64*16*3)
	for i := range ids {
		ids[i] = uint32(i % 997)
	}
	m := newKeyMemo(16)
	base := m.keys(blocks.BaseSeed, ids)
	a := m.keys(blocks.AdapterSeed("a"), ids)
	if !slices.Equal(a, blocks.SeededKeys(nil, blocks.AdapterSeed("a"), ids, 16)) || a[0] == base[0] || a[len(a)-1] == base[len(base)-1] {
		t.Error("the memo gave adapter a the base model's keys")
	}
	ck := ChunkKeyer{BlockTokens: 16}
	kb, _, _ := ck.Keys(&openai.Request{TokenIDs: [][]uint32{ids}})
	ka, _, _ := ck.Keys(&openai.Request{TokenIDs: [][]uint32{ids}, Adapter: "a"})
	if !slices.Equal(kb, base) || !slices.Equal(ka, a) {
		t.Error("ChunkKeyer: adapter keys differ from the seeded chain")
	}
	tb, _, _ := ck.Keys(&openai.Request{Texts: []string{strings.Repeat("hello ", 100)}})
	ta, _, _ := ck.Keys(&openai.Request{Texts: []string{strings.Repeat("hello ", 100)}, Adapter: "a"})
	if tb[0] == ta[0] {
		t.Error("ChunkKeyer: text keys meet across an adapter and the base model")
	}
}

// TestSaltedKeys: a salted request (Request.CacheSalt) is keyed from the
// salted seed by both keyers, text, token ids and chats alike, and never
// meets the unsalted or another salt's keys; no salt keeps today's keys.
func TestSaltedKeys(t *testing.T) {
	ids := make([]uint32, 64*16*3)
	for i := range ids {
		ids[i] = uint32(i % 997)
	}
	text := strings.Repeat("hello ", 300)
	tok := NewTokenizerKeyer(testTokenizer(t), 16)
	for name, k := range map[string]Keyer{"chunk": ChunkKeyer{BlockTokens: 16}, "tokenizer": tok} {
		for _, r := range []openai.Request{{TokenIDs: [][]uint32{ids}}, {Texts: []string{text}}, {Adapter: "a", TokenIDs: [][]uint32{ids}}} {
			plain, _, _ := k.Keys(&r)
			r.CacheSalt = "s1"
			s1, _, _ := k.Keys(&r)
			r.CacheSalt = "s2"
			s2, _, _ := k.Keys(&r)
			if len(plain) == 0 || len(s1) != len(plain) || len(s2) != len(plain) {
				t.Fatalf("%s: %d, %d, %d keys", name, len(plain), len(s1), len(s2))
			}
			for i := range plain {
				if s1[i] == plain[i] || s2[i] == plain[i] || s1[i] == s2[i] {
					t.Errorf("%s (adapter %q): block %d meets across salts", name, r.Adapter, i)
				}
			}
			if r.TokenIDs != nil {
				if want := blocks.SeededKeys(nil, blocks.ChainSeed(r.Adapter, "s2"), ids, 16); !slices.Equal(s2, want) {
					t.Errorf("%s: salted keys differ from the salted chain", name)
				}
				if want := blocks.SeededKeys(nil, blocks.AdapterSeed(r.Adapter), ids, 16); !slices.Equal(plain, want) {
					t.Errorf("%s: unsalted keys changed", name)
				}
			}
		}
	}
	// The memo never hands one salt's keys to another.
	chat := &openai.Request{Kind: openai.KindChat, Texts: []string{text}, Chat: &openai.ChatPrompt{
		Messages: []tokenize.Message{{Role: "user", Content: text}}, AddGenerationPrompt: true}}
	a, _, _ := tok.Keys(chat)
	chat.CacheSalt = "s1"
	b, _, _ := tok.Keys(chat)
	if len(a) == 0 || a[0] == b[0] || a[len(a)-1] == b[len(b)-1] {
		t.Error("tokenizer keyer: chat keys meet across a salt and none")
	}
}

// BenchmarkChunkKeyer: keying a 3,200-word text prompt (~22 KB, the shape
// of docs/peers.md) by 64-byte chunks, the router's whole cost of a text
// request's keys when no tokenizer matches the replicas.
func BenchmarkChunkKeyer(b *testing.B) {
	var sb strings.Builder
	for i := range 3200 {
		sb.WriteString(" w")
		sb.WriteString(strconv.Itoa(i * 7919 % 100000))
	}
	text := sb.String()
	k := ChunkKeyer{BlockTokens: 16}
	b.ReportAllocs()
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		r := openai.Request{Texts: []string{text}}
		if _, _, err := k.Keys(&r); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/prompt")
}
