package costmodel

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func mustLookup(t testing.TB, name string) Profile {
	t.Helper()
	p, err := Lookup(name)
	if err != nil {
		t.Fatalf("Lookup(%q): %v", name, err)
	}
	return p
}

func within(got, want time.Duration, frac float64) bool {
	return math.Abs(float64(got-want)) <= frac*float64(want)
}

// The check values of ALGORITHMS.md §5 and the published fits.
func TestPrefillCheckValues(t *testing.T) {
	tests := []struct {
		profile   string
		new, seq  int
		want      time.Duration
		tolerance float64
	}{
		{Mistral7BA6000, 1000, 3000, 140 * time.Millisecond, 0.05},
		{Mistral7BA6000, 8000, 8000, 1150 * time.Millisecond, 0.05},
		// 18.667 + 79.879 + 8.0559 + 2.23302 ms.
		{Llama3_70BH100x2, 1000, 3000, 108834920 * time.Nanosecond, 1e-6},
		// A short prefill: linear floor 22 ms + attention 0.32 ms, / 0.9.
		{Mistral7BA6000, 100, 100, 24800 * time.Microsecond, 1e-6},
		// llama-server's measured 601-token cold prompt, about 0.15 s
		// (README of shared/engines/llama.cpp): 9.037 + 49.084 + 77.583 ms.
		{LlamaCppTinyCPU, 601, 601, 135704 * time.Microsecond, 1e-4},
		// 5 new tokens on 4,352 cached beside an empty slot: measured 13.7 ms;
		// 9.037 + 0.408 + 4.679 ms.
		{LlamaCppTinyCPU, 5, 4357, 14125 * time.Microsecond, 1e-3},
	}
	for _, tt := range tests {
		got := mustLookup(t, tt.profile).Prefill(tt.new, tt.seq)
		if !within(got, tt.want, tt.tolerance) {
			t.Errorf("%s: Prefill(%d, %d) = %v, want %v ±%g%%", tt.profile, tt.new, tt.seq, got, tt.want, 100*tt.tolerance)
		}
	}
}

// Sanity ranges for the rooflines (the and public measurements).
func TestRooflineSanity(t *testing.T) {
	const ctx = 2048
	tests := []struct {
		profile  string
		what     string
		got      func(Profile) time.Duration
		min, max time.Duration
	}{
		{Qwen3_32BH100x2, "prefill 6k on 6k", func(p Profile) time.Duration { return p.Prefill(6000, 6000) }, 200 * time.Millisecond, 500 * time.Millisecond},
		{Qwen3_32BH100x2, "decode step, batch 32", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 32, DecodeContext: 32 * ctx}) }, 20 * time.Millisecond, 40 * time.Millisecond},
		{Qwen3_32BH100x2, "decode step, batch 1", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 1, DecodeContext: ctx}) }, 12 * time.Millisecond, 30 * time.Millisecond},
		{Llama31_8BH100, "prefill 6k on 6k", func(p Profile) time.Duration { return p.Prefill(6000, 6000) }, 100 * time.Millisecond, 300 * time.Millisecond},
		{Llama31_8BH100, "decode step, batch 1", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 1, DecodeContext: ctx}) }, 5 * time.Millisecond, 15 * time.Millisecond},
		{Llama31_8BH100, "decode step, batch 32", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 32, DecodeContext: 32 * ctx}) }, 8 * time.Millisecond, 25 * time.Millisecond},
		// The A100: 312 TFLOP/s and 2.039 TB/s against 989.4 and 3.35.
		{Llama31_8BA100, "prefill 6k on 6k", func(p Profile) time.Duration { return p.Prefill(6000, 6000) }, 300 * time.Millisecond, 900 * time.Millisecond},
		{Llama31_8BA100, "decode step, batch 1", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 1, DecodeContext: ctx}) }, 8 * time.Millisecond, 20 * time.Millisecond},
		{Llama31_8BA100, "decode step, batch 32", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 32, DecodeContext: 32 * ctx}) }, 12 * time.Millisecond, 40 * time.Millisecond},
		{Llama3_70BH100x2, "decode step, batch 32", func(p Profile) time.Duration { return p.Iteration(Batch{DecodeSeqs: 32, DecodeContext: 32 * ctx}) }, 20 * time.Millisecond, 40 * time.Millisecond},
	}
	for _, tt := range tests {
		got := tt.got(mustLookup(t, tt.profile))
		if got < tt.min || got > tt.max {
			t.Errorf("%s %s = %v, want in [%v, %v]", tt.profile, tt.what, got, tt.min, tt.max)
		}
	}
}

func TestKVCapacity(t *testing.T) {
	tests := []struct {
		profile string
		want    int
	}{
		{Mistral7BA6000, 198_516},
		{Qwen3_32BH100x2, 307_328}, // llm-d's published figure
		{Llama31_8BH100, 434_752},
		{Llama31_8BA100, 434_752}, // the same 80 GiB and memory fraction
		{Llama3_70BH100x2, 15_200},
		{LlamaCppTinyCPU, 16_384}, // llama-server -c 16384
	}
	for _, tt := range tests {
		if got := mustLookup(t, tt.profile).KVCapacity(); got != tt.want {
			t.Errorf("%s: KVCapacity() = %d, want %d", tt.profile, got, tt.want)
		}
	}
}

func TestNamesAndLookup(t *testing.T) {
	got := strings.Join(Names(), ",")
	want := "llama3-70b-h100x2,llama3.1-8b-a100,llama3.1-8b-h100,llamacpp-tiny-cpu,mistral-7b-a6000,qwen3-32b-h100x2"
	if got != want {
		t.Errorf("Names() = %s, want %s", got, want)
	}
	for _, n := range Names() {
		if p := mustLookup(t, n); p.Name() != n {
			t.Errorf("Lookup(%q).Name() = %q", n, p.Name())
		}
	}
	_, err := Lookup("gpt-5")
	if !errors.Is(err, ErrUnknownProfile) {
		t.Fatalf("Lookup(unknown) error = %v, want ErrUnknownProfile", err)
	}
	for _, s := range []string{`"gpt-5"`, "mistral-7b-a6000", "qwen3-32b-h100x2"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("Lookup(unknown) error %q does not mention %s", err, s)
		}
	}
}

func TestEmptyBatchIsFree(t *testing.T) {
	empty := []Batch{
		{},
		{Prefill: []Chunk{{New: 0, Seq: 5000}}},
		{Prefill: []Chunk{{New: -3, Seq: 10}}, DecodeSeqs: -1, DecodeContext: 900},
		{DecodeContext: 4096},
	}
	for _, n := range Names() {
		p := mustLookup(t, n)
		for _, b := range empty {
			if got := p.Iteration(b); got != 0 {
				t.Errorf("%s: Iteration(%+v) = %v, want 0", n, b, got)
			}
		}
		if got := p.Prefill(0, 100); got != 0 {
			t.Errorf("%s: Prefill(0, 100) = %v, want 0", n, got)
		}
	}
}

func nonEmpty(b Batch) bool {
	for _, c := range b.Prefill {
		if c.New > 0 {
			return true
		}
	}
	return b.DecodeSeqs > 0
}

// step grows one input of a batch by d.
type step struct {
	name string
	grow func(b Batch, d int) Batch
}

var steps = []step{
	{"decode seqs", func(b Batch, d int) Batch { b.DecodeSeqs += d; return b }},
	{"decode context", func(b Batch, d int) Batch { b.DecodeContext += d; return b }},
	{"chunk new", func(b Batch, d int) Batch { b.Prefill = withChunk(b.Prefill, 0, d, 0); return b }},
	{"chunk seq", func(b Batch, d int) Batch { b.Prefill = withChunk(b.Prefill, 0, 0, d); return b }},
	{"second chunk new", func(b Batch, d int) Batch { b.Prefill = withChunk(b.Prefill, 1, d, d); return b }},
	{"extra chunk", func(b Batch, d int) Batch {
		b.Prefill = append(append([]Chunk(nil), b.Prefill...), Chunk{New: d, Seq: 2 * d})
		return b
	}},
}

func withChunk(cs []Chunk, i, dNew, dSeq int) []Chunk {
	out := append([]Chunk(nil), cs...)
	for len(out) <= i {
		out = append(out, Chunk{})
	}
	out[i].New += dNew
	out[i].Seq += dSeq
	return out
}

// Iteration is monotone non-decreasing in every input, and > 0 when the
// batch computes anything. Walks each input across the fits' breakpoints
// (192, 244, 384 batched tokens; 1024 context; new·seq = 1024²).
func TestIterationMonotone(t *testing.T) {
	bases := []Batch{
		{},
		{DecodeSeqs: 1, DecodeContext: 10},
		{DecodeSeqs: 150, DecodeContext: 900},
		{Prefill: []Chunk{{New: 100, Seq: 900}}},
		{Prefill: []Chunk{{New: 512, Seq: 4096}}, DecodeSeqs: 20, DecodeContext: 20 * 3000},
		{Prefill: []Chunk{{New: 1000, Seq: 1040}, {New: 3, Seq: 3}}},
	}
	deltas := []int{1, 7, 33, 97, 400}
	for _, n := range Names() {
		p := mustLookup(t, n)
		for bi, base := range bases {
			for _, s := range steps {
				b := base
				prev := p.Iteration(b)
				for i := 0; i < 60; i++ {
					b = s.grow(b, deltas[i%len(deltas)])
					got := p.Iteration(b)
					if got < prev {
						t.Fatalf("%s base %d, growing %s: Iteration fell from %v to %v at %+v", n, bi, s.name, prev, got, b)
					}
					if got <= 0 && nonEmpty(b) {
						t.Fatalf("%s: Iteration(%+v) = %v, want > 0", n, b, got)
					}
					prev = got
				}
			}
		}
	}
}

func TestPrefillMonotone(t *testing.T) {
	for _, n := range Names() {
		p := mustLookup(t, n)
		for seq := 1; seq <= 20000; seq += 997 {
			prev := time.Duration(0)
			for nw := 1; nw <= seq; nw += 61 {
				got := p.Prefill(nw, seq)
				if got < prev || got <= 0 {
					t.Fatalf("%s: Prefill(%d, %d) = %v after %v", n, nw, seq, got, prev)
				}
				if more := p.Prefill(nw, seq+500); more < got {
					t.Fatalf("%s: Prefill(%d, %d) = %v < Prefill(%d, %d) = %v", n, nw, seq+500, more, nw, seq, got)
				}
				prev = got
			}
		}
	}
}

// The Mistral fit's pieces, by hand.
func TestMistralPieces(t *testing.T) {
	tests := []struct {
		n, want float64
	}{
		{1, 22}, {191, 22},
		{200, -118 + 1.25*200 - 2.56e-3*200*200},
		{300, 34.587890625}, // held at the vertex (N = 244.14)
		{383, 34.587890625},
		{384, 0.10842571*384 + 4.209777054806409},
	}
	for _, tt := range tests {
		if got := mistralLinearMS(tt.n); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("mistralLinearMS(%g) = %g, want %g", tt.n, got, tt.want)
		}
	}
	// A mixed batch: decode 12 seqs at 7267 tokens of context with one
	// 500-token chunk ending at 7000, as in the prototype's own check:
	// linear(512) + attention(12·7267 + 7000) + long(500, 7000), / 0.9.
	b := Batch{Prefill: []Chunk{{New: 500, Seq: 7000}}, DecodeSeqs: 12, DecodeContext: 12 * 7267}
	wantMS := (0.10842571*512 + 4.209777054806409 + 1.86e-4*(12*7267+7000) + 0.159 +
		1.13e-3*500 + 1.75e-3*7000 + 2.19e-6*500*7000) / 0.9
	if got := mustLookup(t, Mistral7BA6000).Iteration(b); !within(got, time.Duration(wantMS*1e6), 1e-6) {
		t.Errorf("Iteration(%+v) = %v, want %.4f ms", b, got, wantMS)
	}
}

// The 70B fit: alone, a request costs the published per-request fit; in a
// batch, the constant is paid once.
func TestLinearSharesConstant(t *testing.T) {
	p := mustLookup(t, Llama3_70BH100x2)
	a, b := p.Prefill(1000, 3000), p.Prefill(200, 5000)
	both := p.Iteration(Batch{Prefill: []Chunk{{New: 1000, Seq: 3000}, {New: 200, Seq: 5000}}})
	c0 := time.Duration(18.667 * 1e6)
	if want := a + b - c0; !within(both, want, 1e-6) {
		t.Errorf("two chunks = %v, want %v (sum less one constant)", both, want)
	}
}

func TestMarginalDecode(t *testing.T) {
	for _, n := range Names() {
		p := mustLookup(t, n)
		full := p.Iteration(Batch{DecodeSeqs: 1, DecodeContext: 2048})
		if got := MarginalDecode(p, 0, 2048); got != full {
			t.Errorf("%s: MarginalDecode(0, 2048) = %v, want the whole step %v", n, got, full)
		}
		m := MarginalDecode(p, 32, 2048)
		step := p.Iteration(Batch{DecodeSeqs: 32, DecodeContext: 32 * 2048})
		if m <= 0 || m > step/8 {
			t.Errorf("%s: MarginalDecode(32, 2048) = %v, want in (0, step/8 = %v]", n, m, step/8)
		}
	}
	// Roofline: one more sequence reads its KV: 2048·256 KiB / (2·3.35e12·0.65) s.
	want := time.Duration(math.Round(2048 * 262144 / (2 * 3.35e12 * 0.65) * 1e9))
	if got := MarginalDecode(mustLookup(t, Qwen3_32BH100x2), 32, 2048); !within(got, want, 1e-3) {
		t.Errorf("qwen MarginalDecode(32, 2048) = %v, want %v", got, want)
	}
}

// Negative and huge inputs neither panic nor give negative times.
func TestExtremeInputs(t *testing.T) {
	inputs := []int{math.MinInt, -1, 0, 1, 1 << 20, 1 << 40, math.MaxInt}
	for _, n := range Names() {
		p := mustLookup(t, n)
		for _, a := range inputs {
			for _, b := range inputs {
				if got := p.Prefill(a, b); got < 0 {
					t.Errorf("%s: Prefill(%d, %d) = %v", n, a, b, got)
				}
				if got := p.Iteration(Batch{Prefill: []Chunk{{a, b}, {b, a}}, DecodeSeqs: a, DecodeContext: b}); got < 0 {
					t.Errorf("%s: Iteration = %v", n, got)
				}
				if got := MarginalDecode(p, a, b); got < 0 {
					t.Errorf("%s: MarginalDecode(%d, %d) = %v", n, a, b, got)
				}
			}
		}
		if got := p.Prefill(math.MaxInt, math.MaxInt); got <= 0 {
			t.Errorf("%s: Prefill(MaxInt, MaxInt) = %v, want > 0 (saturated)", n, got)
		}
		if got, want := p.Prefill(-5, 100), time.Duration(0); got != want {
			t.Errorf("%s: Prefill(-5, 100) = %v, want %v", n, got, want)
		}
		// A sequence shorter than its new tokens counts as new tokens long.
		if got, want := p.Prefill(3000, -1), p.Prefill(3000, 3000); got != want {
			t.Errorf("%s: Prefill(3000, -1) = %v, want Prefill(3000, 3000) = %v", n, got, want)
		}
	}
}

func BenchmarkIteration(b *testing.B) {
	p := mustLookup(b, Qwen3_32BH100x2)
	batch := Batch{Prefill: []Chunk{{New: 512, Seq: 4096}}, DecodeSeqs: 64, DecodeContext: 64 * 2048}
	b.ReportAllocs()
	for b.Loop() {
		p.Iteration(batch)
	}
}

// TestSame: two loads of one built-in name or spec are the same profile;
// another name, another scale or nil is not.
func TestSame(t *testing.T) {
	get := func(spec string) Profile {
		p, err := Resolve(spec)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, c := range []struct {
		a, b Profile
		want bool
	}{
		{get(Llama31_8BH100), get(Llama31_8BH100), true},
		{get(Llama31_8BH100 + ":time_scale=0.5"), get(Llama31_8BH100 + ":time_scale=0.5"), true},
		{get(Mistral7BA6000), get(Mistral7BA6000), true},
		{get(Llama31_8BH100), get(Llama31_8BA100), false},
		{get(Llama31_8BH100), get(Llama31_8BH100 + ":time_scale=0.5"), false},
		{get(Llama31_8BH100 + ":time_scale=0.5"), get(Llama31_8BH100 + ":time_scale=0.25"), false},
		{get(Llama31_8BH100), nil, false},
	} {
		if got := Same(c.a, c.b); got != c.want {
			t.Errorf("Same(%v, %v) = %v, want %v", c.a, c.b, got, c.want)
		}
	}
}
