package tokenize

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

var (
	qwenOnce sync.Once
	qwenTok  *Tokenizer
	qwenErr  error
)

// qwen3 loads the project's copy of the Qwen3 tokenizer once per test binary.
func qwen3(tb testing.TB) *Tokenizer {
	tb.Helper()
	qwenOnce.Do(func() { qwenTok, qwenErr = Load("qwen3") })
	if qwenErr != nil {
		tb.Fatal(qwenErr)
	}
	return qwenTok
}

type refFile struct {
	Strings []string   `json:"strings"`
	Qwen3   [][]uint32 `json:"qwen3"`
}

func readRef(t *testing.T, path string) refFile {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var r refFile
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if len(r.Strings) != len(r.Qwen3) || len(r.Strings) == 0 {
		t.Fatalf("%s: %d strings, %d id lists", path, len(r.Strings), len(r.Qwen3))
	}
	return r
}

func TestEncodeReference(t *testing.T) {
	tok := qwen3(t)
	for _, file := range []string{"testdata/reference_ids.json", "testdata/extra_ids.json"} {
		r := readRef(t, file)
		for i, s := range r.Strings {
			got := tok.Encode(s)
			if !slices.Equal(got, r.Qwen3[i]) {
				t.Errorf("%s #%d Encode(%q)\n got %v\nwant %v", file, i, s, got, r.Qwen3[i])
			}
			if dec := tok.Decode(got); dec != norm.NFC.String(s) {
				t.Errorf("%s #%d Decode(Encode(%q)) = %q", file, i, s, dec)
			}
		}
	}
}

func TestTokenID(t *testing.T) {
	tok := qwen3(t)
	for _, c := range []struct {
		tok  string
		want uint32
	}{{"<|endoftext|>", 151643}, {"<|im_start|>", 151644}, {"<|im_end|>", 151645}, {"</think>", 151668}, {"\n", 198}, {",", 11}} {
		if got, ok := tok.TokenID(c.tok); !ok || got != c.want {
			t.Errorf("TokenID(%q) = %d, %v; want %d", c.tok, got, ok, c.want)
		}
	}
	if got := tok.VocabSize(); got != 151669 {
		t.Errorf("VocabSize = %d, want 151669", got)
	}
}

// pieces returns the pre-tokens of s.
func pieces(p preTokenizer, s string) []string {
	var out []string
	p.split(s, func(a, b int) { out = append(out, s[a:b]) })
	return out
}

func TestPreTokenizeQwen(t *testing.T) {
	p := splitLlama3{maxDigits: 1}
	cases := []struct {
		in   string
		want []string
	}{
		{"Hello, my dog", []string{"Hello", ",", " my", " dog"}},
		{"a  b", []string{"a", " ", " b"}},
		{"a   b", []string{"a", "  ", " b"}},
		{"a \n b", []string{"a", " \n", " b"}},
		{"end   ", []string{"end", "   "}},
		{"x\n\n\ny", []string{"x", "\n\n\n", "y"}},
		{"x\n \n  y", []string{"x", "\n \n", " ", " y"}},
		{"foo:\n\nbar", []string{"foo", ":\n\n", "bar"}},
		{"x !!\r\ny", []string{"x", " !!\r\n", "y"}},
		{"12345", []string{"1", "2", "3", "4", "5"}},
		{"I'M it's 'sup", []string{"I", "'M", " it", "'s", " '", "sup"}},
		{"\tfoo", []string{"\tfoo"}},
		{"(foo)", []string{"(foo", ")"}},
		{"日本語 テキスト", []string{"日本語", " テキスト"}},
		{"😀🚀 x", []string{"😀🚀", " x"}},
		{"a\u00a0b", []string{"a", "\u00a0b"}},
		{"  ", []string{"  "}},
		{" ", []string{" "}},
		{"\t\tx", []string{"\t", "\tx"}},
		{"x  \t", []string{"x", "  \t"}},
		{" 1", []string{" ", "1"}},
		{"a\r\n\r\nb", []string{"a", "\r\n\r\n", "b"}},
	}
	for _, c := range cases {
		if got := pieces(p, c.in); !slices.Equal(got, c.want) {
			t.Errorf("split(%q) = %q, want %q", c.in, got, c.want)
		}
	}
	if got, want := pieces(splitLlama3{maxDigits: 3}, "1234567"), []string{"123", "456", "7"}; !slices.Equal(got, want) {
		t.Errorf("llama3 digits: %q, want %q", got, want)
	}
}

func TestPreTokenizeGPT2(t *testing.T) {
	cases := []struct {
		in   string
		want []string
	}{
		{"Hello world", []string{"Hello", " world"}},
		{"I'M it's", []string{"I", "'", "M", " it", "'s"}},
		{"a  b", []string{"a", " ", " b"}},
		{"x 123 !!", []string{"x", " 123", " !!"}},
		{"x\n\ny", []string{"x", "\n", "\n", "y"}},
		{"end  ", []string{"end", "  "}},
		{"foo:\nbar", []string{"foo", ":", "\n", "bar"}},
	}
	for _, c := range cases {
		if got := pieces(splitGPT2{}, c.in); !slices.Equal(got, c.want) {
			t.Errorf("split(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// randomText makes text from a skewed alphabet rich in the cases the
// pre-tokenizer and BPE treat specially.
func randomText(r *rand.Rand, n int) string {
	alphabet := []string{"a", "e", "t", "the", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "1", "42", "'s", "'LL", ",", ".", "!?", "(", "{", "_", "é", "e\u0301", "日本", "語", "😀", "👍🏽", "\u00a0", "<|im_start|>", "<|im_end|>", "<think>", "<|im", "int", "func", "return", "Hello"}
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(alphabet[r.IntN(len(alphabet))])
	}
	return b.String()
}

func TestRoundTripRandom(t *testing.T) {
	tok := qwen3(t)
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 300; i++ {
		s := randomText(r, r.IntN(400))
		if got := tok.Decode(tok.Encode(s)); got != norm.NFC.String(s) {
			t.Fatalf("round trip of %q gave %q", s, got)
		}
	}
}

// TestBPELongMatchesShort checks the heap-based merge of long words against
// the stack-based one on the same words.
func TestBPELongMatchesShort(t *testing.T) {
	tok := qwen3(t)
	r := rand.New(rand.NewPCG(3, 4))
	words := []string{"internationalization", "                                ", "hello", "aaaaaaaaaaaaaaaaaaaaaaaaa", "😀😀😀😀", "ThisIsALongCamelCaseIdentifierName"}
	for i := 0; i < 500; i++ {
		var b strings.Builder
		for b.Len() < 1+r.IntN(64) {
			b.WriteString(string(rune('a' + r.IntN(26))))
			if r.IntN(5) == 0 {
				b.WriteString(words[r.IntN(len(words))])
			}
		}
		w := b.String()
		if len(w) > 64 {
			w = w[:64]
		}
		words = append(words, w)
	}
	for _, w := range words {
		if len(w) < 2 || len(w) > 64 {
			continue
		}
		short := tok.bpeShort(w, nil)
		long := tok.bpeLong(w, nil)
		if !slices.Equal(short, long) {
			t.Fatalf("word %q: short %v, long %v", w, short, long)
		}
	}
}

func TestConcurrentEncode(t *testing.T) {
	tok := qwen3(t)
	r := rand.New(rand.NewPCG(5, 6))
	texts := make([]string, 50)
	want := make([][]uint32, len(texts))
	for i := range texts {
		texts[i] = randomText(r, 300)
		want[i] = tok.Encode(texts[i])
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for i := range texts {
				if got := tok.Encode(texts[i]); !slices.Equal(got, want[i]) {
					t.Errorf("concurrent Encode(%q) differs", texts[i])
				}
			}
		})
	}
	wg.Wait()
}

// tinyTokenizer builds a tokenizer.json over the 256 byte tokens plus the
// given merges, in the given merges format.
func tinyTokenizer(t *testing.T, mergesAsPairs bool, pre string, normalizer string) []byte {
	t.Helper()
	vocab := map[string]int{}
	for b := 0; b < 256; b++ {
		vocab[string(byteToRune[b])] = b
	}
	merges := [][2]string{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}}
	for _, m := range merges {
		vocab[m[0]+m[1]] = len(vocab)
	}
	var mergesJSON any
	if mergesAsPairs {
		mergesJSON = merges
	} else {
		var ss []string
		for _, m := range merges {
			ss = append(ss, m[0]+" "+m[1])
		}
		mergesJSON = ss
	}
	doc := map[string]any{
		"added_tokens":  []any{map[string]any{"id": 300, "content": "<eos>", "special": true}},
		"normalizer":    json.RawMessage(normalizer),
		"pre_tokenizer": json.RawMessage(pre),
		"model":         map[string]any{"type": "BPE", "vocab": vocab, "merges": mergesJSON},
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const gpt2Pre = `{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}`

func TestMergesFormats(t *testing.T) {
	for _, pairs := range []bool{false, true} {
		tok, err := New(tinyTokenizer(t, pairs, gpt2Pre, "null"), nil)
		if err != nil {
			t.Fatal(err)
		}
		got := tok.Encode("hello world<eos>")
		want := []uint32{259, 260, 'o', 'r', 'l', 'd', 300}
		if !slices.Equal(got, want) {
			t.Errorf("pairs=%v: Encode = %v, want %v", pairs, got, want)
		}
		if d := tok.Decode(got); d != "hello world<eos>" {
			t.Errorf("Decode = %q", d)
		}
	}
}

func TestUnsupported(t *testing.T) {
	cases := []struct {
		name, pre, norm, wantMsg string
	}{
		{"metaspace", `{"type":"Metaspace","replacement":"▁"}`, "null", `pre-tokenizer "Metaspace"`},
		{"regex", `{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\w+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","use_regex":false}]}`, "null", `regex "\\w+"`},
		{"lowercase", gpt2Pre, `{"type":"Lowercase"}`, `normalizer "Lowercase"`},
		{"no bytelevel", "null", "null", "without ByteLevel"},
	}
	for _, c := range cases {
		_, err := New(tinyTokenizer(t, false, c.pre, c.norm), nil)
		if err == nil || !strings.Contains(err.Error(), c.wantMsg) {
			t.Errorf("%s: err = %v, want one naming %s", c.name, err, c.wantMsg)
		}
	}
	_, err := New([]byte(`{"model":{"type":"Unigram","vocab":[]}}`), nil)
	if err == nil || !strings.Contains(err.Error(), `model type "Unigram"`) {
		t.Errorf("unigram: err = %v", err)
	}
}

func TestLoadFileAndGzip(t *testing.T) {
	dir := t.TempDir()
	raw := tinyTokenizer(t, false, gpt2Pre, "null")
	if err := os.WriteFile(dir+"/tokenizer.json", raw, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, dir + "/tokenizer.json"} {
		tok, err := Load(p)
		if err != nil {
			t.Fatal(err)
		}
		if tok.HasChatTemplate() {
			t.Errorf("%s: unexpected chat template", p)
		}
	}
	if _, err := Load(dir + "/missing"); err == nil {
		t.Error("Load of a missing file succeeded")
	}
}

func FuzzRoundTrip(f *testing.F) {
	tok := qwen3(f)
	for _, s := range []string{"Hello, world", "  x\n\n", "日本語", "<|im_start|>", "e\u0301"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		ids := tok.Encode(s)
		if got, want := tok.Decode(ids), norm.NFC.String(s); got != want {
			t.Fatalf("Decode(Encode(%q)) = %q, want %q", s, got, want)
		}
		if c := NewPrefixCache(tok, 1000); !slices.Equal(c.Encode(s), ids) {
			t.Fatalf("PrefixCache.Encode(%q) differs from Encode", s)
		}
	})
}

func ExampleTokenizer_Encode() {
	tok, err := Load("qwen3")
	if err != nil {
		panic(err)
	}
	ids := tok.Encode("Hello, my dog is cute")
	fmt.Println(ids, tok.Decode(ids))
	// Output: [9707 11 847 5562 374 18838] Hello, my dog is cute
}
