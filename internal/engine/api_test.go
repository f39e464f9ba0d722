package engine

import (
	"reflect"
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

func TestDecodeCompletion(t *testing.T) {
	tests := []struct {
		body string
		want genRequest
	}{
		{`{"prompt":"hello world"}`, genRequest{text: "hello world"}},
		{`{"prompt":["hello"],"max_tokens":5,"model":"m"}`, genRequest{text: "hello", maxTokens: 5, model: "m"}},
		{`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
			genRequest{ids: []uint32{1, 2, 3}, isIDs: true, stream: true, includeUsage: true}},
		{`{"prompt":[[7, 4294967295]],"max_tokens":null,"n":1,"ignore_eos":true,"min_tokens":2}`,
			genRequest{ids: []uint32{7, 4294967295}, isIDs: true}},
		{`{"prompt":"x","stream_options":{"continuous_usage_stats":true},"temperature":0.7,"whatever":{"a":[1]}}`,
			genRequest{text: "x", continuousUsage: true}},
	}
	for _, tt := range tests {
		got, err := decodeCompletion([]byte(tt.body))
		if err != nil {
			t.Errorf("%s: %v", tt.body, err)
			continue
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tt.body, got, tt.want)
		}
	}
}

func TestDecodeChat(t *testing.T) {
	body := `{"model":"m","messages":[{"role":"system","content":null},
		{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
		{"role":"assistant","content":"c","name":"bot"}],"max_tokens":3,"max_completion_tokens":4,"stream":true}`
	got, err := decodeChat([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := genRequest{model: "m", chat: true, maxTokens: 4, stream: true, messages: []ChatMessage{
		{"system", ""}, {"user", "a\nb"}, {"assistant", "c"},
	}}
	// What a chat template would get: the same messages, the name kept,
	// add_generation_prompt defaulting to true.
	wantTmpl := chatInput{messages: []tokenize.Message{{Role: "system"}, {Role: "user", Content: "a\nb"},
		{Role: "assistant", Content: "c", Name: "bot"}}, opts: tokenize.ChatOptions{AddGenerationPrompt: true}}
	if !reflect.DeepEqual(got.tmpl, wantTmpl) {
		t.Errorf("template input %+v\nwant %+v", got.tmpl, wantTmpl)
	}
	got.tmpl = chatInput{}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
	if r := RenderChat(got.messages); r != "<|system|>\n\n<|user|>\na\nb\n<|assistant|>\nc\n<|assistant|>\n" {
		t.Errorf("RenderChat: %q", r)
	}
}

// checkDecoded checks the invariants of a decoder's result.
func checkDecoded(t *testing.T, g genRequest, err error) {
	t.Helper()
	if err != nil {
		if !isBadRequest(err) {
			t.Fatalf("error %v is not a request error", err)
		}
		return
	}
	if g.maxTokens < 0 {
		t.Fatalf("maxTokens %d", g.maxTokens)
	}
	if g.isIDs && len(g.ids) == 0 {
		t.Fatal("token-id prompt without ids")
	}
	if g.chat && len(g.messages) == 0 {
		t.Fatal("chat without messages")
	}
}

func FuzzDecodeCompletion(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"hello","max_tokens":3}`,
		`{"prompt":[[1,2]],"stream":true}`,
		`{"prompt":["a","b"]}`,
		`{"prompt":[1,"a"]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		g, err := decodeCompletion(body)
		checkDecoded(t, g, err)
		if err == nil && g.chat {
			t.Fatal("completion decoded as chat")
		}
	})
}

func FuzzDecodeChat(f *testing.F) {
	for _, s := range []string{
		`{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true}`,
		`{"messages":[{"role":"user"}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		g, err := decodeChat(body)
		checkDecoded(t, g, err)
		if err == nil {
			_ = RenderChat(g.messages)
		}
		tg, err := decodeTokenize(body)
		checkDecoded(t, tg, err)
	})
}

func TestKVEventDefaults(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"tcp://*:5557", "tcp://*:5558"},
		{"tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"},
		{"tcp://[::1]:7000", "tcp://[::1]:7001"},
		{"tcp://*", ""},
		{"5557", ""},
	} {
		got, err := DefaultReplayEndpoint(tt.in)
		if got != tt.want || (err != nil) != (tt.want == "") {
			t.Errorf("DefaultReplayEndpoint(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
	if got := DefaultKVTopic("0.0.0.0:8000", "m"); got != "kv@0.0.0.0:8000@m" {
		t.Errorf("DefaultKVTopic = %q", got)
	}
}
