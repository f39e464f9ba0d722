package prompttext

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// BenchmarkRenderCodingAgent renders the longest prompt of a coding-agent
// workload (about 60k tokens) under the bundled Qwen3's vocabulary and
// reports the text rendered per second (MB/s) and the time per prompt.
// The load generator renders each request's prompt as it sends it, so this
// must stay far below the time between requests.
func BenchmarkRenderCodingAgent(b *testing.B) {
	tok, err := qwen3.Shared()
	if err != nil {
		b.Fatal(err)
	}
	r, err := FromTokenizer(tok)
	if err != nil {
		b.Fatal(err)
	}
	s := workload.DefaultSpec("coding-agent")
	s.Requests = 200
	reqs, err := workload.Generate(s)
	if err != nil {
		b.Fatal(err)
	}
	var ids []uint32
	for _, q := range reqs {
		if len(q.Tokens) > len(ids) {
			ids = q.Tokens
		}
	}
	buf := r.Append(nil, ids)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	b.ResetTimer()
	for b.Loop() {
		buf = r.Append(buf[:0], ids)
	}
	b.StopTimer()
	b.ReportMetric(float64(len(ids)), "tokens/prompt")
	b.ReportMetric(b.Elapsed().Seconds()*1e3/float64(b.N), "ms/prompt")
}

// BenchmarkRenderString is Render, which allocates the prompt's string as
// the load generator does, over the same kind of prompt.
func BenchmarkRenderString(b *testing.B) {
	tok, err := qwen3.Shared()
	if err != nil {
		b.Fatal(err)
	}
	r, err := FromTokenizer(tok)
	if err != nil {
		b.Fatal(err)
	}
	ids := make([]uint32, 60000)
	for i := range ids {
		ids[i] = uint32(i * 7919 % 150000)
	}
	n := len(r.Render(ids))
	b.ReportAllocs()
	b.SetBytes(int64(n))
	for b.Loop() {
		_ = r.Render(ids)
	}
	b.ReportMetric(b.Elapsed().Seconds()*1e3/float64(b.N), "ms/prompt")
}
