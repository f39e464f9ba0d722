package tokenize

import (
	"encoding/json"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
)

type chatCase struct {
	Name                string                     `json:"name"`
	AddGenerationPrompt bool                       `json:"add_generation_prompt"`
	Messages            []Message                  `json:"messages"`
	Tools               []json.RawMessage          `json:"tools"`
	Kwargs              map[string]json.RawMessage `json:"kwargs"`
}

// TestChatTemplateGolden renders the Qwen3 template and compares it with
// testdata/chat/golden.json, which Python's Jinja2 produced with Hugging
// Face's settings (testdata/chat/gen_golden.py).
func TestChatTemplateGolden(t *testing.T) {
	tok := qwen3(t)
	var cases []chatCase
	readJSON(t, "testdata/chat/cases.json", &cases)
	var golden map[string]string
	readJSON(t, "testdata/chat/golden.json", &golden)
	if len(cases) != len(golden) {
		t.Fatalf("%d cases, %d goldens", len(cases), len(golden))
	}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			got, err := tok.ApplyChatTemplate(c.Messages, ChatOptions{AddGenerationPrompt: c.AddGenerationPrompt, Tools: c.Tools, Kwargs: c.Kwargs})
			if err != nil {
				t.Fatal(err)
			}
			if want := golden[c.Name]; got != want {
				t.Errorf("rendered\n%s\nwant\n%s", got, want)
			}
			ids, err := tok.EncodeChat(c.Messages, ChatOptions{AddGenerationPrompt: c.AddGenerationPrompt, Tools: c.Tools, Kwargs: c.Kwargs})
			if err != nil || !slices.Equal(ids, tok.Encode(got)) {
				t.Errorf("EncodeChat differs from Encode(ApplyChatTemplate): %v", err)
			}
		})
	}
}

func TestChatSimpleByHand(t *testing.T) {
	tok := qwen3(t)
	got, err := tok.ApplyChatTemplate([]Message{{Role: "system", Content: "S"}, {Role: "user", Content: "U"}}, ChatOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	want := "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	ids := tok.Encode(got)
	if ids[0] != 151644 || ids[len(ids)-1] != 198 || ids[len(ids)-2] != 77091 {
		t.Errorf("ids %v: want <|im_start|> ... assistant \\n", ids)
	}
}

func TestMessageUnmarshal(t *testing.T) {
	cases := []struct{ in, want string }{
		{`{"role":"user","content":"hi"}`, "hi"},
		{`{"role":"assistant","content":null}`, ""},
		{`{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}`, "a\nb"},
	}
	for _, c := range cases {
		var m Message
		if err := json.Unmarshal([]byte(c.in), &m); err != nil {
			t.Fatal(err)
		}
		if m.Content != c.want {
			t.Errorf("%s: content %q, want %q", c.in, m.Content, c.want)
		}
	}
	var m Message
	if err := json.Unmarshal([]byte(`{"role":"user","content":5}`), &m); err == nil {
		t.Error("numeric content accepted")
	}
}

func TestNoChatTemplate(t *testing.T) {
	tok, err := New(tinyTokenizer(t, false, gpt2Pre, "null"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tok.ApplyChatTemplate(nil, ChatOptions{}); !errors.Is(err, ErrNoChatTemplate) {
		t.Errorf("err = %v, want ErrNoChatTemplate", err)
	}
	if err := tok.SetChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"); err != nil {
		t.Fatal(err)
	}
	got, err := tok.ApplyChatTemplate([]Message{{Role: "user", Content: "x"}}, ChatOptions{})
	if err != nil || got != "[user]x" {
		t.Errorf("got %q, %v", got, err)
	}
	cfg := `{"chat_template":[{"name":"tool_use","template":"T"},{"name":"default","template":"D{{ eos_token }}"}],"eos_token":{"content":"<eos>"}}`
	tok, err = New(tinyTokenizer(t, false, gpt2Pre, "null"), []byte(cfg))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := tok.ApplyChatTemplate(nil, ChatOptions{}); err != nil || !strings.HasPrefix(got, "D<eos>") {
		t.Errorf("named templates: got %q, %v", got, err)
	}
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
