package kvevents

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

var update = flag.Bool("update", false, "rewrite the golden fixtures in testdata/")

func i64(v int64) *int64   { return &v }
func str(s string) *string { return &s }

// sampleBatch uses every field, so each fixture variant drops a known part.
func sampleBatch() Batch {
	return Batch{
		TS: 1767225600.25,
		Events: []Event{
			BlockStored{
				BlockHashes: []uint64{0x8000000000000001, 42},
				TokenIDs:    []uint32{1, 2, 3, 4, 128000, 65536, 7, 8},
				BlockSize:   4,
				Medium:      MediumGPU,
			},
			BlockStored{
				BlockHashes: []uint64{7},
				ParentHash:  42, HasParent: true,
				TokenIDs:                 []uint32{9, 10, 11, 12},
				BlockSize:                4,
				LoRAID:                   i64(3),
				Medium:                   MediumCPU,
				LoRAName:                 str("sql-adapter"),
				ExtraKeys:                []byte{0x91, 0xc0}, // [nil]
				GroupIdx:                 i64(1),
				KVCacheSpecKind:          str("sliding_window"),
				KVCacheSpecSlidingWindow: i64(4096),
			},
			BlockRemoved{BlockHashes: []uint64{7}, Medium: MediumCPU, GroupIdx: i64(1)},
			AllBlocksCleared{},
		},
		DataParallelRank: i64(0),
	}
}

// truncated is what a decoder sees of b when events carry only the first
// storedFields/removedFields fields (0: all).
func truncated(b Batch, storedFields, removedFields int) Batch {
	out := b
	out.Events = nil
	for _, ev := range b.Events {
		switch e := ev.(type) {
		case BlockStored:
			if storedFields > 0 {
				kept := BlockStored{BlockHashes: e.BlockHashes, ParentHash: e.ParentHash, HasParent: e.HasParent}
				ptrs := []func(){
					func() { kept.TokenIDs = e.TokenIDs },
					func() { kept.BlockSize = e.BlockSize },
					func() { kept.LoRAID = e.LoRAID },
					func() { kept.Medium = e.Medium },
					func() { kept.LoRAName = e.LoRAName },
					func() { kept.ExtraKeys = e.ExtraKeys },
					func() { kept.GroupIdx = e.GroupIdx },
					func() { kept.KVCacheSpecKind = e.KVCacheSpecKind },
					func() { kept.KVCacheSpecSlidingWindow = e.KVCacheSpecSlidingWindow },
				}
				for i := 0; i < storedFields-2 && i < len(ptrs); i++ {
					ptrs[i]()
				}
				e = kept
			}
			out.Events = append(out.Events, e)
		case BlockRemoved:
			if removedFields > 0 {
				kept := BlockRemoved{BlockHashes: e.BlockHashes}
				if removedFields >= 2 {
					kept.Medium = e.Medium
				}
				if removedFields >= 3 {
					kept.GroupIdx = e.GroupIdx
				}
				e = kept
			}
			out.Events = append(out.Events, e)
		default:
			out.Events = append(out.Events, ev)
		}
	}
	return out
}

type fixture struct {
	name string
	opts EncodeOptions
}

// fixtures covers each encoding, each hash form and each field count vLLM has
// published: BlockStored with 5 (lora_id), 6 (+medium), 7 (+lora_name),
// 8 (+extra_keys), 9 (+group_idx) and 11 (+kv_cache_spec_*) fields;
// BlockRemoved with 1, 2 and 3.
var fixtures = []fixture{
	{"array_uint64", EncodeOptions{Encoding: EncodingArray}},
	{"array_int64", EncodeOptions{Encoding: EncodingArray, Hashes: HashInt64}},
	{"array_bytes32", EncodeOptions{Encoding: EncodingArray, Hashes: HashBytes}},
	{"array_str32", EncodeOptions{Encoding: EncodingArray, Hashes: HashString}},
	{"array_stored5_removed1", EncodeOptions{Encoding: EncodingArray, StoredFields: 5, RemovedFields: 1}},
	{"array_stored6_removed2", EncodeOptions{Encoding: EncodingArray, StoredFields: 6, RemovedFields: 2}},
	{"array_stored7", EncodeOptions{Encoding: EncodingArray, StoredFields: 7}},
	{"array_stored8", EncodeOptions{Encoding: EncodingArray, StoredFields: 8}},
	{"array_stored9", EncodeOptions{Encoding: EncodingArray, StoredFields: 9}},
	{"map_uint64", EncodeOptions{Encoding: EncodingMap}},
	{"map_int64", EncodeOptions{Encoding: EncodingMap, Hashes: HashInt64}},
	{"map_bytes32", EncodeOptions{Encoding: EncodingMap, Hashes: HashBytes}},
	{"map_stored5_removed1", EncodeOptions{Encoding: EncodingMap, StoredFields: 5, RemovedFields: 1}},
	{"map_stored7_removed2", EncodeOptions{Encoding: EncodingMap, StoredFields: 7, RemovedFields: 2}},
}

func TestGoldenFixtures(t *testing.T) {
	for _, fx := range fixtures {
		t.Run(fx.name, func(t *testing.T) {
			got, err := EncodeBatchOptions(sampleBatch(), fx.opts)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata", fx.name+".msgpack")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("encoding changed from %s (run with -update if intended)", path)
			}
			dec, err := DecodeBatch(want)
			if err != nil {
				t.Fatal(err)
			}
			if w := truncated(sampleBatch(), fx.opts.StoredFields, fx.opts.RemovedFields); !reflect.DeepEqual(dec, w) {
				t.Errorf("decode %s:\n got %+v\nwant %+v", path, dec, w)
			}
		})
	}
}

// TestHandCheckedFixture pins one small batch to bytes read off the msgpack
// spec (github.com/msgpack/msgpack/blob/master/spec.md), independently of the
// encoder, in vLLM's array layout:
//
//	93                      fixarray(3): [ts, events, dp_rank]
//	cb 41 d0 00 00 00 00 00 00   float64 1073741824.0 (2^30)
//	91                      fixarray(1): events
//	  97                    fixarray(7): BlockStored + 6 fields
//	    ab 42 6c 6f 63 6b 53 74 6f 72 65 64   fixstr(11) "BlockStored"
//	    91 cf ff ff ff ff ff ff ff fe         [uint64 0xfffffffffffffffe]
//	    c0                  parent_block_hash nil
//	    92 01 cd 01 00      token_ids [1, 256] (fixint, uint16)
//	    02                  block_size 2
//	    c0                  lora_id nil
//	    a3 47 50 55         medium fixstr(3) "GPU"
//	  00                    data_parallel_rank 0
func TestHandCheckedFixture(t *testing.T) {
	raw := []byte{
		0x93,
		0xcb, 0x41, 0xd0, 0, 0, 0, 0, 0, 0,
		0x91,
		0x97,
		0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd',
		0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe,
		0xc0,
		0x92, 0x01, 0xcd, 0x01, 0x00,
		0x02,
		0xc0,
		0xa3, 'G', 'P', 'U',
		0x00,
	}
	want := Batch{
		TS: 1 << 30,
		Events: []Event{BlockStored{
			BlockHashes: []uint64{0xfffffffffffffffe},
			TokenIDs:    []uint32{1, 256},
			BlockSize:   2,
			Medium:      MediumGPU,
		}},
		DataParallelRank: i64(0),
	}
	got, err := DecodeBatch(raw)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
	enc, err := EncodeBatchOptions(want, EncodeOptions{Encoding: EncodingArray, StoredFields: 6})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(enc, raw) {
		t.Errorf("encoder disagrees with the hand-built bytes:\n got % x\nwant % x", enc, raw)
	}
}

// mp encodes a value with the reference encoder, for hand-shaped payloads.
func mp(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeVariants(t *testing.T) {
	digest := make([]byte, 32)
	for i := range digest {
		digest[i] = byte(i)
	}
	const folded = 0x18191a1b1c1d1e1f // digest[24:32] big-endian
	stored := func(hashes []uint64, parent *uint64, tokens []uint32, bs int, medium string) BlockStored {
		s := BlockStored{BlockHashes: hashes, TokenIDs: tokens, BlockSize: bs, Medium: medium}
		if parent != nil {
			s.ParentHash, s.HasParent = *parent, true
		}
		return s
	}
	p := func(v uint64) *uint64 { return &v }
	tests := []struct {
		name    string
		payload any
		want    Batch
	}{
		{
			name:    "array batch without dp rank",
			payload: []any{1.5, []any{[]any{"BlockStored", []any{uint64(1)}, nil, []any{5, 6}, 2, nil, "GPU", nil}}},
			want:    Batch{TS: 1.5, Events: []Event{stored([]uint64{1}, nil, []uint32{5, 6}, 2, MediumGPU)}},
		},
		{
			name: "map batch, map events, type not first, unknown keys",
			payload: map[string]any{"ts": 2.0, "future": []any{1}, "events": []any{
				map[string]any{"block_hashes": []any{int64(-1)}, "type": "BlockRemoved", "medium": "CPU", "new_field": map[string]any{"x": 1}},
			}, "data_parallel_rank": 3},
			want: Batch{TS: 2, Events: []Event{BlockRemoved{BlockHashes: []uint64{0xffffffffffffffff}, Medium: MediumCPU}}, DataParallelRank: i64(3)},
		},
		{
			name:    "negative int64 hashes and parent",
			payload: []any{0, []any{[]any{"BlockStored", []any{int64(-2)}, int64(-3), []any{1}, 1}}},
			want:    Batch{Events: []Event{stored([]uint64{0xfffffffffffffffe}, p(0xfffffffffffffffd), []uint32{1}, 1, "")}},
		},
		{
			name:    "32-byte bin and str hashes",
			payload: []any{0, []any{[]any{"BlockStored", []any{digest, string(digest)}, digest, []any{1, 2}, 1}}},
			want:    Batch{Events: []Event{stored([]uint64{folded, folded}, p(folded), []uint32{1, 2}, 1, "")}},
		},
		{
			name:    "minimal BlockStored: hashes, parent, tokens",
			payload: []any{0, []any{[]any{"BlockStored", []any{1}, nil, []any{9}}}},
			want:    Batch{Events: []Event{stored([]uint64{1}, nil, []uint32{9}, 0, "")}},
		},
		{
			name:    "BlockRemoved with hashes only",
			payload: []any{0, []any{[]any{"BlockRemoved", []any{1, 2}}}},
			want:    Batch{Events: []Event{BlockRemoved{BlockHashes: []uint64{1, 2}}}},
		},
		{
			name:    "unknown event types skipped and counted, extra trailing fields ignored",
			payload: []any{0, []any{[]any{"BlockPinned", []any{"weird"}}, map[string]any{"type": "Future", "block_hashes": "not a list"}, []any{"AllBlocksCleared", 1, 2}, []any{"BlockRemoved", []any{1}, "GPU", 0, "extra"}}},
			want:    Batch{Events: []Event{AllBlocksCleared{}, BlockRemoved{BlockHashes: []uint64{1}, Medium: MediumGPU, GroupIdx: i64(0)}}, Unknown: 2},
		},
		{
			name:    "integer timestamp, nil events",
			payload: []any{7, nil},
			want:    Batch{TS: 7},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DecodeBatch(mp(t, tt.payload))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestDecodeErrors(t *testing.T) {
	deep := bytes.Repeat([]byte{0x91}, 10000)
	tests := []struct {
		name    string
		payload []byte
	}{
		{"empty", nil},
		{"scalar", []byte{0x01}},
		{"short array", mp(t, []any{1.0})},
		{"events not a list", mp(t, []any{1.0, "x"})},
		{"event not a list or map", mp(t, []any{1.0, []any{5}})},
		{"empty event", mp(t, []any{1.0, []any{[]any{}}})},
		{"map event without type", mp(t, []any{1.0, []any{map[string]any{"block_hashes": []any{1}}}})},
		{"negative token", mp(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{-1}, 1}}})},
		{"token over uint32", mp(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1 << 40}, 1}}})},
		{"float hash", mp(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1.5}}}})},
		{"truncated", mp(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1, 2}}}})[:12]},
		{"huge array header", []byte{0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"trailing bytes", append(mp(t, []any{1.0, nil}), 0x00)},
		{"deep nesting in extra_keys", append(append([]byte{0x92, 0x00, 0x91, 0x99, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd',
			0x91, 0x01, 0xc0, 0x91, 0x01, 0x01, 0xc0, 0xc0, 0xc0}, deep...), 0xc0)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeBatch(tt.payload)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
		})
	}
}

func TestRoundTrip(t *testing.T) {
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		for _, h := range []HashFormat{HashUint64, HashInt64, HashBytes, HashString} {
			b := sampleBatch()
			payload, err := EncodeBatchOptions(b, EncodeOptions{Encoding: enc, Hashes: h})
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeBatch(payload)
			if err != nil {
				t.Fatalf("%v/%v: %v", enc, h, err)
			}
			if !reflect.DeepEqual(got, b) {
				t.Errorf("%v/%v:\n got %+v\nwant %+v", enc, h, got, b)
			}
		}
	}
}

func TestFoldHash(t *testing.T) {
	tests := []struct {
		in   []byte
		want uint64
	}{
		{nil, 0},
		{[]byte{1, 2}, 0x0102},
		{[]byte{1, 2, 3, 4, 5, 6, 7, 8}, 0x0102030405060708},
		{append(bytes.Repeat([]byte{0xaa}, 24), 0, 0, 0, 0, 0, 0, 1, 0), 0x100},
	}
	for _, tt := range tests {
		if got := FoldHash(tt.in); got != tt.want {
			t.Errorf("FoldHash(% x) = %#x, want %#x", tt.in, got, tt.want)
		}
	}
	if got := FoldHash(digest32(12345)); got != 12345 {
		t.Errorf("FoldHash(digest32(12345)) = %d", got)
	}
}

func FuzzDecodeBatch(f *testing.F) {
	for _, fx := range fixtures {
		if b, err := EncodeBatchOptions(sampleBatch(), fx.opts); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte{0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := DecodeBatch(payload)
		if err != nil {
			return
		}
		// Whatever decodes re-encodes, and decodes to the same batch.
		for _, enc := range []Encoding{EncodingArray, EncodingMap} {
			again, err := EncodeBatch(b, enc)
			if err != nil {
				t.Fatalf("re-encode %v: %v", enc, err)
			}
			b2, err := DecodeBatch(again)
			if err != nil {
				t.Fatalf("decode re-encoded %v: %v", enc, err)
			}
			b.Unknown, b2.Unknown = 0, 0
			if b.TS == b.TS && !reflect.DeepEqual(b, b2) { // NaN never equals
				t.Fatalf("%v round trip:\n got %+v\nwant %+v", enc, b2, b)
			}
		}
	})
}
