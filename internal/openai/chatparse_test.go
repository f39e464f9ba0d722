package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// parseRequest reads body with the single-pass decoder (fast) or with the
// encoding/json reference, for the differential tests.
func parseRequest(k Kind, body []byte, fast bool) (*Request, error) {
	if fast {
		return readRequest(k, body)
	}
	return refParseRequest(k, body)
}

// compareParse checks that the decoder and the reference agree on body:
// the same error text, or requests that are deeply equal.
func compareParse(t *testing.T, k Kind, body []byte) {
	t.Helper()
	got, gerr := readRequest(k, body)
	want, werr := refParseRequest(k, body)
	if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
		t.Fatalf("%v %q:\nerror   %v\nwant    %v", k, body, gerr, werr)
	}
	if gerr != nil {
		if !errors.Is(gerr, ErrBadRequest) {
			t.Fatalf("%v %q: error %v does not wrap ErrBadRequest", k, body, gerr)
		}
		return
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%v %q: requests differ:\ngot  %s\nwant %s", k, body, dumpRequest(got), dumpRequest(want))
	}
}

// dumpRequest prints a request with its chat prompt, for failures.
func dumpRequest(r *Request) string {
	s := fmt.Sprintf("%+v", *r)
	if r.Chat != nil {
		s += fmt.Sprintf("\nchat %+v", *r.Chat)
		for i, m := range r.Chat.Messages {
			rc := "<nil>"
			if m.ReasoningContent != nil {
				rc = *m.ReasoningContent
			}
			s += fmt.Sprintf("\n  msg %d %+v reasoning %q calls nil=%v", i, m, rc, m.ToolCalls == nil)
		}
		for i, tl := range r.Chat.Tools {
			s += fmt.Sprintf("\n  tool %d %s", i, tl)
		}
	}
	return s
}

// decoderCases are bodies that exercise what encoding/json does in corners:
// the seeds of the fuzz targets too.
var decoderCases = []string{
	// Every shape the router reads.
	`{"model":"m","prompt":"hello world"}`,
	`{"model":"m","prompt":[[1,2],[3,4]],"max_tokens":5,"n":2}`,
	`{"model":"m","prompt":["a","b","c"],"max_tokens":2}`,
	`{"model":"m","prompt":[1,2,3],"stream":true}`,
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"max_tokens":1,"user":"u1"}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`,
	`{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"one"}]}`,
	`{"model":"m","input":["a","b"]}`,
	`{"model":"m","input":[{"role":"user","content":"x"}]}`,
	`{"model":"m","messages":[{"role":"assistant","content":"x","reasoning_content":"think","name":"bob"},{"role":"tool","content":"r","tool_call_id":"c1"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}, {"b":2}],"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false,"x":[1,{"y":null}],"x":"dup"}}`,
	`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}},null,5,{"id":7,"function":"x"},{"function":{"name":1,"arguments":"a"},"function":{"arguments":"b"}}]}]}`,
	`{"model":"m","messages":[{"role":"assistant","tool_calls":[]},{"role":"user","tool_calls":{"a":1}},{"role":"u","tool_calls":"x"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[null,{"type":"input_text","text":"a"},{"text":"b"},{"type":"text"},{"type":"text","text":null}]}]}`,
	// Strings: escapes, surrogates, bytes that are not UTF-8.
	`{"model":"m\u00e9\ud83d\ude00\ud83d\u0041\udc00x\"\\\/\b\f\n\r\t","prompt":"\u0000"}`,
	"{\"model\":\"m\xff\xfe\xe2\x82\",\"prompt\":\"\xed\xa0\x80 \xef\xbf\xbd\"}",
	`{"model":"m","prompt":"\ud800\ud800\udc00"}`,
	// Keys: escapes, case folding, duplicates.
	`{"MODEL":"m","Prompt":"x","pro\u006dpt":"y"}`,
	"{\"model\":\"m\",\"\u017ftream\":true,\"max_to\u212aens\":3,\"prompt\":\"p\"}",
	`{"model":"a","model":null,"prompt":"x"}`,
	`{"model":"m","messages":[{"role":"a","name":"n","content":"c"},{"role":"b"}],"messages":[{"role":"c"}]}`,
	`{"model":"m","messages":[{"role":"a","content":"c"},{"role":"b","content":"d"}],"messages":[{"role":"c"}],"messages":[null,{"content":"e"}]}`,
	`{"model":"m","messages":[{"role":"a"}],"messages":[],"messages":[null]}`,
	`{"model":"m","messages":[{"role":"a"}],"messages":null}`,
	`{"model":"m","prompt":[1],"prompt":"x"}`,
	// Type errors: the first in document order wins; syntax errors win
	// over them.
	`{"model":1}`,
	`{"model":"m","stream":"yes","max_tokens":"x"}`,
	`{"model":"m","max_tokens":1.5}`,
	`{"model":"m","max_tokens":1e3}`,
	`{"model":"m","max_tokens":99999999999999999999}`,
	`{"model":"m","n":-0,"max_tokens":-1}`,
	`{"model":"m","n":0}`,
	`{"model":"m","messages":{"role":"user"}}`,
	`{"model":"m","messages":"x"}`,
	`{"model":"m","messages":["x",{"role":5}]}`,
	`{"model":"m","messages":[{"role":[1]}],"model":{}}`,
	`{"model":"m","messages":[{"role":"u","reasoning_content":true,"name":{},"tool_call_id":[]}]}`,
	`{"model":"m","messages":[{"role":"u","content":5}]}`,
	`{"model":"m","messages":[{"role":"u","content":[{"type":5}]}]}`,
	`{"model":"m","messages":[{"role":"u","content":[{"text":[1]},"x"]}]}`,
	`{"model":"m","messages":[{"role":"u","content":["x"]}]}`,
	`{"model":"m","messages":[{"content":"x"}]}`,
	`{"model":"m","messages":[]}`,
	`{"model":1,"prompt":`,
	`{"model":"m","prompt":5}`,
	`{"model":"m","prompt":[]}`,
	`{"model":"m","prompt":["a",1]}`,
	`{"model":"m","prompt":["a",null]}`,
	`{"model":"m","prompt":[null,1]}`,
	`{"model":"m","prompt":[[1],[]]}`,
	`{"model":"m","prompt":[[1],null]}`,
	`{"model":"m","prompt":[[1],[null,2]]}`,
	`{"model":"m","prompt":[[1],[-1]]}`,
	`{"model":"m","prompt":[[1],[1.5,-1]]}`,
	`{"model":"m","prompt":[1,[2]]}`,
	`{"model":"m","prompt":[4294967296]}`,
	`{"model":"m","prompt":[-5]}`,
	`{"model":"m","prompt":null}`,
	`{"model":"m","prompt":[{}]}`,
	`[1,2]`, `"x"`, `5`, `true`, `null`, ``, ` `,
	// Syntax errors at each of the scanner's states.
	`{"model":"m",}`, `{"model":"m"} x`, `{"model" "m"}`, `{"model":"m" "x":1}`,
	`{"a":[1 2]}`, `{"a":[1,]}`, `{,}`, `{"a":tru}`, `{"a":fals`, `{"a":nul`, `{"a":nulx}`,
	`{"a":-}`, `{"a":-x}`, `{"a":01}`, `{"a":1.}`, `{"a":1.e5}`, `{"a":1e}`, `{"a":1e+}`, `{"a":1E-x}`,
	`{"a":"\x"}`, `{"a":"\u12g4"}`, `{"a":"\u12`, `{"a":"\`, `{"a":"abc`, "{\"a\":\"a\nb\"}", "{\"a\":\"\x7f\x00\"}",
	`{"a":'x'}`, `{"a":[}`, `{"a":{]}`, `{"a"`, `{"a":`, `{`, `[`, `]`, `{"a":1}}`, "{\"a\":1}\x00",
	`{"a":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}`,
	`{"a":` + strings.Repeat("[", 9998) + strings.Repeat("]", 9998) + `}`,
	`{"a":` + strings.Repeat(`{"b":`, 9999) + `1` + strings.Repeat("}", 9999) + `}`,
	"\t\n\r {\"model\" : \"m\" , \"prompt\" : [ 1 , 2 ] }\r\n",
	// Parts: types spelt with escapes, text escaped or not UTF-8, one text
	// or several, errors in the second part.
	`{"model":"m","messages":[{"role":"user","content":[{"type":"te\u0078t","text":"a\nb"},{"type":"input_text","text":"\u00e9"},{"text":"c","type":null}]}]}`,
	"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"text\":\"\xff\"},{\"type\":\"text\",\"text\":\"x\\ud800\"}]}]}",
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b","text":null}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":[],"text":1}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},7]},{"role":"user","content":"\u0041\n"}]}`,
	`{"model":"m","messages":[{"role":"u","content":[{"type":"text","text":"a"}],"content":"s","content":[]}]}`,
	// Limits: nesting over MaxNesting, in the body and in a tool call's
	// arguments (a string the chat template decodes).
	`{"model":"m","messages":[{"role":"u"}],"tools":` + strings.Repeat("[", 128) + strings.Repeat("]", 128) + `}`,
	`{"model":"m","prompt":` + strings.Repeat("[", 127) + strings.Repeat("]", 127) + `}`,
	`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"arguments":"` + strings.Repeat("{\"a\":", 129) + `"}}]}]}`,
	`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"arguments":"[1 ` + strings.Repeat("[", 200) + `"}}]}]}`,
}

func TestDecodeBodyMatchesEncodingJSON(t *testing.T) {
	for _, body := range decoderCases {
		for k := range Kind(3) {
			compareParse(t, k, []byte(body))
		}
	}
}

func TestParseRequestFields(t *testing.T) {
	body := `{"model":"m","stream":true,"max_tokens":3,"n":2,"user":"u",
	"messages":[{"role":"system","content":"S\u00e9"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
	{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},
	{"role":"tool","content":"r","tool_call_id":"c"}],
	"tools":[ {"type":"function"} ],"chat_template_kwargs":{"enable_thinking":false}}`
	r, err := ParseRequest(KindChat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if r.Model != "m" || !r.Stream || r.MaxTokens != 6 || r.User != "u" {
		t.Errorf("got %+v", r)
	}
	c := r.Chat
	if len(c.Messages) != 4 || c.Messages[0].Content != "Sé" || c.Messages[1].Content != "a\nb" ||
		c.Messages[2].ToolCalls[0].Function.Name != "f" || c.Messages[3].ToolCallID != "c" {
		t.Errorf("messages %+v", c.Messages)
	}
	if len(c.Tools) != 1 || string(c.Tools[0]) != `{"type":"function"}` || string(c.Kwargs["enable_thinking"]) != "false" || !c.AddGenerationPrompt {
		t.Errorf("chat options %+v", c)
	}
	want := "tools\x00[ {\"type\":\"function\"} ]\x00system\x00Sé\x00user\x00ab\x00assistant\x00\x00" +
		`[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]` + "\x00tool\x00r\x00c\x00"
	if r.Texts[0] != want {
		t.Errorf("rendering %q, want %q", r.Texts[0], want)
	}
}

func TestParseRequestErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`{"model":"m","prompt":`, "invalid request: malformed JSON at byte 22: unexpected end of JSON input"},
		{`{"model":"m","prompt":"a"}x`, "invalid request: malformed JSON at byte 27: invalid character 'x' after top-level value"},
		{`{"model":"m","prompt":"\q"}`, `invalid request: malformed JSON at byte 25: invalid character 'q' in string escape code`},
		{`{"model":"m","prompt":1.}`, "invalid request: malformed JSON at byte 25: invalid character '}' after decimal point in numeric literal"},
		{`{"model":"m","max_tokens":"7","prompt":"a"}`, "invalid request: field max_tokens: expected a number, got string"},
		{`{"model":"m","messages":[{"role":1}]}`, "invalid request: field messages.role: expected a string, got number"},
		{`[]`, "invalid request: request body must be a JSON object, got array"},
		{`{"prompt":"a"}`, "invalid request: you must provide a model parameter"},
	} {
		_, err := ParseRequest(KindCompletion, []byte(tc.body))
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s: error %v, want %q", tc.body, err, tc.want)
		}
	}
}

// FuzzParseRequestJSON compares ParseRequest's single-pass decoder with the
// encoding/json reference on arbitrary bodies: the same accept/reject
// decision and error text, the same Request.
//
//	go test -run '^$' -fuzz FuzzParseRequestJSON -fuzztime 60s -parallel 1 ./internal/proxy/
func FuzzParseRequestJSON(f *testing.F) {
	for _, s := range decoderCases {
		if len(s) < 2000 {
			f.Add(uint8(2), []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		compareParse(t, Kind(kind%3), body)
	})
}

// FuzzJSONScan compares the scanner with encoding/json on arbitrary bytes:
// jsonScan.skip accepts exactly the valid JSON texts, with encoding/json's
// error (message and offset) for the others, and a string unquotes to
// what encoding/json decodes it to.
//
//	go test -run '^$' -fuzz FuzzJSONScan -fuzztime 60s -parallel 1 ./internal/proxy/
func FuzzJSONScan(f *testing.F) {
	for _, s := range []string{
		`"a\u00e9\ud83d\ude00\ud83d\u0041\udc00x\"\\\/\b\f\n\r\t"`, "\"\xff\xe2\x82\xed\xa0\x80\"", `"\ud800\ud800\udc00"`,
		`{"a":[1,-0.5e+7,true,false,null,{}]}`, `[1 2]`, `{"a":1,}`, `01`, `-`, `1.`, `1e`, `"\u12`, `nul`, `{"a"}`,
		"\"a\x01\"", ` [ ] `, `[[[]]]`, `{"a":{"b":{"c":[]}}}x`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		s := jsonScan{b: data}
		s.ws()
		if s.skip() {
			s.ws()
			if s.i < len(data) {
				s.fail(s.i, "after top-level value", false)
			}
		}
		// Unmarshal validates the whole input first (checkValid) and a
		// RawMessage takes any value: its error is the syntax error.
		var raw json.RawMessage
		err := json.Unmarshal(data, &raw)
		var se *json.SyntaxError
		switch {
		case err == nil && s.err != nil:
			t.Fatalf("%q: scanner error %q at %d; encoding/json accepts it", data, s.err.msg, s.err.off)
		case err != nil && !errors.As(err, &se):
			t.Fatalf("%q: encoding/json: %v", data, err)
		case err != nil && s.err == nil:
			t.Fatalf("%q: scanner accepts; encoding/json: %v", data, err)
		case err != nil && (se.Error() != s.err.msg || int(se.Offset) != s.err.off):
			t.Fatalf("%q: scanner error %q at %d; encoding/json %q at %d", data, s.err.msg, s.err.off, se, se.Offset)
		}
		if err != nil || raw[0] != '"' {
			return
		}
		var want string
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatal(err)
		}
		s = jsonScan{b: data}
		s.ws()
		if got, ok := s.str(); !ok || got != want {
			t.Fatalf("%q: unquoted %q, encoding/json %q", data, got, want)
		}
		// renderChat's unquoting, which finds the escapes itself.
		s = jsonScan{b: data, noStops: true}
		s.ws()
		raw, plain, _ := s.scanString()
		var b strings.Builder
		writeString(&b, raw, s.formOf(plain))
		if b.String() != want {
			t.Fatalf("%q: unquoteScan %q, encoding/json %q", data, b.String(), want)
		}
	})
}

// TestScanStringEveryLane puts each kind of byte the string scanner stops
// at in every position of strings of 0 to 72 bytes (the lanes of the
// 8- and 32-byte word loops) and compares with encoding/json.
func TestScanStringEveryLane(t *testing.T) {
	for _, special := range []string{`"`, `\\`, `\n`, `\u00e9`, "\n", "\x1f", "é", "\xff", "\x7f"} {
		for n := range 73 {
			for at := 0; at <= n; at++ {
				in := []byte(`"` + strings.Repeat("a", at) + special + strings.Repeat("b", n-at) + `"`)
				s := jsonScan{b: in}
				got, ok := s.str()
				if ok && s.i < len(in) {
					ok = s.fail(s.i, "after top-level value", false)
				}
				var want string
				err := json.Unmarshal(in, &want)
				if ok != (err == nil) || (ok && got != want) {
					t.Fatalf("%q: scanner %q, %v (%v); encoding/json %q, %v", in, got, ok, s.err, want, err)
				}
			}
		}
	}
}
