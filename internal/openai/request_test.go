package openai

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestParseRequest(t *testing.T) {
	long := strings.Repeat("abcdefgh", 20) // 160 bytes: 2 chunks of 64
	for _, tc := range []struct {
		name       string
		kind       Kind
		body       string
		wantTexts  int
		wantIDs    int
		wantMax    int
		wantStream bool
		wantUser   string
	}{
		{"string", KindCompletion, `{"model":"m","prompt":"` + long + `","max_tokens":7}`, 1, 0, 7, false, ""},
		{"strings batch", KindCompletion, `{"model":"m","prompt":["a","b","c"],"max_tokens":2}`, 3, 0, 6, false, ""},
		{"token ids", KindCompletion, `{"model":"m","prompt":[1,2,3],"stream":true}`, 0, 1, 0, true, ""},
		{"token id lists", KindCompletion, `{"model":"m","prompt":[[1,2],[3]],"max_tokens":1,"n":2}`, 0, 2, 4, false, ""},
		{"chat", KindChat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"max_tokens":1,"user":"u1"}`, 1, 0, 9, false, "u1"},
		{"chat parts", KindChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`, 1, 0, 0, false, ""},
		{"other without prompt", KindOther, `{"model":"m"}`, 0, 0, 0, false, ""},
		{"other not json", KindOther, `--multipart--`, 0, 0, 0, false, ""},
		{"other responses api", KindOther, `{"model":"m","input":[{"role":"user","content":"x"}]}`, 0, 0, 0, false, ""},
		{"other embeddings", KindOther, `{"model":"m","input":["a","b"]}`, 2, 0, 0, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRequest(tc.kind, []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Texts) != tc.wantTexts || len(r.TokenIDs) != tc.wantIDs || r.MaxTokens != tc.wantMax || r.Stream != tc.wantStream || r.User != tc.wantUser {
				t.Errorf("got %+v", r)
			}
		})
	}
}

func TestChatRenderingSharesPrefixes(t *testing.T) {
	a, err := ParseRequest(KindChat, []byte(`{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"one"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := ParseRequest(KindChat, []byte(`{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"S"}]},{"role":"user","content":"one"},{"role":"assistant","content":"two"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(b.Texts[0], a.Texts[0]) {
		t.Errorf("a longer conversation %q does not extend %q", b.Texts[0], a.Texts[0])
	}
	if want := "system\x00S\x00user\x00one\x00"; a.Texts[0] != want {
		t.Errorf("rendering %q, want %q", a.Texts[0], want)
	}
}

// chunkedReader returns at most n bytes per Read.
type chunkedReader struct {
	data []byte
	n    int
}

func (c *chunkedReader) Read(b []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	k := min(len(b), c.n, len(c.data))
	copy(b, c.data[:k])
	c.data = c.data[k:]
	return k, nil
}

// frame cuts input into events, reading n bytes at a time.
func frame(input []byte, n, max int) (events []Event, rest []byte, err error) {
	f := NewFramer(&chunkedReader{data: input, n: n}, max)
	for {
		ev, err := f.Next()
		if err == io.EOF {
			return events, nil, nil
		}
		if err != nil {
			return events, append([]byte(nil), ev.Raw...), err
		}
		events = append(events, Event{Raw: append([]byte(nil), ev.Raw...), Data: append([]byte(nil), ev.Data...), HasData: ev.HasData})
	}
}

func TestSSEFramer(t *testing.T) {
	in := "data: {\"a\":1}\n\n: comment\r\ndata: x\r\ndata:y\r\n\r\nevent: e\nid: 3\n\ndata: [DONE]\n\ndata: partial"
	evs, rest, err := frame([]byte(in), 3, 0)
	if !errors.Is(err, io.ErrUnexpectedEOF) || string(rest) != "data: partial" {
		t.Fatalf("end: %q, %v", rest, err)
	}
	var datas []string
	var raw bytes.Buffer
	for _, ev := range evs {
		datas = append(datas, string(ev.Data))
		raw.Write(ev.Raw)
	}
	if got, want := strings.Join(datas, "|"), "{\"a\":1}|x\ny||[DONE]"; got != want {
		t.Errorf("data %q, want %q", got, want)
	}
	if raw.String()+string(rest) != in {
		t.Errorf("raw bytes changed")
	}
	if _, _, err := frame([]byte("data: "+strings.Repeat("z", 100)+"\n\n"), 7, 50); !errors.Is(err, ErrEventTooLong) {
		t.Errorf("long event: %v", err)
	}
}

func TestStreamObserve(t *testing.T) {
	var s Stream
	for _, d := range []string{
		`{"choices":[{"delta":{"role":"assistant","content":""}}]}`,
		`{"choices":[{"delta":{"content":"hi"}}]}`,
		`{"choices":[{"text":"a"}]}`,
		`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`,
		`[DONE]`,
	} {
		if _, err := s.Observe(&Event{Data: []byte(d), HasData: true}); err != nil {
			t.Fatal(err)
		}
	}
	if s.Tokens != 2 || !s.SawDone || s.Usage.Cached(nil) != 8 || s.Cached() != 8 || s.Usage.CompletionTokens != 2 {
		t.Errorf("state %+v", s)
	}
	if _, err := s.Observe(&Event{Data: []byte("nope"), HasData: true}); !errors.Is(err, ErrNotJSON) {
		t.Errorf("garbage: %v", err)
	}
	var u *Usage
	if u.Cached(nil) != -1 {
		t.Error("nil usage reports cached tokens")
	}
}

func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","prompt":"hello world"}`,
		`{"model":"m","prompt":[[1,2],[3,4]],"max_tokens":5,"n":2}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
		`{"model":"m","prompt":["a",1]}`,
		`{"model":1}`,
	} {
		f.Add(uint8(1), []byte(s))
		f.Add(uint8(2), []byte(s))
	}
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		r, err := ParseRequest(Kind(kind%3), body)
		if err != nil {
			if !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error %v does not wrap ErrBadRequest", err)
			}
			return
		}
		if r.MaxTokens < 0 {
			t.Fatalf("negative max tokens %d", r.MaxTokens)
		}
	})
}

func FuzzSSEFramer(f *testing.F) {
	for _, s := range []string{
		"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n",
		"data: a\r\ndata: b\r\n\r\n: c\n\n",
		"event: x\ndata\n\ndata: partial",
		"\n\n\n",
		"data: {\"error\":{\"message\":\"boom\"}}\n\n",
		// llama.cpp's final chunk: usage and timings, no prompt_tokens_details.
		"data: {\"choices\":[{\"text\":\"\",\"index\":0,\"finish_reason\":\"length\"}],\"usage\":{\"completion_tokens\":3,\"prompt_tokens\":602,\"total_tokens\":605},\"timings\":{\"prompt_n\":1,\"prompt_ms\":6.524,\"prompt_per_token_ms\":6.524,\"predicted_n\":3,\"predicted_ms\":11.721,\"predicted_per_token_ms\":3.907}}\n\ndata: [DONE]\n\n",
	} {
		f.Add([]byte(s), uint8(1))
		f.Add([]byte(s), uint8(5))
	}
	f.Fuzz(func(t *testing.T, in []byte, chunk uint8) {
		n := int(chunk%32) + 1
		evs, rest, err := frame(in, n, 256)
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, ErrEventTooLong) {
			t.Fatalf("error %v", err)
		}
		var raw bytes.Buffer
		for _, ev := range evs {
			raw.Write(ev.Raw)
			if !bytes.HasSuffix(ev.Raw, []byte("\n")) {
				t.Fatalf("event %q does not end a line", ev.Raw)
			}
			var s Stream
			_, _ = s.Observe(&ev)
		}
		raw.Write(rest)
		if errors.Is(err, ErrEventTooLong) {
			if !bytes.HasPrefix(in, raw.Bytes()) {
				t.Fatalf("bytes changed before a long event")
			}
			return
		}
		if !bytes.Equal(raw.Bytes(), in) {
			t.Fatalf("framing changed the bytes:\n got %q\nwant %q", raw.Bytes(), in)
		}
		// Where reads split the input does not change the events.
		evs1, rest1, err1 := frame(in, 1<<20, 256)
		if len(evs1) != len(evs) || !bytes.Equal(rest1, rest) || (err1 == nil) != (err == nil) {
			t.Fatalf("chunking changed the events: %d vs %d", len(evs1), len(evs))
		}
		for i := range evs {
			if !bytes.Equal(evs[i].Raw, evs1[i].Raw) || !bytes.Equal(evs[i].Data, evs1[i].Data) {
				t.Fatalf("event %d differs by chunking", i)
			}
		}
	})
}

// FuzzReadChunk feeds the reader of a replica's chunks (shared with the
// endpoint picker) arbitrary data: it must not panic, must agree with the
// stream reader, and may only report cached tokens it can justify: -1 or a
// count within [0, prompt_tokens] when they come from llama.cpp's timings.
func FuzzReadChunk(f *testing.F) {
	for _, s := range []string{
		`{"choices":[{"text":"a"}],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`,
		`{"choices":[{"finish_reason":"length","index":0,"delta":{}}],"usage":{"completion_tokens":2,"prompt_tokens":10,"total_tokens":12},"timings":{"prompt_n":1,"prompt_ms":6.448,"prompt_per_token_ms":6.448,"prompt_per_second":155.08,"predicted_n":2,"predicted_ms":6.366,"predicted_per_token_ms":3.183,"predicted_per_second":314.16}}`,
		`{"usage":{"prompt_tokens":5},"timings":{"prompt_n":1e300}}`,
		`{"usage":{"prompt_tokens":5},"timings":{"prompt_n":-7}}`,
		`{"usage":{"prompt_tokens":5},"timings":[1,2]}`,
		`{"timings":{"prompt_n":3}}`,
		`null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, ok := ReadChunk(data)
		var s Stream
		_, err := s.Observe(&Event{Data: data, HasData: true})
		if !done(data) && ok != (err == nil) {
			t.Fatalf("ReadChunk ok %v, stream reader error %v", ok, err)
		}
		if !ok {
			return
		}
		if c.Timings != nil && (c.Timings.PromptN < 0 || c.Timings.PromptMs < 0 || c.Timings.PredictedN < 0) {
			t.Fatalf("timings %+v", *c.Timings)
		}
		if !c.HasUsage {
			if c.CachedTokens != 0 {
				t.Fatalf("cached tokens %d without usage", c.CachedTokens)
			}
			return
		}
		if c.CachedTokens < -1 {
			t.Fatalf("cached tokens %d", c.CachedTokens)
		}
		if s.Usage != nil && s.Cached() != c.CachedTokens {
			t.Fatalf("stream reader: %d cached tokens, ReadChunk %d", s.Cached(), c.CachedTokens)
		}
	})
}
