package costmodel

import (
	"errors"
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
