package costmodel

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// FuzzParse feeds arbitrary bytes to Parse: it must not panic, and whatever
// it accepts must be a valid profile whose times are never negative.
// Seeds: testdata/fuzz/FuzzParse.
func FuzzParse(f *testing.F) {
	f.Add([]byte(goodLinear))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data)
		if err != nil {
			if p != nil {
				t.Fatalf("Parse returned a profile and the error %v", err)
			}
			return
		}
		c, cerr := ParseConfig(data)
		if cerr != nil || errors.Is(c.Validate(), ErrInvalidProfile) {
			t.Fatalf("Parse accepted a config that ParseConfig/Validate reject: %v", cerr)
		}
		if p.Name() == "" || p.KVCapacity() <= 0 {
			t.Fatalf("accepted profile %q with KV capacity %d", p.Name(), p.KVCapacity())
		}
		if b := BatchingOf(p); b.MaxSeqs <= 0 || b.MaxBatchedTokens < b.MaxSeqs {
			t.Fatalf("accepted profile %q with batching %+v", p.Name(), b)
		}
		for _, b := range []Batch{
			{Prefill: []Chunk{{New: 1000, Seq: 3000}}},
			{DecodeSeqs: 64, DecodeContext: 1 << 20},
			{Prefill: []Chunk{{New: 1 << 40, Seq: 1 << 50}}, DecodeSeqs: 1 << 30, DecodeContext: 1 << 62},
		} {
			if got := p.Iteration(b); got <= 0 {
				t.Fatalf("%s: Iteration(%+v) = %v, want > 0", p.Name(), b, got)
			}
		}
		if got := MarginalDecode(p, 10, 1000); got < 0 {
			t.Fatalf("MarginalDecode = %v", got)
		}
	})
}

// FuzzResolveSettings feeds arbitrary settings after a built-in name to
// Resolve: it must not panic, reject only with ErrInvalidProfile, and
// whatever it accepts has finite factors > 0 and prices every non-empty
// batch above 0. (Names with "/" or .yaml would read files;
// the fuzzer keeps to built-ins.)
func FuzzResolveSettings(f *testing.F) {
	for _, s := range []string{"time_scale=0.5", "prefill_scale=2:decode_scale=1.5", "time_scale=1e-300:prefill_scale=1e300",
		"decode_scale=0", "time_scale=2:time_scale=2", "x=1", "", "time_scale"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, settings string) {
		if strings.ContainsAny(settings, "/") {
			return
		}
		p, err := Resolve(Llama31_8BH100 + ":" + settings)
		if err != nil {
			if p != nil || !errors.Is(err, ErrInvalidProfile) {
				t.Fatalf("Resolve: %v, %v; want only an error wrapping ErrInvalidProfile", p, err)
			}
			return
		}
		s, ok := p.(*Scaled)
		if !ok {
			t.Fatalf("Resolve with settings returned %T", p)
		}
		if a, d := s.Scales(); !(a > 0 && d > 0) || math.IsInf(a, 0) || math.IsInf(d, 0) {
			t.Fatalf("accepted factors %g, %g", a, d)
		}
		for _, b := range []Batch{
			{Prefill: []Chunk{{New: 1000, Seq: 3000}}},
			{DecodeSeqs: 64, DecodeContext: 1 << 20},
			{Prefill: []Chunk{{New: 1 << 40, Seq: 1 << 50}}, DecodeSeqs: 1 << 30, DecodeContext: 1 << 62},
		} {
			if got := p.Iteration(b); got <= 0 {
				t.Fatalf("%s: Iteration(%+v) = %v, want > 0", p.Name(), b, got)
			}
		}
	})
}
