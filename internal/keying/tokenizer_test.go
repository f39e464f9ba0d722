package keying

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/openai"

	"github.com/prefixlb/prefixlb/internal/blocks"
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

func mustParse(t *testing.T, k openai.Kind, body string) *openai.Request {
	t.Helper()
	r, err := openai.ParseRequest(k, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestTokenizerKeyerText(t *testing.T) {
	tok := testTokenizer(t)
	k := NewTokenizerKeyer(tok, 16)
	text := strings.Repeat("The quick brown fox jumps over the lazy dog, 12345 times.\n", 20) + "<|im_end|> tail"
	want := tok.Encode(text)
	tests := []struct {
		name       string
		body       string
		wantIDs    []uint32 // keyed
		wantTokens int
	}{
		{"text", fmt.Sprintf(`{"model":"m","prompt":%q}`, text), want, len(want)},
		{"batch of texts", fmt.Sprintf(`{"model":"m","prompt":[%q,"hello world"]}`, text), want, len(want) + 2},
		{"token ids", `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`,
			[]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, 17},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			keys, n, err := k.Keys(mustParse(t, openai.KindCompletion, tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if wantKeys := blocks.Keys(nil, tt.wantIDs, 16); !slices.Equal(keys, wantKeys) {
				t.Errorf("got %d keys, want %d (blocks.Keys of the ids)", len(keys), len(wantKeys))
			}
			if n != tt.wantTokens {
				t.Errorf("prompt tokens %d, want %d", n, tt.wantTokens)
			}
		})
	}
}

func TestTokenizerKeyerChat(t *testing.T) {
	tok := testTokenizer(t)
	k := NewTokenizerKeyer(tok, 16)
	system := strings.Repeat("You are a careful assistant. Follow the rules below.\n", 30)
	tool := `{"type":"function","function":{"name":"get_weather","description":"Weather in <city> & more","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}`
	msgs := []tokenize.Message{
		{Role: "system", Content: system},
		{Role: "user", Content: "What's the weather in Paris?\nAnd in Zürich?"},
		{Role: "assistant", ToolCalls: []tokenize.ToolCall{{ID: "c1", Type: "function",
			Function: tokenize.FunctionCall{Name: "get_weather", Arguments: `{"city": "Paris"}`}}}},
		{Role: "tool", Content: "18°C", ToolCallID: "c1"},
	}
	msgJSON, err := json.Marshal(msgs)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		body string
		msgs []tokenize.Message
		opts tokenize.ChatOptions
	}{
		{"system and user", fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":"hi"}]}`, system),
			msgs[:1:1], tokenize.ChatOptions{AddGenerationPrompt: true}},
		{"content parts joined", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`,
			[]tokenize.Message{{Role: "user", Content: "a\nb"}}, tokenize.ChatOptions{AddGenerationPrompt: true}},
		{"tools and tool calls", fmt.Sprintf(`{"model":"m","messages":%s,"tools":[%s]}`, msgJSON, tool),
			msgs, tokenize.ChatOptions{AddGenerationPrompt: true, Tools: []json.RawMessage{json.RawMessage(tool)}}},
		{"no generation prompt, kwargs", `{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false}}`,
			[]tokenize.Message{{Role: "user", Content: "x"}},
			tokenize.ChatOptions{Kwargs: map[string]json.RawMessage{"enable_thinking": json.RawMessage("false")}}},
	}
	tests[0].msgs = []tokenize.Message{{Role: "system", Content: system}, {Role: "user", Content: "hi"}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want, err := tok.EncodeChat(tt.msgs, tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			keys, n, err := k.Keys(mustParse(t, openai.KindChat, tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if wantKeys := blocks.Keys(nil, want, 16); !slices.Equal(keys, wantKeys) {
				t.Errorf("got %d keys, want %d (blocks.Keys of EncodeChat)", len(keys), len(wantKeys))
			}
			if n != len(want) {
				t.Errorf("prompt tokens %d, want %d", n, len(want))
			}
		})
	}

	// Fallback: text chunks, exactly ChunkKeyer's keys.
	r := mustParse(t, openai.KindChat, tests[0].body)
	k.SetFallback(true)
	got, n, _ := k.Keys(r)
	want, wn, _ := ChunkKeyer{BlockTokens: 16}.Keys(r)
	if !slices.Equal(got, want) || n != wn {
		t.Errorf("fallback: %d keys, %d tokens; ChunkKeyer %d keys, %d tokens", len(got), n, len(want), wn)
	}
}

// TestQwen3ProbeIDs: the probe ids an auto keyer checks replicas with
// before it loads Qwen3 are Qwen3's own, and its keys stay text chunks
// until Load has loaded it.
func TestQwen3ProbeIDs(t *testing.T) {
	tok, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	c := NewTokenizerCheck(tok)
	if !slices.Equal(c.want, qwen3ProbeIDs) || !slices.Equal(c.wantChat, qwen3ProbeChatIDs) {
		t.Fatalf("qwen3probe.go is stale: prompt %v, chat %v", c.want, c.wantChat)
	}
	k := NewAutoTokenizerKeyer(16)
	if k.Tokenizer() != nil {
		t.Fatal("an auto keyer loaded its tokenizer before Load")
	}
	k.SetFallback(false)
	r := &openai.Request{Texts: []string{strings.Repeat("hello world ", 100)}}
	chunks, _, _ := ChunkKeyer{BlockTokens: 16}.Keys(r)
	if keys, _, _ := k.Keys(r); !slices.Equal(keys, chunks) {
		t.Error("an auto keyer not yet loaded keys text by token ids")
	}
	k.Load()
	<-k.Ready()
	if err := k.LoadErr(); err != nil {
		t.Fatal(err)
	}
	if keys, _, _ := k.Keys(r); slices.Equal(keys, chunks) || len(keys) != len(tok.Encode(r.Texts[0]))/16 {
		t.Errorf("a loaded auto keyer: %d keys, want the token ids' %d blocks", len(keys), len(tok.Encode(r.Texts[0]))/16)
	}
}
