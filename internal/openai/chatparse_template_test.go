package openai

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

func testTokenizer(t testing.TB) *tokenize.Tokenizer {
	t.Helper()
	tok, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// jinjaQwen3 is the Qwen3 tokenizer with a comment appended to its
// template source: the same template, which no native renderer
// recognises, so it always renders through Jinja. It shares the test
// tokenizer's vocabulary and caches.
var jinjaQwen3 = sync.OnceValues(func() (*tokenize.Tokenizer, error) {
	tok, err := qwen3.Shared()
	if err != nil {
		return nil, err
	}
	j := *tok
	return &j, j.SetChatTemplate(tok.ChatTemplate() + "{#- rendered by Jinja #}")
})

// chatFromBytes builds a conversation from fuzz bytes: messages split at
// 0xff, each one's first byte choosing its role, whether it has
// reasoning_content, and the options; bytes 1 to 6 of its content stand
// for the strings the Qwen3 template looks for.
func chatFromBytes(data []byte) ([]tokenize.Message, tokenize.ChatOptions) {
	roles := []string{"user", "assistant", "system", "tool", "developer", "user", "assistant", "tool"}
	marks := []string{1: "<think>", 2: "</think>", 3: "<tool_response>", 4: "</tool_response>", 5: "\n", 6: "\n\n"}
	var msgs []tokenize.Message
	var opts tokenize.ChatOptions
	for i, part := range strings.Split(string(data), "\xff") {
		if len(part) == 0 {
			continue
		}
		head, body := part[0], part[1:]
		var c strings.Builder
		for j := 0; j < len(body); j++ {
			if int(body[j]) < len(marks) && marks[body[j]] != "" {
				c.WriteString(marks[body[j]])
			} else {
				c.WriteByte(body[j])
			}
		}
		m := tokenize.Message{Role: roles[head&7], Content: strings.ToValidUTF8(c.String(), "?")}
		if head&8 != 0 {
			r := strings.ToValidUTF8(body[:len(body)/2], "?")
			m.ReasoningContent = &r
		}
		if i == 0 {
			opts.AddGenerationPrompt = head&16 == 0
			switch head >> 5 {
			case 1:
				opts.Kwargs = map[string]json.RawMessage{"enable_thinking": json.RawMessage("false")}
			case 2:
				opts.Kwargs = map[string]json.RawMessage{"enable_thinking": json.RawMessage("true")}
			case 3:
				opts.Kwargs = map[string]json.RawMessage{"enable_thinking": json.RawMessage("0")}
			}
		}
		msgs = append(msgs, m)
	}
	return msgs, opts
}

func TestNativeChatTemplateMatchesJinja(t *testing.T) {
	native := testTokenizer(t)
	jinja, err := jinjaQwen3()
	if err != nil {
		t.Fatal(err)
	}
	think := "x\x01\x05why\x05\x02\x06answer"
	for _, in := range []string{
		"\x02sys\xff\x00hi\xff\x01" + think + "\xff\x00again",
		"\x00q\xff\x01" + think + "\xff\x03\x03r1\x04\xff\x03r2\xff\x00\x03wrapped\x04",
		"\x11q\xff\x09" + think,
		"\x30q\xff\x01a\x02b\xff\x02mid\xff\x04dev\xff\x00last",
		"\x50q\xff\x01\x05\x05\x01\x05t\x05\x02\x02\x05\x05a",
		"\x00\x03only\x04\xff\x03tool first",
		"\x40q",
	} {
		msgs, opts := chatFromBytes([]byte(in))
		got, gerr := native.ApplyChatTemplate(msgs, opts)
		want, werr := jinja.ApplyChatTemplate(msgs, opts)
		if gerr != nil || werr != nil || got != want {
			t.Errorf("%q:\nnative %q (%v)\njinja  %q (%v)", in, got, gerr, want, werr)
		}
	}
	// The bundled Qwen3 template does render natively: its one buffer,
	// where Jinja allocates dozens of values.
	msgs, opts := chatFromBytes([]byte("\x02sys\xff\x00hi"))
	n := testing.AllocsPerRun(10, func() { _, _ = native.ApplyChatTemplate(msgs, opts) })
	j := testing.AllocsPerRun(10, func() { _, _ = jinja.ApplyChatTemplate(msgs, opts) })
	if n > 2 || j < 10 {
		t.Errorf("rendering the Qwen3 template takes %v allocations, %v through Jinja: not the native renderer", n, j)
	}
}

// FuzzNativeChatTemplate compares the native rendering of the Qwen3
// template with Jinja's on arbitrary conversations.
//
//	go test -run '^$' -fuzz FuzzNativeChatTemplate -fuzztime 60s -parallel 1 ./internal/proxy/
func FuzzNativeChatTemplate(f *testing.F) {
	f.Add([]byte("\x02sys\xff\x00hi\xff\x01x\x01\x05why\x05\x02\x06answer\xff\x00again"))
	f.Add([]byte("\x00q\xff\x09a\x02b\xff\x03\x03r\x04\xff\x03s"))
	f.Add([]byte("\x30q\xff\x01\x05\x01t\x02\x05a"))
	native := testTokenizer(f)
	jinja, err := jinjaQwen3()
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		msgs, opts := chatFromBytes(data)
		got, gerr := native.ApplyChatTemplate(msgs, opts)
		want, werr := jinja.ApplyChatTemplate(msgs, opts)
		if (gerr == nil) != (werr == nil) || got != want {
			t.Fatalf("native %q (%v)\njinja  %q (%v)", got, gerr, want, werr)
		}
	})
}
