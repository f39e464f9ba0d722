package costmodel

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// scaledBy is d·f rounded to the nanosecond, as Scaled rounds.
func scaledBy(d time.Duration, f float64) time.Duration {
	return time.Duration(math.Round(float64(d) * f))
}

func TestResolve(t *testing.T) {
	a100File := filepath.Join("testdata", "llama3.1-8b-a100.yaml")
	tests := []struct {
		spec            string
		name            string  // want Name()
		base            string  // the built-in it must price like, scaled
		prefill, decode float64 // want factors; 1, 1 and not *Scaled when no settings
		scaled          bool
	}{
		{"llama3.1-8b-h100", "llama3.1-8b-h100", Llama31_8BH100, 1, 1, false},
		{"llama3.1-8b-h100:time_scale=0.5", "llama3.1-8b-h100:time_scale=0.5", Llama31_8BH100, 0.5, 0.5, true},
		{"mistral-7b-a6000:prefill_scale=2:decode_scale=1.5", "mistral-7b-a6000:prefill_scale=2:decode_scale=1.5", Mistral7BA6000, 2, 1.5, true},
		{"mistral-7b-a6000:decode_scale=1.5:prefill_scale=2", "mistral-7b-a6000:decode_scale=1.5:prefill_scale=2", Mistral7BA6000, 2, 1.5, true},
		{"qwen3-32b-h100x2:time_scale=2:prefill_scale=3", "qwen3-32b-h100x2:time_scale=2:prefill_scale=3", Qwen3_32BH100x2, 6, 2, true},
		{"qwen3-32b-h100x2:decode_scale=0.25:time_scale=4", "qwen3-32b-h100x2:decode_scale=0.25:time_scale=4", Qwen3_32BH100x2, 4, 1, true},
		{"llamacpp-tiny-cpu:time_scale=1", "llamacpp-tiny-cpu:time_scale=1", LlamaCppTinyCPU, 1, 1, true},
		{"llama3.1-8b-a100:time_scale=1e-3", "llama3.1-8b-a100:time_scale=1e-3", Llama31_8BA100, 1e-3, 1e-3, true},
		// Files: a path (contains "/"); the profile takes the file's name.
		{a100File, Llama31_8BA100, Llama31_8BA100, 1, 1, false},
		{a100File + ":decode_scale=2", "llama3.1-8b-a100:decode_scale=2", Llama31_8BA100, 1, 2, true},
		{"./" + a100File + ":time_scale=0.5", "llama3.1-8b-a100:time_scale=0.5", Llama31_8BA100, 0.5, 0.5, true},
	}
	probes := []Batch{
		{Prefill: []Chunk{{New: 1000, Seq: 3000}}},
		{DecodeSeqs: 32, DecodeContext: 32 * 2048},
	}
	for _, tt := range tests {
		p, err := Resolve(tt.spec)
		if err != nil {
			t.Errorf("Resolve(%q): %v", tt.spec, err)
			continue
		}
		if got := p.Name(); got != tt.name {
			t.Errorf("Resolve(%q).Name() = %q, want %q", tt.spec, got, tt.name)
		}
		s, isScaled := p.(*Scaled)
		if isScaled != tt.scaled {
			t.Errorf("Resolve(%q) is %T, want scaled %v", tt.spec, p, tt.scaled)
		}
		if isScaled {
			if a, d := s.Scales(); a != tt.prefill || d != tt.decode {
				t.Errorf("Resolve(%q).Scales() = %g, %g, want %g, %g", tt.spec, a, d, tt.prefill, tt.decode)
			}
		}
		base := mustLookup(t, tt.base)
		if got, want := p.Prefill(1000, 3000), scaledBy(base.Prefill(1000, 3000), tt.prefill); !within(got, want, 1e-4) {
			t.Errorf("Resolve(%q).Prefill(1000, 3000) = %v, want %v", tt.spec, got, want)
		}
		if got, want := p.Iteration(probes[1]), scaledBy(base.Iteration(probes[1]), tt.decode); !within(got, want, 1e-4) {
			t.Errorf("Resolve(%q).Iteration(decode) = %v, want %v", tt.spec, got, want)
		}
		if got, want := p.KVCapacity(), base.KVCapacity(); got != want {
			t.Errorf("Resolve(%q).KVCapacity() = %d, want %d", tt.spec, got, want)
		}
		if got, want := BatchingOf(p), BatchingOf(base); got != want {
			t.Errorf("Resolve(%q) batching = %+v, want %+v", tt.spec, got, want)
		}
	}
}

// A spec ending in .yaml or .yml is a file even without a "/".
func TestResolveBareFileName(t *testing.T) {
	for _, spec := range []string{"nope.yaml", "nope.yml:time_scale=2"} {
		if _, err := Resolve(spec); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("Resolve(%q) error = %v, want os.ErrNotExist", spec, err)
		}
	}
}

func TestResolveErrors(t *testing.T) {
	const known = "known keys: time_scale, prefill_scale, decode_scale"
	tests := []struct {
		spec string
		want []string // substrings of the error
		is   error
	}{
		{"gpt-5", []string{`unknown profile "gpt-5"`, "llama3.1-8b-h100"}, ErrUnknownProfile},
		{"gpt-5:time_scale=2", []string{`unknown profile "gpt-5"`}, ErrUnknownProfile},
		{"", []string{"missing profile name"}, ErrInvalidProfile},
		{":time_scale=2", []string{"missing profile name"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:", []string{`setting "" is not key=value`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale", []string{`setting "time_scale" is not key=value`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:=2", []string{`setting "=2" is not key=value`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=0.5:", []string{`setting "" is not key=value`}, ErrInvalidProfile},
		{"llama3.1-8b-h100:tme_scale=2", []string{`unknown setting "tme_scale"`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:Time_Scale=2", []string{`unknown setting "Time_Scale"`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=2:time_scale=3", []string{`setting "time_scale" given twice`, known}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=", []string{`time_scale: "" is not a number`}, ErrInvalidProfile},
		{"llama3.1-8b-h100:prefill_scale=fast", []string{`prefill_scale: "fast" is not a number`}, ErrInvalidProfile},
		{"llama3.1-8b-h100:decode_scale=0", []string{"decode_scale: must be > 0, got 0"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=-1", []string{"time_scale: must be > 0, got -1"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=NaN", []string{"time_scale: is NaN"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=+Inf", []string{"time_scale: is infinite"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=1e400", []string{"time_scale: is infinite"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=1e-400", []string{"time_scale: must be > 0, got 0"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=1e200:prefill_scale=1e200", []string{"time_scale·prefill_scale: is infinite"}, ErrInvalidProfile},
		{"llama3.1-8b-h100:time_scale=1e-200:decode_scale=1e-200", []string{"time_scale·decode_scale: must be > 0, got 0"}, ErrInvalidProfile},
		{"testdata/llama3.1-8b-a100.yaml:time_scale=x", []string{`time_scale: "x" is not a number`}, ErrInvalidProfile},
		{"testdata/nope.yaml:time_scale=2", []string{"load profile"}, os.ErrNotExist},
		{"testdata/fuzz/FuzzParse/nan", []string{"parse profile"}, nil},
	}
	for _, tt := range tests {
		p, err := Resolve(tt.spec)
		if err == nil {
			t.Errorf("Resolve(%q) = %s, want an error", tt.spec, p.Name())
			continue
		}
		if p != nil {
			t.Errorf("Resolve(%q) returned a profile and the error %v", tt.spec, err)
		}
		for _, w := range tt.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("Resolve(%q) error %q does not contain %q", tt.spec, err, w)
			}
		}
		if tt.is != nil && !errors.Is(err, tt.is) {
			t.Errorf("Resolve(%q) error %q does not wrap %v", tt.spec, err, tt.is)
		}
		if tt.is == ErrInvalidProfile && !strings.Contains(err.Error(), `"`+tt.spec+`"`) {
			t.Errorf("Resolve(%q) error %q does not quote the spec", tt.spec, err)
		}
	}
}

func TestScaleErrors(t *testing.T) {
	base := mustLookup(t, Llama31_8BH100)
	tests := []struct {
		prefill, decode float64
		want            string
	}{
		{0, 1, "prefill_scale: must be > 0, got 0"},
		{1, -2, "decode_scale: must be > 0, got -2"},
		{math.NaN(), 1, "prefill_scale: is NaN"},
		{1, math.Inf(1), "decode_scale: is infinite"},
	}
	for _, tt := range tests {
		p, err := Scale(base, tt.prefill, tt.decode)
		if err == nil || p != nil {
			t.Errorf("Scale(%g, %g) = %v, %v; want an error", tt.prefill, tt.decode, p, err)
			continue
		}
		if !strings.Contains(err.Error(), tt.want) || !errors.Is(err, ErrInvalidProfile) {
			t.Errorf("Scale(%g, %g) error = %q, want %q wrapping ErrInvalidProfile", tt.prefill, tt.decode, err, tt.want)
		}
	}
	if _, err := Scale(nil, 1, 1); !errors.Is(err, ErrInvalidProfile) {
		t.Errorf("Scale(nil) error = %v, want ErrInvalidProfile", err)
	}
}

func mustScale(t testing.TB, name string, prefill, decode float64) *Scaled {
	t.Helper()
	p, err := Scale(mustLookup(t, name), prefill, decode)
	if err != nil {
		t.Fatal(err)
	}
	return p.(*Scaled)
}

func TestScaleNameAndBase(t *testing.T) {
	s := mustScale(t, Mistral7BA6000, 2, 0.5)
	if got, want := s.Name(), "mistral-7b-a6000:prefill_scale=2:decode_scale=0.5"; got != want {
		t.Errorf("Name() = %q, want %q", got, want)
	}
	if got := s.Base().Name(); got != Mistral7BA6000 {
		t.Errorf("Base().Name() = %q", got)
	}
	if got, want := s.KVCapacity(), 198_516; got != want {
		t.Errorf("KVCapacity() = %d, want %d", got, want)
	}
	if got, want := s.Batching(), (Batching{512, 256}); got != want {
		t.Errorf("Batching() = %+v, want %+v", got, want)
	}
	// A base without Batcher: the scaled profile reports the default.
	f, err := Scale(fakeProfile{}, 2, 2)
	if err != nil {
		t.Fatal(err)
	}
	if got := BatchingOf(f); got != DefaultBatching {
		t.Errorf("BatchingOf(scaled fake) = %+v, want DefaultBatching", got)
	}
}

// On a batch of one kind of work the ratio to the base is exactly the
// factor (up to rounding to the nanosecond).
func TestScaledPureBatches(t *testing.T) {
	prefills := []Batch{
		{Prefill: []Chunk{{New: 1000, Seq: 3000}}},
		{Prefill: []Chunk{{New: 6000, Seq: 6000}}},
		{Prefill: []Chunk{{New: 512, Seq: 4096}, {New: 7, Seq: 7}}},
		{Prefill: []Chunk{{New: 1, Seq: 1}}, DecodeSeqs: -3, DecodeContext: 100}, // no decode work
	}
	decodes := []Batch{
		{DecodeSeqs: 1, DecodeContext: 2048},
		{DecodeSeqs: 32, DecodeContext: 32 * 2048},
		{DecodeSeqs: 128, DecodeContext: 128 * 2048},
		{Prefill: []Chunk{{New: 0, Seq: 900}}, DecodeSeqs: 5, DecodeContext: 50}, // no prefill work
	}
	for _, n := range Names() {
		base := mustLookup(t, n)
		for _, f := range [][2]float64{{0.5, 0.5}, {2, 1.5}, {0.1, 3}, {7, 0.01}} {
			s := mustScale(t, n, f[0], f[1])
			for _, b := range prefills {
				if got, want := s.Iteration(b), scaledBy(base.Iteration(b), f[0]); got != want {
					t.Errorf("%s: Iteration(%+v) = %v, want %g·%v = %v", s.Name(), b, got, f[0], base.Iteration(b), want)
				}
			}
			for _, b := range decodes {
				if got, want := s.Iteration(b), scaledBy(base.Iteration(b), f[1]); got != want {
					t.Errorf("%s: Iteration(%+v) = %v, want %g·%v = %v", s.Name(), b, got, f[1], base.Iteration(b), want)
				}
			}
			for _, c := range [][2]int{{1, 1}, {1000, 3000}, {6000, 6000}, {0, 100}, {-1, 5}} {
				if got, want := s.Prefill(c[0], c[1]), scaledBy(base.Prefill(c[0], c[1]), f[0]); got != want {
					t.Errorf("%s: Prefill(%d, %d) = %v, want %v", s.Name(), c[0], c[1], got, want)
				}
			}
			if got, want := s.Iteration(Batch{}), time.Duration(0); got != want {
				t.Errorf("%s: Iteration(empty) = %v, want 0", s.Name(), got)
			}
		}
	}
	// A decode step of one sequence scaled to below a nanosecond still costs 1 ns.
	s := mustScale(t, LlamaCppTinyCPU, 1e-12, 1e-12)
	if got := s.Iteration(Batch{DecodeSeqs: 1, DecodeContext: 1}); got != 1 {
		t.Errorf("tiny scale: Iteration = %v, want 1ns", got)
	}
	// A saturated base time stays saturated.
	s = mustScale(t, Qwen3_32BH100x2, 2, 2)
	if got := s.Prefill(math.MaxInt, math.MaxInt); got != time.Duration(math.MaxInt64) {
		t.Errorf("saturated: Prefill = %v, want the largest Duration", got)
	}
}

// A mixed batch: m·I + (a−m)·P + (d−m)·D with m = min(a, d), by hand.
func TestScaledMixedBatch(t *testing.T) {
	b := Batch{Prefill: []Chunk{{New: 512, Seq: 4096}}, DecodeSeqs: 64, DecodeContext: 64 * 2048}
	for _, n := range Names() {
		base := mustLookup(t, n)
		all := float64(base.Iteration(b))
		p := float64(base.Iteration(Batch{Prefill: b.Prefill}))
		d := float64(base.Iteration(Batch{DecodeSeqs: b.DecodeSeqs, DecodeContext: b.DecodeContext}))
		tests := []struct {
			a, d float64
			want float64 // ns
		}{
			{1, 1, all},
			{0.5, 0.5, 0.5 * all},
			{3, 3, 3 * all},
			{2, 1, all + p},         // 1·I + 1·P
			{1, 2, all + d},         // 1·I + 1·D
			{0.5, 1.5, 0.5*all + d}, // 0.5·I + 1·D
			{4, 0.25, 0.25*all + 3.75*p},
		}
		for _, tt := range tests {
			s := mustScale(t, n, tt.a, tt.d)
			got := s.Iteration(b)
			if want := time.Duration(math.Round(tt.want)); !within(got, want, 1e-9) {
				t.Errorf("%s: Iteration(mixed) = %v, want %v", s.Name(), got, want)
			}
			lo, hi := math.Min(tt.a, tt.d)*all, math.Max(tt.a, tt.d)*all
			if g := float64(got); g < lo-1 || g > hi+1 {
				t.Errorf("%s: Iteration(mixed) = %v, want in [%v, %v]", s.Name(), got, time.Duration(lo), time.Duration(hi))
			}
			if g := float64(got); g+1 < tt.a*p || g+1 < tt.d*d {
				t.Errorf("%s: Iteration(mixed) = %v below a part alone (a·P = %v, d·D = %v)", s.Name(), got, time.Duration(tt.a*p), time.Duration(tt.d*d))
			}
		}
	}
}

// Adding a cheap prefill chunk to a decode batch never makes it faster,
// even with a small prefill factor (the share-weighted form would roughly
// halve it).
func TestScaledCheapChunkDoesNotSpeedUp(t *testing.T) {
	for _, n := range Names() {
		s := mustScale(t, n, 0.01, 1)
		decode := Batch{DecodeSeqs: 32, DecodeContext: 32 * 2048}
		mixed := decode
		mixed.Prefill = []Chunk{{New: 1, Seq: 1}}
		if a, b := s.Iteration(decode), s.Iteration(mixed); b < a {
			t.Errorf("%s: decode batch %v, with one more prefill token %v", s.Name(), a, b)
		}
	}
}

// Scaled is monotone in every input, like every profile, for factors far
// apart in both directions.
func TestScaledIterationMonotone(t *testing.T) {
	bases := []Batch{
		{},
		{DecodeSeqs: 1, DecodeContext: 10},
		{DecodeSeqs: 150, DecodeContext: 900},
		{Prefill: []Chunk{{New: 100, Seq: 900}}},
		{Prefill: []Chunk{{New: 512, Seq: 4096}}, DecodeSeqs: 20, DecodeContext: 20 * 3000},
	}
	deltas := []int{1, 7, 33, 97, 400}
	for _, n := range Names() {
		for _, f := range [][2]float64{{0.5, 0.5}, {0.01, 1}, {1, 0.01}, {100, 0.3}, {0.3, 100}} {
			p := mustScale(t, n, f[0], f[1])
			for bi, base := range bases {
				for _, st := range steps {
					b := base
					prev := p.Iteration(b)
					for i := 0; i < 40; i++ {
						b = st.grow(b, deltas[i%len(deltas)])
						got := p.Iteration(b)
						if got < prev {
							t.Fatalf("%s base %d, growing %s: Iteration fell from %v to %v at %+v", p.Name(), bi, st.name, prev, got, b)
						}
						if got <= 0 && nonEmpty(b) {
							t.Fatalf("%s: Iteration(%+v) = %v, want > 0", p.Name(), b, got)
						}
						prev = got
					}
				}
			}
		}
	}
}

// E2's marginal decode cost scales with the decode factor.
func TestScaledMarginalDecode(t *testing.T) {
	base := mustLookup(t, Llama31_8BH100)
	s := mustScale(t, Llama31_8BH100, 1, 2)
	if got, want := MarginalDecode(s, 32, 2048), 2*MarginalDecode(base, 32, 2048); !within(got, want, 1e-6) {
		t.Errorf("MarginalDecode(decode_scale=2) = %v, want %v", got, want)
	}
}
