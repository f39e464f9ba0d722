package openai

import (
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// chatBodyManySmall is a chat body of n short messages (about 40 bytes
// each), the shape that costs the parse the most per body byte.
func chatBodyManySmall(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		b.WriteString(`{"role":"` + role + `","content":"turn ` + strconv.Itoa(i) + ` ok"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// chatBodyManyParts is a chat body of n messages whose content is a list
// of two short text parts.
func chatBodyManyParts(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`{"role":"user","content":[{"type":"text","text":"a` + strconv.Itoa(i) + `"},{"type":"text","text":"b"}]}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// chatBodyFewHuge is a chat body of n messages of size bytes each, text
// with a newline escape every 60 bytes or so (code and prose both have
// them).
func chatBodyFewHuge(n, size int) []byte {
	line := strings.Repeat("lorem ipsum dolor sit amet ", 2)[:54] + `\n`
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`{"role":"user","content":"`)
		for w := 0; w < size; w += len(line) {
			b.WriteString(line)
		}
		b.WriteString(`"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// BenchmarkParseAlloc measures ParseRequest's memory amplification: the
// bytes it allocates per body byte (alloc-x), on the shapes that stress
// it. A hostile client sends the worst of them at the body limit, so
// alloc-x times --max-body-bytes is what one request costs the router.
//
//	go test -run '^$' -bench ParseAlloc -count 5 ./internal/openai/
func BenchmarkParseAlloc(b *testing.B) {
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"many-small", chatBodyManySmall(5000)},
		{"many-parts", chatBodyManyParts(5000)},
		{"few-huge", chatBodyFewHuge(4, 1<<20)},
	} {
		b.Run(c.name, func(b *testing.B) {
			if _, err := ParseRequest(KindChat, c.body); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			n := 0
			for b.Loop() {
				if _, err := ParseRequest(KindChat, c.body); err != nil {
					b.Fatal(err)
				}
				n++
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(n)/float64(len(c.body)), "alloc-x")
		})
	}
}
