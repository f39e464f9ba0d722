package proxy

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
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

func TestChunkKeyer(t *testing.T) {
	k := ChunkKeyer{BlockTokens: 16}
	text := strings.Repeat("x", 200)
	keys, n, err := k.Keys(&Request{Texts: []string{text}})
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 3 || n != 50 {
		t.Errorf("text: %d keys, %d tokens; want 3, 50", len(keys), n)
	}
	if want := blocks.TextKeys(nil, text, 64); keys[2] != want[2] {
		t.Error("text keys differ from blocks.TextKeys")
	}
	ids := make([]uint32, 40)
	keys, n, _ = k.Keys(&Request{TokenIDs: [][]uint32{ids, {1}}})
	if len(keys) != 2 || n != 41 {
		t.Errorf("ids: %d keys, %d tokens; want 2, 41", len(keys), n)
	}
	_, n, _ = k.Keys(&Request{})
	if n != 1 {
		t.Errorf("empty request: %d tokens, want 1", n)
	}
}

func TestConfigYAML(t *testing.T) {
	y := `
listen: ":9000"
backends:
  - url: http://10.0.0.1:8000
  - name: b
    url: http://10.0.0.2:8000
policy: round-robin
health_interval: 2s
eject_after: 5
max_body_bytes: 1024
admin_token: t
`
	c, err := ParseConfig([]byte(y), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != ":9000" || len(c.Backends) != 2 || c.Policy != "round-robin" || c.HealthInterval != 2*time.Second ||
		c.EjectAfter != 5 || c.MaxBodyBytes != 1024 || c.AdminToken != "t" || c.ReadmitAfter != DefaultConfig().ReadmitAfter {
		t.Errorf("config %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"listen: x\nbogus: 1\n", `unknown field "bogus"`},
		{"health_interval: 5\n", "duration"},
		{"health_interval: soon\n", "soon"},
		{"eject_after: many\n", "eject_after"},
	} {
		if _, err := ParseConfig([]byte(bad.yaml), DefaultConfig()); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: error %v, want one with %q", bad.yaml, err, bad.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	ok := DefaultConfig()
	ok.Backends = ParseBackends("http://a:1, http://b:2")
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		field string
		edit  func(*Config)
	}{
		{"backends", func(c *Config) { c.Backends = nil }},
		{"backends[1].url", func(c *Config) { c.Backends[1].URL = "ftp://x" }},
		{"backends[1].name", func(c *Config) { c.Backends[1].Name = "a:1" }},
		{"policy", func(c *Config) { c.Policy = "nope" }},
		{"block_tokens", func(c *Config) { c.BlockTokens = 0 }},
		{"connect_timeout", func(c *Config) { c.ConnectTimeout = -1 }},
		{"health_interval", func(c *Config) { c.HealthInterval = 0 }},
		{"eject_after", func(c *Config) { c.EjectAfter = 0 }},
		{"max_body_bytes", func(c *Config) { c.MaxBodyBytes = 0 }},
		{"max_retries", func(c *Config) { c.MaxRetries = -1 }},
	} {
		c := ok
		c.Backends = append([]Backend(nil), ok.Backends...)
		tc.edit(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.field+":") {
			t.Errorf("%s: error %v", tc.field, err)
		}
	}
	c := ok
	c.Profile = "no-such-profile"
	if _, err := New(c); err == nil || !strings.Contains(err.Error(), "profile") {
		t.Errorf("unknown profile: %v", err)
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
func frame(input []byte, n, max int) (events []sseEvent, rest []byte, err error) {
	f := newSSEFramer(&chunkedReader{data: input, n: n}, max)
	for {
		ev, err := f.Next()
		if err == io.EOF {
			return events, nil, nil
		}
		if err != nil {
			return events, append([]byte(nil), ev.Raw...), err
		}
		events = append(events, sseEvent{Raw: append([]byte(nil), ev.Raw...), Data: append([]byte(nil), ev.Data...), HasData: ev.HasData})
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
	if _, _, err := frame([]byte("data: "+strings.Repeat("z", 100)+"\n\n"), 7, 50); !errors.Is(err, errEventTooLong) {
		t.Errorf("long event: %v", err)
	}
}

func TestStreamStateObserve(t *testing.T) {
	var s streamState
	for _, d := range []string{
		`{"choices":[{"delta":{"role":"assistant","content":""}}]}`,
		`{"choices":[{"delta":{"content":"hi"}}]}`,
		`{"choices":[{"text":"a"}]}`,
		`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`,
		`[DONE]`,
	} {
		if _, err := s.observe(&sseEvent{Data: []byte(d), HasData: true}); err != nil {
			t.Fatal(err)
		}
	}
	if s.tokens != 2 || !s.sawDone || s.usage.cached() != 8 || s.usage.CompletionTokens != 2 {
		t.Errorf("state %+v", s)
	}
	if _, err := s.observe(&sseEvent{Data: []byte("nope"), HasData: true}); !errors.Is(err, errGarbage) {
		t.Errorf("garbage: %v", err)
	}
	var u *usage
	if u.cached() != -1 {
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
	k := ChunkKeyer{BlockTokens: 16}
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		r, err := ParseRequest(Kind(kind%3), body)
		if err != nil {
			if !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error %v does not wrap ErrBadRequest", err)
			}
			if statusOf(err) != 400 {
				t.Fatalf("error %v is not a 400", err)
			}
			return
		}
		if r.MaxTokens < 0 {
			t.Fatalf("negative max tokens %d", r.MaxTokens)
		}
		keys, n, err := k.Keys(r)
		if err != nil {
			t.Fatal(err)
		}
		if n < 1 || n < len(keys)*16 {
			t.Fatalf("%d prompt tokens for %d keys", n, len(keys))
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
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, errEventTooLong) {
			t.Fatalf("error %v", err)
		}
		var raw bytes.Buffer
		for _, ev := range evs {
			raw.Write(ev.Raw)
			if !bytes.HasSuffix(ev.Raw, []byte("\n")) {
				t.Fatalf("event %q does not end a line", ev.Raw)
			}
			var s streamState
			_, _ = s.observe(&ev)
		}
		raw.Write(rest)
		if errors.Is(err, errEventTooLong) {
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

// TestKeyMemo checks that the keyer's memo of recent prompts returns
// exactly blocks.Keys for prompts that share prefixes of every length with
// earlier ones, including while it evicts.
func TestKeyMemo(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	m := newKeyMemo(16)
	var prompts [][]uint32
	base := make([]uint32, 40000)
	for i := range base {
		base[i] = rng.Uint32() % 1000
	}
	for i := range 300 {
		var ids []uint32
		switch {
		case i%3 == 0 || len(prompts) == 0: // a prefix of the base and a new tail
			ids = append(ids, base[:rng.IntN(len(base))]...)
		default: // an earlier prompt, cut, and extended
			p := prompts[rng.IntN(len(prompts))]
			ids = append(ids, p[:rng.IntN(len(p)+1)]...)
		}
		for range rng.IntN(3000) {
			ids = append(ids, rng.Uint32()%1000)
		}
		prompts = append(prompts, ids)
		got, want := m.keys(ids), blocks.Keys(nil, ids, 16)
		if !slices.Equal(got, want) {
			t.Fatalf("prompt %d (%d ids): keys differ from blocks.Keys", i, len(ids))
		}
		if m.held > memoMaxKeys {
			t.Fatalf("memo holds %d keys, over its bound", m.held)
		}
	}
	// Eviction keeps the bound and the map consistent.
	for i := range 2*memoMaxKeys/(len(base)/16) + 4 {
		ids := append([]uint32{uint32(i) + 5000}, base...)
		if got := m.keys(ids); !slices.Equal(got, blocks.Keys(nil, ids, 16)) {
			t.Fatal("keys differ after eviction")
		}
	}
	if m.held > memoMaxKeys {
		t.Fatalf("memo holds %d keys, over its bound", m.held)
	}
	for p, e := range m.byPrint {
		if e.prev == nil || !slices.Contains(e.prints, p) {
			t.Fatal("the fingerprint map points to an evicted or foreign entry")
		}
	}
}

// TestKeyMemoConcurrent keys prompts that share prefixes from several
// goroutines at once (run it with -race).
func TestKeyMemoConcurrent(t *testing.T) {
	m := newKeyMemo(16)
	base := make([]uint32, 8000)
	for i := range base {
		base[i] = uint32(i * 7919 % 1000)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for g := range 4 {
		wg.Go(func() {
			for i := range 30 {
				ids := append(base[:len(base)-i*100:len(base)-i*100], uint32(g), uint32(i))
				if !slices.Equal(m.keys(ids), blocks.Keys(nil, ids, 16)) {
					errs <- "keys differ from blocks.Keys"
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
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
		var s streamState
		_, err := s.observe(&sseEvent{Data: data, HasData: true})
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
		if s.usage != nil && s.cached() != c.CachedTokens {
			t.Fatalf("stream reader: %d cached tokens, ReadChunk %d", s.cached(), c.CachedTokens)
		}
	})
}
