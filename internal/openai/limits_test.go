package openai

import (
	"errors"
	"runtime"
	"strings"
	"testing"
)

// nested is a chat body whose tools nest depth levels deep (the body's
// object and the tools list count: depth ≥ 2).
func nested(depth int) string {
	return `{"model":"m","messages":[{"role":"user","content":"x"}],"tools":` +
		strings.Repeat("[", depth-1) + strings.Repeat("]", depth-1) + `}`
}

// partsBody is a chat body of msgs messages of per content parts each.
func partsBody(msgs, per int) string {
	part := strings.Repeat(`{"type":"text","text":"p"},`, per)
	msg := `{"role":"user","content":[` + part[:len(part)-1] + `]},`
	all := strings.Repeat(msg, msgs)
	return `{"model":"m","messages":[` + all[:len(all)-1] + `]}`
}

// deepArgs is a chat body with a tool call whose arguments (a string)
// hold JSON that opens depth lists.
func deepArgs(depth int, close bool) string {
	args := strings.Repeat("[", depth)
	if close {
		args += strings.Repeat("]", depth)
	}
	return `{"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"` + args + `"}}]}]}`
}

// TestParseLimits: a body at each limit parses; one over it is a 400
// (ErrBadRequest) that names the limit, and the encoding/json reference
// agrees (compareParse).
func TestParseLimits(t *testing.T) {
	for _, c := range []struct {
		name, body string
		want       string // "" parses
	}{
		{"messages at the limit", string(chatBodyManySmall(MaxMessages)), ""},
		{"messages over the limit", string(chatBodyManySmall(MaxMessages + 1)), "messages holds 10001 messages, more than the 10000 allowed"},
		{"parts at the limit", partsBody(MaxContentParts/50, 50), ""},
		{"parts over the limit", partsBody(MaxContentParts/50+1, 50), "messages hold 100050 content parts, more than the 100000 allowed"},
		{"parts over the limit in one message", partsBody(1, MaxContentParts+1), "messages hold 100001 content parts"},
		{"nesting at the limit", nested(MaxNesting), ""},
		{"nesting over the limit", nested(MaxNesting + 1), "request body nests 129 levels deep, more than the 128 allowed"},
		{"arguments at the limit", deepArgs(MaxNesting, true), ""},
		{"arguments over the limit", deepArgs(MaxNesting+1, true), "messages[1].tool_calls[0].function.arguments nests more than the 128 levels allowed"},
		{"unclosed arguments over the limit", deepArgs(4<<20, false), "function.arguments nests more than"},
		// A syntax error wins over a limit, as over any decoding.
		{"syntax error after too many messages", string(chatBodyManySmall(MaxMessages+1)) + "x", "malformed JSON"},
	} {
		t.Run(c.name, func(t *testing.T) {
			body := []byte(c.body)
			_, err := ParseRequest(KindChat, body)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("error %v, want none", err)
			case c.want != "" && (err == nil || !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("error %v, want ErrBadRequest with %q", err, c.want)
			}
			if len(body) < 8<<20 { // the reference is slow on the 4 MiB one
				compareParse(t, KindChat, body)
			}
		})
	}
}

// allocPerByte is the bytes ParseRequest allocates per byte of body.
func allocPerByte(t *testing.T, body []byte) float64 {
	t.Helper()
	if _, err := ParseRequest(KindChat, body); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 5
	for range runs {
		if _, err := ParseRequest(KindChat, body); err != nil {
			t.Fatal(err)
		}
	}
	runtime.ReadMemStats(&after)
	return float64(after.TotalAlloc-before.TotalAlloc) / runs / float64(len(body))
}

// TestParseAllocBounded holds the parse's memory amplification on the
// shapes of BenchmarkParseAlloc under bounds with margin (measured: 4.9,
// 3.0 and 1.0; before the bounds work, 23, 15 and 1.7). What a chat body
// makes the router hold is the Request (the rendering, and a
// tokenize.Message of 96 bytes a message) plus garbage the parse leaves.
func TestParseAllocBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	for _, c := range []struct {
		name string
		body []byte
		max  float64
	}{
		{"many-small", chatBodyManySmall(MaxMessages), 6},
		{"many-parts", chatBodyManyParts(MaxMessages), 4},
		{"few-huge", chatBodyFewHuge(4, 1<<20), 1.25},
		{"one-message-of-parts", []byte(partsBody(1, MaxContentParts)), 4},
	} {
		if got := allocPerByte(t, c.body); got > c.max {
			t.Errorf("%s (%d bytes): %.2f bytes allocated per body byte, want ≤ %.2f", c.name, len(c.body), got, c.max)
		} else {
			t.Logf("%s (%d bytes): %.2f bytes allocated per body byte", c.name, len(c.body), got)
		}
	}
}

// TestUnquoteScanMatchesUnquote: renderChat's unquoting, which finds the
// escapes again, agrees with the scanner's (checked against encoding/json
// by FuzzJSONScan) on each kind of escape and bad byte in each position.
func TestUnquoteScanMatchesUnquote(t *testing.T) {
	for _, special := range []string{`\n`, `\"`, `\\`, `\/`, `\u00e9`, `\ud83d\ude00`, `\ud83d`, `\ud83dx`, `\udc00`, `\ud83d\u0041`, "\xff", "\xe2\x82", "\xed\xa0\x80", "é", "\xef\xbf\xbd"} {
		for n := range 20 {
			for at := 0; at <= n; at++ {
				in := `"` + strings.Repeat("a", at) + special + strings.Repeat("b", n-at) + special + `"`
				s := jsonScan{b: []byte(in)}
				raw, plain, ok := s.scanString()
				if !ok {
					t.Fatalf("%q: not a string", in)
				}
				want := string(raw)
				if !plain {
					want = unquote(raw, s.stops)
				}
				var b strings.Builder
				writeString(&b, raw, s.formOf(plain))
				if b.String() != want {
					t.Fatalf("%q: unquoteScan %q, unquote %q", in, b.String(), want)
				}
			}
		}
	}
}

func TestNestsDeeper(t *testing.T) {
	for _, c := range []struct {
		s    string
		want bool
	}{
		{"", false},
		{"[[[]]]", false},
		{"[[[[]]]]", true},
		{"[[[[", true},
		{`{"a":{"b":{"c":{}}}}`, true},
		{`{"a":{"b":{"c":1}}}`, false},
		{`["[[[[[[["]`, false},   // brackets in a string
		{`["\"[[[[[[["]`, false}, // and after an escaped quote
		{`[1 [[[[`, false},       // a syntax error stops the decoder first
		{`[] [[[[`, false},       // as the first value's end does
		{" \n[[[[ ", true},
		{strings.Repeat("[", 20000), true}, // past encoding/json's 10,000
	} {
		if got := nestsDeeper(c.s, 3); got != c.want {
			t.Errorf("nestsDeeper(%.20q, 3) = %v, want %v", c.s, got, c.want)
		}
		if got := refDepth([]byte(c.s)) > 3; got != c.want {
			t.Errorf("refDepth(%.20q) > 3 = %v, want %v", c.s, got, c.want)
		}
	}
}
