package tokenize

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unsafe"
)

// A native renderer is Go code that renders one well-known chat template
// exactly as Jinja does, chosen by the SHA-256 of the template's source,
// for the conversations it covers (it answers ok=false for the others,
// which Jinja renders). Jinja builds a message's turn by concatenating
// strings, copying a long message several times and allocating as it goes:
// for a 240 KB conversation that is most of a route's time and garbage.
// The native renderer writes each message once into a buffer of the right
// size. llama.cpp picks native renderers of known templates the same way.
//
// The Jinja rendering stays the reference: TestChatTemplateGolden checks
// the native output against Python's Jinja2, and the proxy package's
// FuzzNativeChatTemplate against Jinja on arbitrary conversations.
//
// A native renderer appends the text to dst; special holds the special-token
// strings of tokenizer_config.json (bos_token, ...) that templates read.
type nativeRenderer func(dst []byte, msgs []Message, opts ChatOptions, special map[string]string) ([]byte, bool)

// nativeRenderers maps the hex SHA-256 of a template's source to its
// native renderer.
var nativeRenderers = map[string]nativeRenderer{
	// The chat template of the Qwen3 models (Qwen3-0.6B ... Qwen3-235B-A22B,
	// tokenizer_config.json), as internal/tokenize/qwen3 bundles it.
	"87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": renderQwen3,
	// The chat template of Meta-Llama-3-8B-Instruct and -70B-Instruct.
	"b48c47f6443892716176eb200bf4ef108f64e06ca26ed0fa8ebc0a4b3992fcb2": renderLlama3,
}

// nativeFor returns the native renderer of template source src, or nil.
func nativeFor(src string) nativeRenderer {
	sum := sha256.Sum256([]byte(src))
	return nativeRenderers[hex.EncodeToString(sum[:])]
}

// renderQwen3 renders the Qwen3 template for conversations without tools
// or tool calls, whose chat_template_kwargs are at most enable_thinking as
// a JSON boolean. It follows the template line by line:
//
//   - a first system message becomes the system turn;
//   - the last query is the last user message that is not a tool response
//     wrapped in <tool_response></tool_response> (the last message when
//     there is none);
//   - user messages, and system messages after the first, are turns of
//     their content;
//   - an assistant message's reasoning is its reasoning_content when set,
//     else what its content holds between <think> and </think> (the
//     content then being what follows the last </think>, without leading
//     newlines); after the last query, the last message and those with
//     reasoning show it in a <think> block;
//   - consecutive tool messages share one user turn of <tool_response>s;
//   - other roles render nothing; the generation prompt, with an empty
//     think block when enable_thinking is false, ends the text.
func renderQwen3(b []byte, msgs []Message, opts ChatOptions, _ map[string]string) ([]byte, bool) {
	if len(msgs) == 0 || len(opts.Tools) > 0 {
		return b, false
	}
	thinkingOff := false
	for k, v := range opts.Kwargs {
		if k != "enable_thinking" {
			return b, false
		}
		switch string(bytes.TrimSpace(v)) {
		case "false":
			thinkingOff = true
		case "true":
		default:
			return b, false
		}
	}
	size := 64
	for i := range msgs {
		m := &msgs[i]
		if len(m.ToolCalls) > 0 {
			return b, false
		}
		size += len(m.Role) + len(m.Content) + 48
		if m.ReasoningContent != nil {
			size += len(*m.ReasoningContent) + 24
		}
	}
	b = slices.Grow(b, size)
	if msgs[0].Role == "system" {
		b = append(b, "<|im_start|>system\n"...)
		b = append(b, msgs[0].Content...)
		b = append(b, "<|im_end|>\n"...)
	}
	lastQuery := len(msgs) - 1
	for i := len(msgs) - 1; i >= 0; i-- {
		if c := msgs[i].Content; msgs[i].Role == "user" &&
			!(strings.HasPrefix(c, "<tool_response>") && strings.HasSuffix(c, "</tool_response>")) {
			lastQuery = i
			break
		}
	}
	for i := range msgs {
		m := &msgs[i]
		first, last := i == 0, i == len(msgs)-1
		switch {
		case m.Role == "user" || (m.Role == "system" && !first):
			b = append(b, "<|im_start|>"...)
			b = append(b, m.Role...)
			b = append(b, '\n')
			b = append(b, m.Content...)
			b = append(b, "<|im_end|>\n"...)
		case m.Role == "assistant":
			content, reasoning := m.Content, ""
			if m.ReasoningContent != nil {
				reasoning = *m.ReasoningContent
			} else if strings.Contains(content, "</think>") {
				content = strings.TrimLeft(afterLast(m.Content, "</think>"), "\n")
				r, _, _ := strings.Cut(m.Content, "</think>")
				reasoning = strings.TrimLeft(afterLast(strings.TrimRight(r, "\n"), "<think>"), "\n")
			}
			b = append(b, "<|im_start|>assistant\n"...)
			if i > lastQuery && (last || reasoning != "") {
				b = append(b, "<think>\n"...)
				b = append(b, strings.Trim(reasoning, "\n")...)
				b = append(b, "\n</think>\n\n"...)
				b = append(b, strings.TrimLeft(content, "\n")...)
			} else {
				b = append(b, content...)
			}
			b = append(b, "<|im_end|>\n"...)
		case m.Role == "tool":
			if first || msgs[i-1].Role != "tool" {
				b = append(b, "<|im_start|>user"...)
			}
			b = append(b, "\n<tool_response>\n"...)
			b = append(b, m.Content...)
			b = append(b, "\n</tool_response>"...)
			if last || msgs[i+1].Role != "tool" {
				b = append(b, "<|im_end|>\n"...)
			}
		}
	}
	if opts.AddGenerationPrompt {
		b = append(b, "<|im_start|>assistant\n"...)
		if thinkingOff {
			b = append(b, "<think>\n\n</think>\n\n"...)
		}
	}
	return b, true
}

// renderLlama3 renders the Llama-3 Instruct template for conversations
// without chat_template_kwargs (which could rebind bos_token):
//
//	{% for message in messages %}{% set content = '<|start_header_id|>' +
//	message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim +
//	'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token +
//	content %}{% endif %}{{ content }}{% endfor %}
//	{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
//
// The generation prompt is written whatever add_generation_prompt says, as
// the template does. Jinja2's trim is Python's str.strip(), which also
// strips U+001C..U+001F; the Jinja library prefixlb uses strips only
// unicode.IsSpace, so for this template the native rendering is the exact
// one (TestLlama3Chat) and Jinja's is not.
func renderLlama3(b []byte, msgs []Message, opts ChatOptions, special map[string]string) ([]byte, bool) {
	if len(msgs) == 0 || len(opts.Kwargs) > 0 || len(opts.Tools) > 0 {
		return b, false
	}
	size := 64 + len(special["bos_token"])
	for i := range msgs {
		size += len(msgs[i].Role) + len(msgs[i].Content) + 48
	}
	b = slices.Grow(b, size)
	b = append(b, special["bos_token"]...)
	for i := range msgs {
		b = append(b, "<|start_header_id|>"...)
		b = append(b, msgs[i].Role...)
		b = append(b, "<|end_header_id|>\n\n"...)
		b = append(b, strings.TrimFunc(msgs[i].Content, isPySpace)...)
		b = append(b, "<|eot_id|>"...)
	}
	return append(b, "<|start_header_id|>assistant<|end_header_id|>\n\n"...), true
}

// isPySpace reports whether Python's str.isspace() holds for r: Unicode
// White_Space (unicode.IsSpace) and the separators U+001C..U+001F, which
// Python counts as whitespace by their bidirectional class.
func isPySpace(r rune) bool { return unicode.IsSpace(r) || 0x1c <= r && r <= 0x1f }

// afterLast is what follows the last sep in s (Python's s.split(sep)[-1]).
func afterLast(s, sep string) string {
	if i := strings.LastIndex(s, sep); i >= 0 {
		return s[i+len(sep):]
	}
	return s
}

// appendChat appends the rendering of msgs to dst when the template has a
// native renderer that covers them (ok=false otherwise: no template, no
// native renderer, or a conversation it leaves to Jinja).
func (t *Tokenizer) appendChat(dst []byte, msgs []Message, opts ChatOptions) ([]byte, bool) {
	if t.chat == nil || t.chat.native == nil {
		return dst, false
	}
	return t.chat.native(dst, msgs, opts, t.specialMap)
}

// renderPool recycles the buffers PrefixCache.AppendEncodeChat renders
// into: the rendering of a 60k-token chat is 240 KB that Encode reads once
// and does not keep.
var renderPool = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledRender bounds the buffers renderPool keeps.
const maxPooledRender = 8 << 20

// bytesString is b as a string, without a copy: b must not change while
// the string is in use.
func bytesString(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }
