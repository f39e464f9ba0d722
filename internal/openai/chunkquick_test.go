package openai

import (
	"encoding/json"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

// quickSeeds are chunks as replicas send them, and near misses.
var quickSeeds = []string{
	// vLLM completions and chat.
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" tok0","logprobs":null,"finish_reason":null,"stop_reason":null}]}`,
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}`,
	`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
	`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null}]}`,
	`{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}`,
	`{"choices":[{"index":0,"delta":{"reasoning":"hm","content":null}}]}`,
	`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}}]}`,
	`{"choices":[{"delta":{"tool_calls":null}}]}`,
	`{"choices":[{"delta":{"tool_calls":[]}}]}`,
	`{"choices":[{"delta":null}]}`,
	`{"choices":[null,{"text":"x"}]}`,
	`{"choices":null}`,
	`{"choices":[]}`,
	`{}`,
	` { "choices" : [ { "text" : "a\u00e9\n" } ] } `,
	// The usage chunk, llama.cpp's final chunk, errors: encoding/json's.
	`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`,
	`{"choices":[{"text":"","index":0,"finish_reason":"length"}],"usage":{"completion_tokens":3,"prompt_tokens":602,"total_tokens":605},"timings":{"prompt_n":1,"prompt_ms":6.524}}`,
	`{"error":{"message":"boom"}}`,
	`{"error":null,"usage":null,"timings":null,"choices":[{"text":"t"}]}`,
	// Near misses: case, escapes, duplicates, types, syntax.
	`{"Choices":[{"TEXT":"a"}]}`,
	`{"choices":[{"te\u0078t":"a"}]}`,
	`{"choices":[{"text":"a","text":""}]}`,
	`{"choices":[{"text":"a"}],"choices":[{}]}`,
	`{"choices":[{"delta":{"content":"a","Content":null}}]}`,
	`{"choices":[{"text":5}]}`,
	`{"choices":[{"delta":"x"}]}`,
	`{"choices":{"text":"a"}}`,
	`{"choices":[{"message":{"content":"a"}}]}`,
	`{"choices":[{"text":"a"}]`,
	`{"choices":[{"text":"a"}]}x`,
	`{"choices":[{"text":"a\x01"}]}`,
	`{"choices":[{"text":"\ud800"}],"x":[1,2.5e3,-0,true,false,null,{"y":"z"}]}`,
	`{"choices":[{"text":"a"}],"x":01}`,
	`null`,
	`[1]`,
	`"[DONE]"`,
	// Usage chunks.
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"fast","choices":[],"usage":{"prompt_tokens":3,"total_tokens":11,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":0}}}`,
	`{"choices":[],"usage":{"prompt_tokens":-0,"completion_tokens":null,"prompt_tokens_details":null}}`,
	`{"choices":[],"usage":{"prompt_tokens":1.0}}`,
	`{"choices":[],"usage":{"prompt_tokens":1e2}}`,
	`{"choices":[],"usage":{"prompt_tokens":123456789012345678901}}`,
	`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":null,"x":[{}]}}}`,
	`{"choices":[],"usage":{"prompt_tokens":"3"}}`,
	`{"choices":[],"usage":{"Prompt_Tokens":3,"prompt_tokens":4}}`,
	`{"choices":[],"usage":{}, "usage":null}`,
}

// observeJSON is Stream.Observe as it was before quickChunk: every chunk
// through encoding/json.
func observeJSON(s *Stream, ev *Event) (bool, error) {
	if !ev.HasData {
		return false, nil
	}
	if done(ev.Data) {
		s.SawDone = true
		return false, nil
	}
	var c chunkInfo
	if err := json.Unmarshal(ev.Data, &c); err != nil {
		return false, ErrNotJSON
	}
	if c.Usage != nil {
		s.Usage = c.Usage
	}
	if t := ParseTimings(c.Timings); t != nil {
		s.Timings = t
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		s.UpstreamError = true
	}
	token := c.output()
	if token {
		s.Tokens++
	}
	return token, nil
}

// readChunkJSON is ReadChunk as it was before quickChunk.
func readChunkJSON(data []byte) (c Chunk, ok bool) {
	var ci chunkInfo
	if json.Unmarshal(data, &ci) != nil {
		return Chunk{}, false
	}
	c.Output = ci.output()
	c.Timings = ParseTimings(ci.Timings)
	if ci.Usage != nil {
		c.HasUsage = true
		c.PromptTokens, c.CompletionTokens = ci.Usage.PromptTokens, ci.Usage.CompletionTokens
		c.CachedTokens = ci.Usage.Cached(c.Timings)
	}
	return c, true
}

// FuzzQuickChunk holds the quick chunk reader to encoding/json: whatever it
// accepts, json.Unmarshal into chunkInfo accepts too, with the same output
// and no usage, error or timings; and Stream.Observe and ReadChunk answer
// as they did with encoding/json alone, for every input.
func FuzzQuickChunk(f *testing.F) {
	for _, s := range quickSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, u, ok := quickChunk(data)
		if ok {
			var ci chunkInfo
			if err := json.Unmarshal(data, &ci); err != nil {
				t.Fatalf("quickChunk accepted %q, encoding/json: %v", data, err)
			}
			if ci.Timings != nil && string(ci.Timings) != "null" || (len(ci.Error) > 0 && string(ci.Error) != "null") {
				t.Fatalf("quickChunk accepted %q, which has timings or an error", data)
			}
			if got := ci.output(); got != out {
				t.Fatalf("%q: quickChunk output %v, encoding/json %v", data, out, got)
			}
			if !reflect.DeepEqual(u, ci.Usage) {
				t.Fatalf("%q: quickChunk usage %+v, encoding/json %+v", data, u, ci.Usage)
			}
		}
		// The stream reader and ReadChunk, before and after.
		ev := Event{Data: data, HasData: true}
		var s1, s2 Stream
		s1.Tokens, s2.Tokens = 3, 3
		tok1, err1 := s1.Observe(&ev)
		tok2, err2 := observeJSON(&s2, &ev)
		if tok1 != tok2 || !errors.Is(err1, err2) || !reflect.DeepEqual(s1, s2) {
			t.Fatalf("%q: Observe (%v, %v, %+v), encoding/json (%v, %v, %+v)", data, tok1, err1, s1, tok2, err2, s2)
		}
		c1, ok1 := ReadChunk(data)
		c2, ok2 := readChunkJSON(data)
		if ok1 != ok2 || !reflect.DeepEqual(c1, c2) {
			t.Fatalf("%q: ReadChunk (%+v, %v), encoding/json (%+v, %v)", data, c1, ok1, c2, ok2)
		}
	})
}

// TestQuickChunkTakesStreamChunks checks that the chunks a stream is made
// of take the quick path, and the rest do not.
func TestQuickChunkTakesStreamChunks(t *testing.T) {
	for _, tc := range []struct {
		data       string
		ok, output bool
	}{
		{quickSeeds[0], true, true},
		{quickSeeds[1], true, false},
		{quickSeeds[2], true, false},
		{quickSeeds[3], true, true},
		{quickSeeds[4], true, true},
		{quickSeeds[5], true, true},
		{quickSeeds[6], true, true},
		{quickSeeds[7], true, false},
		{quickSeeds[8], true, true}, // encoding/json: a non-null RawMessage
		{quickSeeds[10], true, true},
		{quickSeeds[14], true, true},
		{quickSeeds[18], true, true},
		{`{"Choices":[{"TEXT":"a"}]}`, true, true}, // encoding/json matches keys case-insensitively
		{quickSeeds[15], true, false},              // usage
		{`{"choices":[],"usage":{"prompt_tokens":1.0}}`, false, false},
		{quickSeeds[16], false, false}, // usage and timings
		{quickSeeds[17], false, false}, // error
		{`{"choices":[{"text":"a","text":""}]}`, false, false},
		{`{"choices":[{"text":5}]}`, false, false},
		{`{"choices":[{"text":"a"}]}x`, false, false},
		{`null`, false, false},
	} {
		out, _, ok := quickChunk([]byte(tc.data))
		if ok != tc.ok || out != tc.output {
			t.Errorf("%s: quickChunk (%v, %v), want (%v, %v)", tc.data, out, ok, tc.output, tc.ok)
		}
	}
}

// TestFramerRelease checks that a framer released in the middle of a
// stream (its buffer holding more events, its event half read) hands the
// next one its buffers and nothing else.
func TestFramerRelease(t *testing.T) {
	for i := range 4 {
		f := NewFramer(strings.NewReader("data: a\n\ndata: b\n\ndata: half"), 0)
		ev, err := f.Next()
		if err != nil || string(ev.Data) != "a" {
			t.Fatalf("round %d: first event %q, %v", i, ev.Data, err)
		}
		f.Release()
		g := NewFramer(strings.NewReader("data: c\n\n"), 0)
		ev, err = g.Next()
		if err != nil || string(ev.Data) != "c" || string(ev.Raw) != "data: c\n\n" {
			t.Fatalf("round %d: next framer's event %q (raw %q), %v", i, ev.Data, ev.Raw, err)
		}
		if _, err := g.Next(); err != io.EOF {
			t.Fatalf("round %d: after the only event: %v", i, err)
		}
		g.Release()
	}
}

// BenchmarkObserveChunk reads a vLLM completion chunk: through the quick
// path (Stream.Observe) and through encoding/json alone (as before it).
func BenchmarkObserveChunk(b *testing.B) {
	ev := Event{Data: []byte(quickSeeds[0]), HasData: true}
	b.Run("quick", func(b *testing.B) {
		b.ReportAllocs()
		var s Stream
		for b.Loop() {
			_, _ = s.Observe(&ev)
		}
	})
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		var s Stream
		for b.Loop() {
			_, _ = observeJSON(&s, &ev)
		}
	})
}
