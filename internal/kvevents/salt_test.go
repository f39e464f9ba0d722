package kvevents

import (
	"reflect"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/vmihailenco/msgpack/v5"
)

// TestSaltVariants reads the salt from each shape of extra_keys vLLM
// sends: per block None or a tuple of lora_name, multimodal (identifier,
// offset) tuples, the salt (first block only) and prompt-embedding bytes.
func TestSaltVariants(t *testing.T) {
	lora := "sql-lora"
	emb := []byte{1, 2, 3}
	tests := []struct {
		name  string
		extra any // nil: extra_keys absent
		lora  *string
		want  string
		ok    bool
	}{
		{"absent", nil, nil, "", true},
		{"all None", []any{nil, nil}, nil, "", true},
		{"empty list", []any{}, nil, "", true},
		{"salt", []any{[]any{"s1"}, nil}, nil, "s1", true},
		{"lora and salt", []any{[]any{lora, "s1"}, []any{lora}}, &lora, "s1", true},
		{"lora only", []any{[]any{lora}, []any{lora}}, &lora, "", true},
		{"salt equal to the lora name", []any{[]any{lora, lora}}, &lora, lora, true},
		{"multimodal, salt, embeds", []any{[]any{lora, []any{"mm-hash", 0}, "s2", emb}}, &lora, "s2", true},
		{"multimodal only", []any{[]any{[]any{"mm-hash", 3}}}, nil, "", true},
		{"multimodal and embeds", []any{[]any{[]any{"mm-hash", 3}, emb}}, nil, "", true},
		{"embeds only", []any{[]any{emb}}, nil, "", true},
		{"old lora_id key", []any{[]any{3}}, nil, "", true},
		// Releases with bare multimodal identifiers: kept apart, a miss.
		{"old multimodal str", []any{[]any{"mm-hash"}}, nil, "mm-hash", true},
		{"not a list", 5, nil, "", false},
		{"a block not a tuple", []any{"s1"}, nil, "", false},
		{"a map", map[string]any{"a": 1}, nil, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := BlockStored{LoRAName: tt.lora}
			if tt.extra != nil {
				s.ExtraKeys = mp(t, tt.extra)
			}
			got, ok := s.Salt()
			if got != tt.want || ok != tt.ok {
				t.Errorf("Salt() = %q, %v; want %q, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

// TestExtraKeysRoundTrip: ExtraKeys writes vLLM's shape, which survives
// both event encodings and gives back its salt.
func TestExtraKeysRoundTrip(t *testing.T) {
	tests := []struct {
		blocks      int
		lora, salt  string
		first       bool
		want        any
		wantPresent bool
	}{
		{3, "l", "s", true, []any{[]any{"l", "s"}, []any{"l"}, []any{"l"}}, true},
		{2, "", "s", true, []any{[]any{"s"}, nil}, true},
		{2, "l", "s", false, []any{[]any{"l"}, []any{"l"}}, true},
		{2, "", "s", false, nil, false},
		{2, "", "", true, nil, false},
	}
	for _, tt := range tests {
		raw := ExtraKeys(tt.blocks, tt.lora, tt.salt, tt.first)
		if (raw != nil) != tt.wantPresent {
			t.Fatalf("%+v: extra_keys present %v", tt, raw != nil)
		}
		if raw == nil {
			continue
		}
		var got any
		if err := msgpack.Unmarshal(raw, &got); err != nil || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%+v: %#v, %v; want %#v", tt, got, err, tt.want)
		}
		var lora *string
		if tt.lora != "" {
			lora = &tt.lora
		}
		ev := BlockStored{BlockHashes: make([]uint64, tt.blocks), TokenIDs: make([]uint32, 4*tt.blocks), BlockSize: 4,
			LoRAName: lora, ExtraKeys: raw}
		for _, enc := range []Encoding{EncodingArray, EncodingMap} {
			payload, err := EncodeBatch(Batch{TS: 1, Events: []Event{ev}}, enc)
			if err != nil {
				t.Fatal(err)
			}
			b, err := DecodeBatch(payload)
			if err != nil {
				t.Fatal(err)
			}
			s := b.Events[0].(BlockStored)
			wantSalt := tt.salt
			if !tt.first {
				wantSalt = ""
			}
			if got, ok := s.Salt(); got != wantSalt || !ok {
				t.Errorf("%+v %v: decoded salt %q, %v; want %q", tt, enc, got, ok, wantSalt)
			}
		}
	}
}

// TestIndexSaltedSeeds: a salted prompt's blocks land under its salt's
// keys (those of a request with that salt), its later blocks follow them,
// and nothing of it lands under the unsalted keys or another salt's;
// extra keys the index cannot read keep their blocks apart from all.
func TestIndexSaltedSeeds(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	prompt := toks(100, 12)
	lora := "sql-lora"
	mustApply(t, ix, "r", sink,
		BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: prompt[:8], BlockSize: 4, ExtraKeys: ExtraKeys(2, "", "a", true)},
		BlockStored{BlockHashes: []uint64{3}, ParentHash: 2, HasParent: true, TokenIDs: prompt[8:], BlockSize: 4},
		BlockStored{BlockHashes: []uint64{11, 12}, TokenIDs: prompt[:8], BlockSize: 4, ExtraKeys: ExtraKeys(2, "", "b", true)},
		BlockStored{BlockHashes: []uint64{21}, TokenIDs: prompt[:4], BlockSize: 4},
		BlockStored{BlockHashes: []uint64{31}, TokenIDs: prompt[:4], BlockSize: 4, LoRAName: &lora, ExtraKeys: ExtraKeys(1, lora, "a", true)},
		BlockStored{BlockHashes: []uint64{41}, TokenIDs: prompt[:4], BlockSize: 4, ExtraKeys: []byte{0x05}},
	)
	a := blocks.SeededKeys(nil, blocks.ChainSeed("", "a"), prompt, 4)
	b := blocks.SeededKeys(nil, blocks.ChainSeed("", "b"), prompt, 4)
	base := blocks.Keys(nil, prompt, 4)
	la := blocks.SeededKeys(nil, blocks.ChainSeed(lora, "a"), prompt, 4)
	for h, want := range map[uint64]blocks.Key{1: a[0], 2: a[1], 3: a[2], 11: b[0], 12: b[1], 21: base[0], 31: la[0]} {
		if got, ok := ix.Lookup("r", "", h); !ok || got != want {
			t.Errorf("Lookup(%d) = %v, %v; want %v", h, got, ok, want)
		}
	}
	got, ok := ix.Lookup("r", "", 41)
	if !ok {
		t.Fatal("a block with unreadable extra keys was dropped")
	}
	for _, k := range []blocks.Key{a[0], b[0], base[0], la[0]} {
		if got == k {
			t.Errorf("a block with unreadable extra keys took a request's key %v", k)
		}
	}
}

// FuzzSalt holds BlockStored.Salt to a reference built on the generic
// msgpack decoder, and to never panicking.
func FuzzSalt(f *testing.F) {
	for _, v := range []any{
		[]any{[]any{"s1"}, nil}, []any{[]any{"sql-lora", []any{"mm", 0}, "s2", []byte{1}}}, []any{nil},
		[]any{"x"}, 5, []any{[]any{[]any{[]any{[]any{}}}}},
	} {
		b, _ := msgpack.Marshal(v)
		f.Add(b, "sql-lora")
	}
	f.Fuzz(func(t *testing.T, raw []byte, lora string) {
		s := BlockStored{ExtraKeys: raw}
		if lora != "" {
			s.LoRAName = &lora
		}
		got, ok := s.Salt()
		if len(raw) == 0 {
			if got != "" || !ok {
				t.Fatalf("no extra keys: %q, %v", got, ok)
			}
			return
		}
		// The reference sizes maps and lists from their headers: give it
		// only values whose headers the payload can hold.
		r := decoderPool.Get().(*decoder)
		r.reset(raw)
		err := r.skip(1)
		r.reset(nil)
		decoderPool.Put(r)
		var v any
		if err != nil || msgpack.Unmarshal(raw, &v) != nil {
			return // the reference cannot read it either: only no panic
		}
		want, wok := refSalt(v, s.LoRAName)
		if got != want || ok != wok {
			t.Fatalf("Salt(% x) = %q, %v; reference %q, %v", raw, got, ok, want, wok)
		}
	})
}

// refSalt is BlockStored.Salt on a generically decoded value.
func refSalt(v any, lora *string) (string, bool) {
	if v == nil {
		return "", true
	}
	list, ok := v.([]any)
	if !ok {
		return "", false
	}
	if len(list) == 0 || list[0] == nil {
		return "", true
	}
	tuple, ok := list[0].([]any)
	if !ok {
		return "", false
	}
	if lora != nil && len(tuple) > 0 {
		if s, ok := tuple[0].(string); ok && s == *lora {
			tuple = tuple[1:]
		}
	}
	for len(tuple) > 0 {
		if _, ok := tuple[len(tuple)-1].([]byte); !ok {
			break
		}
		tuple = tuple[:len(tuple)-1]
	}
	if len(tuple) == 0 {
		return "", true
	}
	s, ok := tuple[len(tuple)-1].(string)
	if !ok {
		return "", true
	}
	return s, true
}
