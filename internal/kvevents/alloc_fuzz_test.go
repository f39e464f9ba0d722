package kvevents

import (
	"runtime"
	"testing"
)

// FuzzDecodeBatchAllocs checks that decoding allocates in proportion to the
// payload, whatever lengths its headers declare: a hostile publisher must not
// make the router allocate (or keep, in the pooled decoders) more than the
// batch it sent. The bound is loose (64 bytes a payload byte, plus 64 KiB);
// a declared string, bin or ext of 4 GiB in a 20-byte payload used to cost a
// megabyte or more per batch, kept and grown in the pooled decoder.
func FuzzDecodeBatchAllocs(f *testing.F) {
	for _, fx := range fixtures {
		if b, err := EncodeBatchOptions(sampleBatch(), fx.opts); err == nil {
			f.Add(b)
		}
	}
	// [ts, [["X", bin32 of 0xffffffff bytes]]]: an unknown event whose field
	// is skipped.
	f.Add([]byte("\x92\x00\x91\x92\xa1X\xc6\xff\xff\xff\xff"))
	f.Add([]byte("\x92\x00\x91\x92\xa1X\xdb\xff\xff\xff\xff"))     // str32
	f.Add([]byte("\x92\x00\x91\x92\xa1X\xc9\xff\xff\xff\xff\x01")) // ext32
	f.Fuzz(func(t *testing.T, payload []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range 4 { // the pooled decoder is reused: growth would compound
			_, _ = DecodeBatch(payload)
		}
		runtime.ReadMemStats(&after)
		if got, limit := after.TotalAlloc-before.TotalAlloc, uint64(4*(64*len(payload)+64<<10)); got > limit {
			t.Fatalf("decoding %d bytes 4 times allocated %d bytes (limit %d)", len(payload), got, limit)
		}
	})
}
