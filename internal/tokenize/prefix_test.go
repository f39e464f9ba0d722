package tokenize

import (
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
)

// TestPrefixCacheMatchesEncode is the property test: for random texts that
// share prefixes (so chunks are reused) the cache returns exactly Encode's ids.
func TestPrefixCacheMatchesEncode(t *testing.T) {
	tok := qwen3(t)
	r := rand.New(rand.NewPCG(7, 8))
	c := NewPrefixCache(tok, 20000)
	var bases []string
	for i := 0; i < 8; i++ {
		bases = append(bases, randomText(r, 3000+r.IntN(3000)))
	}
	for i := 0; i < 200; i++ {
		base := bases[r.IntN(len(bases))]
		cut := r.IntN(len(base) + 1)
		for cut > 0 && cut < len(base) && (base[cut]&0xC0) == 0x80 { // keep UTF-8 whole
			cut--
		}
		s := base[:cut] + randomText(r, r.IntN(2000))
		if got, want := c.Encode(s), tok.Encode(s); !slices.Equal(got, want) {
			t.Fatalf("text %d (prefix %d bytes): cache gave %d ids, Encode %d; first difference at %d",
				i, cut, len(got), len(want), firstDiff(got, want))
		}
	}
	st := c.Stats()
	if st.HitTokens == 0 || st.MissTokens == 0 {
		t.Errorf("stats %+v: want both hits and misses", st)
	}
	if st.Tokens > 20000 {
		t.Errorf("cache holds %d tokens, over its bound 20000", st.Tokens)
	}
}

// TestPrefixCacheReal reuses a real prompt prefix: a document with
// questions appended, as in LooGLE.
func TestPrefixCacheReal(t *testing.T) {
	tok := qwen3(t)
	docs := benchText(t).Loogle
	c := NewPrefixCache(tok, 0)
	doc := docs[0]
	for i, q := range []string{"Who is mentioned first?", "Summarise the text.\n\nBe short.", " trailing", "\n"} {
		s := "Please answer the question based on the long texts below. \n" + doc + "\nQuestion: " + q + "\nAnswer: "
		if got, want := c.Encode(s), tok.Encode(s); !slices.Equal(got, want) {
			t.Fatalf("question %d: first difference at %d", i, firstDiff(got, want))
		}
	}
	st := c.Stats()
	if st.HitTokens < 2*st.MissTokens {
		t.Errorf("stats %+v: the shared document should be mostly hits", st)
	}
}

func TestPrefixCacheConcurrent(t *testing.T) {
	tok := qwen3(t)
	c := NewPrefixCache(tok, 5000)
	r := rand.New(rand.NewPCG(9, 10))
	base := randomText(r, 8000)
	texts := make([]string, 40)
	for i := range texts {
		texts[i] = base[:r.IntN(len(base)/2)*2/2] + randomText(r, 500)
		texts[i] = strings.ToValidUTF8(texts[i], "")
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for _, s := range texts {
				if !slices.Equal(c.Encode(s), tok.Encode(s)) {
					t.Errorf("concurrent PrefixCache.Encode differs")
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestSafeBoundaries(t *testing.T) {
	cases := []struct {
		s    string
		p    int
		want bool
	}{
		{"ab\ncd", 3, true},
		{"ab\n cd", 3, false},
		{"ab\n\ncd", 3, false},
		{"ab\n日本", 3, true},
		{"ab cd", 2, true},
		{"ab  cd", 2, false},
		{"a, cd", 2, false},
		{"ab 12", 2, false},
		{"12 ab", 2, true},
	}
	for _, c := range cases {
		if got := isSafeBoundary(c.s, c.p, false); got != c.want {
			t.Errorf("isSafeBoundary(%q, %d) = %v, want %v", c.s, c.p, got, c.want)
		}
	}
	if isSafeBoundary("ab\n日本", 3, true) {
		t.Error("asciiOnly boundary before a non-ASCII character")
	}
}

func firstDiff(a, b []uint32) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
