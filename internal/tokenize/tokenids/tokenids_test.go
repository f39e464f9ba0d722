package tokenids

import (
	"bytes"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// bundled is the bundled tokenizer, loaded once (seconds on a busy machine).
var bundled = sync.OnceValues(func() (*tokenize.Tokenizer, error) { return Load("") })

// run writes in's ids (Write) with the bundled tokenizer.
func run(t *testing.T, c Config, in string) string {
	t.Helper()
	tok, err := bundled()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := Write(&out, tok, c, []byte(in)); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

func TestRun(t *testing.T) {
	var out bytes.Buffer
	if err := Run(Config{}, strings.NewReader("Hello, world! <|im_start|>user hi<|im_end|>\n"), &out); err != nil {
		t.Fatal(err)
	}
	if want := "[9707,11,1879,0,220,151644,872,15588,151645,198]\n"; out.String() != want {
		t.Errorf("got %q, want %q", out.String(), want)
	}
}

func TestWriteText(t *testing.T) {
	got := run(t, Config{}, "Hello, world! <|im_start|>user hi<|im_end|>\n")
	if want := "[9707,11,1879,0,220,151644,872,15588,151645,198]\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := run(t, Config{}, ""); got != "[]\n" {
		t.Errorf("empty: %q", got)
	}
}

func TestWriteChat(t *testing.T) {
	// A bare list of messages and a body give the same prompt.
	list := run(t, Config{Chat: true}, `[{"role":"user","content":"hi there"}]`)
	body := run(t, Config{Chat: true}, ` {"messages":[{"role":"user","content":"hi there"}]}`)
	if want := "[151644,872,198,6023,1052,151645,198,151644,77091,198]\n"; list != want || body != want {
		t.Errorf("list %q, body %q, want %q", list, body, want)
	}
	got := run(t, Config{Chat: true, Render: true}, `{"messages":[{"role":"user","content":"hi there"}],"add_generation_prompt":false}`)
	if want := "<|im_start|>user\nhi there<|im_end|>\n"; got != want {
		t.Errorf("render: %q, want %q", got, want)
	}
	got = run(t, Config{Chat: true, Render: true}, `{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}`)
	if want := "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"; got != want {
		t.Errorf("kwargs: %q, want %q", got, want)
	}
}

func TestRunErrors(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		in   string
		want string
	}{
		{Config{Render: true}, "hi", "tokenize: --render needs --chat"},
		{Config{Tokenizer: "/nonexistent"}, "hi", "tokenize: load: "},
	} {
		if err := Run(tc.c, strings.NewReader(tc.in), &bytes.Buffer{}); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.c, err, tc.want)
		}
	}
	tok, err := bundled()
	if err != nil {
		t.Fatal(err)
	}
	if err := Write(&bytes.Buffer{}, tok, Config{Chat: true}, []byte("{bad")); err == nil || !strings.HasPrefix(err.Error(), "tokenize: parse chat JSON: ") {
		t.Errorf("bad chat: %v", err)
	}
}

func TestAppendJSON(t *testing.T) {
	if got := string(AppendJSON([]byte("x"), []uint32{0, 4294967295})); got != "x[0,4294967295]\n" {
		t.Errorf("got %q", got)
	}
}
