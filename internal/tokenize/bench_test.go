package tokenize

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

type benchData struct {
	ShareGPT []string `json:"sharegpt"`
	Loogle   []string `json:"loogle"`
}

var (
	benchOnce sync.Once
	benchVal  benchData
	benchErr  error
)

// benchText reads testdata/bench_text.json.gz (see its "note" for sources).
func benchText(tb testing.TB) *benchData {
	tb.Helper()
	benchOnce.Do(func() {
		f, err := os.Open("testdata/bench_text.json.gz")
		if err != nil {
			benchErr = err
			return
		}
		defer f.Close()
		zr, err := gzip.NewReader(f)
		if err != nil {
			benchErr = err
			return
		}
		benchErr = json.NewDecoder(zr).Decode(&benchVal)
	})
	if benchErr != nil {
		tb.Fatal(benchErr)
	}
	return &benchVal
}

// mixedText is about 1 MB of ShareGPT prompts (English, code, other
// languages) and LooGLE documents.
func mixedText(tb testing.TB) string {
	d := benchText(tb)
	return strings.Join(d.ShareGPT, "\n\n") + "\n\n" + strings.Join(d.Loogle, "\n\n")
}

// BenchmarkEncode is single-core tokenisation throughput of fresh text with
// the tokenizer's word cache in its steady state (the text has been seen by
// the word cache, as a router's vocabulary of frequent words is).
func BenchmarkEncode(b *testing.B) {
	tok := qwen3(b)
	text := mixedText(b)
	tok.Encode(text)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		tok.Encode(text)
	}
}

// BenchmarkEncodeCold is BenchmarkEncode with an empty word cache at every
// iteration: every distinct word of the megabyte goes through BPE.
func BenchmarkEncodeCold(b *testing.B) {
	tok := qwen3(b)
	text := mixedText(b)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		b.StopTimer()
		cold := *tok
		cold.cache = newWordCache()
		b.StartTimer()
		cold.Encode(text)
	}
}

// chat60k builds a conversation of about 58k tokens (a system prompt, long
// documents, an assistant answer) and the text of a ~2k-token new user turn.
func chat60k(tb testing.TB, tok *Tokenizer) (history []Message, tail string) {
	d := benchText(tb)
	var doc strings.Builder
	for _, l := range d.Loogle {
		doc.WriteString(l)
		doc.WriteString("\n\n")
	}
	docText := doc.String()
	// Trim the documents to ~57k tokens.
	ids := tok.Encode(docText)
	if len(ids) > 57000 {
		docText = tok.Decode(ids[:57000])
		docText = strings.ToValidUTF8(docText, "")
	}
	history = []Message{
		{Role: "system", Content: "You are a careful research assistant. Answer from the documents."},
		{Role: "user", Content: "Read these documents.\n\n" + docText},
		{Role: "assistant", Content: "I have read the documents. What would you like to know?"},
	}
	var t strings.Builder
	for _, p := range d.ShareGPT {
		if t.Len() > 8000 {
			break
		}
		t.WriteString(p)
		t.WriteString("\n")
	}
	return history, t.String()
}

// BenchmarkPrefixCacheChat60k is the route-time tokenisation of a ~60k-token
// chat whose first ~58k tokens were seen before: render the Qwen3 template
// and encode through a warm PrefixCache. Every iteration's last user turn is
// new text (a request number heads it), so the tail is really tokenised.
func BenchmarkPrefixCacheChat60k(b *testing.B) {
	tok := qwen3(b)
	history, tail := chat60k(b, tok)
	c := NewPrefixCache(tok, 0)
	if _, err := c.EncodeChat(history, ChatOptions{AddGenerationPrompt: true}); err != nil {
		b.Fatal(err)
	}
	msgs := append(history[:len(history):len(history)], Message{Role: "user"})
	n := 0
	var total int
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		n++
		msgs[len(msgs)-1].Content = fmt.Sprintf("Request %d. %s", n, tail)
		ids, err := c.EncodeChat(msgs, ChatOptions{AddGenerationPrompt: true})
		if err != nil {
			b.Fatal(err)
		}
		total = len(ids)
	}
	b.ReportMetric(float64(total), "tokens")
	st := c.Stats()
	b.ReportMetric(float64(st.HitTokens)/float64(st.HitTokens+st.MissTokens), "hit-ratio")
}

// BenchmarkChat60kCold is the same chat tokenised from scratch (template and
// Tokenizer.Encode, word cache warm) for comparison.
func BenchmarkChat60kCold(b *testing.B) {
	tok := qwen3(b)
	history, tail := chat60k(b, tok)
	msgs := append(history[:len(history):len(history)], Message{Role: "user", Content: tail})
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tok.EncodeChat(msgs, ChatOptions{AddGenerationPrompt: true}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkApplyChatTemplate60k is the template rendering alone.
func BenchmarkApplyChatTemplate60k(b *testing.B) {
	tok := qwen3(b)
	history, tail := chat60k(b, tok)
	msgs := append(history[:len(history):len(history)], Message{Role: "user", Content: tail})
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tok.ApplyChatTemplate(msgs, ChatOptions{AddGenerationPrompt: true}); err != nil {
			b.Fatal(err)
		}
	}
}
