package openai

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// refTokenIDLists decodes raw with encoding/json: a list of token ids or a
// list of token-id lists, none empty, every id in [0, 2³²).
func refTokenIDLists(raw []byte) ([][]uint32, bool) {
	conv := func(in []int64) ([]uint32, bool) {
		if len(in) == 0 {
			return nil, false
		}
		out := make([]uint32, len(in))
		for i, v := range in {
			if v < 0 || v > math.MaxUint32 {
				return nil, false
			}
			out[i] = uint32(v)
		}
		return out, true
	}
	var flat []int64
	if json.Unmarshal(raw, &flat) == nil {
		ids, ok := conv(flat)
		return [][]uint32{ids}, ok
	}
	var nested [][]int64
	if json.Unmarshal(raw, &nested) != nil || len(nested) == 0 {
		return nil, false
	}
	var out [][]uint32
	for _, l := range nested {
		ids, ok := conv(l)
		if !ok {
			return nil, false
		}
		out = append(out, ids)
	}
	return out, true
}

func TestScanTokenIDLists(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want [][]uint32
		ok   bool
	}{
		{`[1,2,3]`, [][]uint32{{1, 2, 3}}, true},
		{`[ 0 , 4294967295 ]`, [][]uint32{{0, 4294967295}}, true},
		{`[[1, 2],[3]]`, [][]uint32{{1, 2}, {3}}, true},
		{`[4294967296]`, nil, false},
		{`[]`, nil, false},
		{`[[1],[]]`, nil, false},
		{`[1.0]`, nil, false},
		{`[1e3]`, nil, false},
		{`[-1]`, nil, false},
		{`[1,[2]]`, nil, false},
		{`[[1],2]`, nil, false},
		{`["a"]`, nil, false},
		{`[null]`, nil, false},
		{`[1,2]x`, nil, false},
	} {
		got, ok := scanTokenIDLists([]byte(tc.in))
		if ok != tc.ok || !slices.EqualFunc(got, tc.want, slices.Equal) {
			t.Errorf("scanTokenIDLists(%s) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

// FuzzScanTokenIDLists checks the fast scan against encoding/json: what it
// accepts, encoding/json decodes alike.
func FuzzScanTokenIDLists(f *testing.F) {
	for _, s := range []string{`[1,2,3]`, `[[1],[2,3]]`, `[ 7 ]`, `[4294967296]`, `[1.5]`, `[-0]`, `[[],[1]]`, `[01]`,
		// Ids the word-at-a-time reader takes, and ones it leaves.
		`[1234567,12345678,123456789,4294967295,0,7,65535,100000]`, `[12, 3 ,045,6,0000000,1e5,7]`,
		`[[1234567,2],[0,1234567,12345678901]]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || len(raw) == 0 || raw[0] != '[' {
			return // the caller's precondition
		}
		got, ok := scanTokenIDLists(raw)
		if !ok {
			return
		}
		want, wok := refTokenIDLists(raw)
		if !wok || !slices.EqualFunc(got, want, slices.Equal) {
			t.Fatalf("scan(%q) = %v; encoding/json: %v, %v", raw, got, want, wok)
		}
	})
}

// FuzzParseRequestFastPath checks that reading a token-id prompt directly
// (splitTokenPrompt) changes neither what ParseRequest returns nor its
// errors.
func FuzzParseRequestFastPath(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","prompt":[1,2,3],"stream":true,"max_tokens":4}`,
		`{"model":"m","prompt":[[1,2],[3]],"n":2}`,
		`{"model":"m","PROMPT":[1],"prompt":"x"}`,
		`{"model":"m","prompt":[1],"Prompt":[2, 3]}`,
		`{"prompt":[1,2],"model":"m","max_tokens":"x"}`,
		`{"model":"m","prompt":[1,2],}`,
		`{"model":"m","prompt":[1,2]} x`,
		`{"model":"m","pro\u006dpt":[5],"prompt":[1]}`,
		`{"model":"m","s":"a\"b","prompt":[7]}`,
		`{"model":"m","prompt":[1,2],"input":[3]}`,
	} {
		f.Add(uint8(1), []byte(s))
		f.Add(uint8(0), []byte(s))
	}
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		k := Kind(kind % 3)
		got, gerr := parseRequest(k, body, true)
		want, werr := parseRequest(k, body, false)
		if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
			t.Fatalf("errors differ: fast %v, encoding/json %v", gerr, werr)
		}
		if gerr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("requests differ:\nfast %+v\njson %+v", got, want)
		}
	})
}

func TestSSEFramerReady(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool // after the first event
	}{
		{"data: a\n\n", false},
		{"data: a\n\ndata: b\n\n", true},
		{"data: a\n\ndata: b\n", false},
		{"data: a\n\ndata: b\r\n\r\n", true},
		{"data: a\n\n\n", true},
		{"data: a\n\n\r\n", true},
		{"data: a\n\n: c", false},
	} {
		f := NewFramer(strings.NewReader(tc.in), 0)
		if _, err := f.Next(); err != nil {
			t.Fatalf("%q: %v", tc.in, err)
		}
		if got := f.Ready(); got != tc.want {
			t.Errorf("%q: ready() = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// TestIDWord checks the word-at-a-time integer reader (idLen,
// digitsValue) against strconv on every length and every byte after the
// digits.
func TestIDWord(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 200000 {
		var b [8]byte
		for k := range b {
			b[k] = byte(rng.IntN(256))
			if rng.IntN(4) != 0 {
				b[k] = '0' + byte(rng.IntN(10))
			}
		}
		w := binary.LittleEndian.Uint64(b[:]) ^ lanes30
		n := idLen(w)
		var v uint32
		if n > 0 {
			v = digitsValue(w, n)
		}
		want := 0
		for want < 8 && b[want] >= '0' && b[want] <= '9' {
			want++
		}
		if want == 0 || want == 8 || (want > 1 && b[0] == '0') {
			if n != 0 {
				t.Fatalf("%q: %d, %d; want n = 0", b[:], v, n)
			}
			continue
		}
		wv, _ := strconv.ParseUint(string(b[:want]), 10, 32)
		if n != want || uint64(v) != wv {
			t.Fatalf("%q: %d, %d; want %d, %d", b[:], v, n, wv, want)
		}
	}
}
