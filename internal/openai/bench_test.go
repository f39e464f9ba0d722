package openai

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize/benchtext"
)

// BenchmarkParseChat60k is ParseRequest alone on the 263 KB body of
// BenchmarkRouteChat60k, against the encoding/json reference it replaced.
//
//	go test -run '^$' -bench ParseChat60k -cpu 1 ./internal/openai/
func BenchmarkParseChat60k(b *testing.B) {
	history, tail, err := benchtext.Chat60k(testTokenizer(b))
	if err != nil {
		b.Skip("benchmark text:", err)
	}
	js, err := benchtext.ChatJSON(history, tail)
	if err != nil {
		b.Fatal(err)
	}
	for _, impl := range []struct {
		name  string
		parse func(Kind, []byte) (*Request, error)
	}{{"scan", ParseRequest}, {"encoding-json", refParseRequest}} {
		b.Run(impl.name, func(b *testing.B) {
			b.SetBytes(int64(len(js)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := impl.parse(KindChat, js); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
