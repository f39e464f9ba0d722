package dataset

import (
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// The repository's samples (testdata/README.md) and this package's
// hand-written multi-turn conversations.
const (
	shareGPTSample = "../../testdata/sharegpt-sample.json"
	looGLESample   = "../../testdata/loogle-sample.jsonl"
	multiTurn      = "testdata/multiturn.json"
)

func qwen(t testing.TB) *tokenize.Tokenizer {
	t.Helper()
	tok, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func readShareGPT(t *testing.T, name string) ([]Conversation, ShareGPTStats) {
	t.Helper()
	fh, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	convs, st, err := ReadShareGPT(fh)
	if err != nil {
		t.Fatal(err)
	}
	return convs, st
}

func TestReadShareGPT(t *testing.T) {
	convs, st := readShareGPT(t, multiTurn)
	if st.Entries != 5 || st.Dropped != 2 || len(convs) != 3 {
		t.Fatalf("entries %d, dropped %d, conversations %d; want 5, 2, 3", st.Entries, st.Dropped, len(convs))
	}
	var got []string
	for _, c := range convs {
		roles := make([]string, len(c.Messages))
		for i, m := range c.Messages {
			roles[i] = m.Role[:1]
		}
		got = append(got, c.ID+":"+strings.Join(roles, ""))
	}
	want := []string{"chat-a:uauauau", "chat-b:uauaua", "chat-c:ua"}
	if !slices.Equal(got, want) {
		t.Errorf("conversations %v, want %v (chat-b's leading answer skipped)", got, want)
	}
	if m := convs[0].Messages[2].Content; m != "  And how does a router use it?\n" {
		t.Errorf("message kept as %q, want it as the file has it", m)
	}

	sample, st := readShareGPT(t, shareGPTSample)
	if len(sample) != 120 || st.Dropped != 0 {
		t.Errorf("sample: %d conversations, %d dropped; want 120, 0", len(sample), st.Dropped)
	}
}

func TestReadShareGPTMalformed(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"empty", ``, "sharegpt: EOF"},
		{"object", `{"conversations": []}`, "want a JSON array"},
		{"number entry", `[1]`, "sharegpt entry 0"},
		{"from not a string", `[{"conversations": [{"from": 1, "value": "x"}]}]`, "sharegpt entry 0"},
		{"no value", `[{"id": "x", "conversations": [{"from": "human"}]}]`, `entry 0 (x) message 0: want string "from" and "value"`},
		{"conversations not a list", `[{"conversations": "hi"}]`, "sharegpt entry 0"},
		{"truncated", `[{"conversations": [{"from": "human", "value": "a"}]}, {"id"`, "sharegpt entry 1"},
		{"unclosed", `[{"conversations": [{"from": "human", "value": "a"}]}`, "after entry 1"},
		{"trailing data", `[] []`, "data after the array"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := ReadShareGPT(strings.NewReader(tc.in))
			if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want ErrFormat containing %q", err, tc.want)
			}
		})
	}
}

func TestReadLooGLE(t *testing.T) {
	fh, err := os.Open(looGLESample)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	docs, err := ReadLooGLE(fh)
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) != 2 || len(docs[0].Questions) != 11 || len(docs[1].Questions) != 25 {
		t.Fatalf("%d documents, want 2 of 11 and 25 questions", len(docs))
	}
	if len(docs[0].Text) != 68760 && len([]rune(docs[0].Text)) != 68760 {
		t.Errorf("document 0 has %d characters, want 68760", len([]rune(docs[0].Text)))
	}
	if q := docs[0].Questions[0]; q.Q != "Where was José Luis Picardo born and raised?" || !strings.HasPrefix(q.A, "He was born in Jerez de la Frontera") {
		t.Errorf("first question %+v", q)
	}
}

func TestReadLooGLEMalformed(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"not json", `{"input": `, "loogle line 1"},
		{"no input", "\n" + `{"title": "t", "qa_pairs": "[]"}`, `loogle line 2: no string "input"`},
		{"python syntax", `{"input": "d", "title": "t", "qa_pairs": "[{'Q': 'a', 'A': }]"}`, "line 1 (t): qa_pairs: python literal at byte"},
		{"not a list", `{"input": "d", "qa_pairs": "{'Q': 'a'}"}`, "want a list of dicts, found dict"},
		{"not dicts", `{"input": "d", "qa_pairs": "['a']"}`, "item 0: want a dict, found str"},
		{"no answer", `{"input": "d", "qa_pairs": "[{'Q': 'a'}]"}`, "item 0: want string 'Q' and 'A'"},
		{"json list of numbers", `{"input": "d", "qa_pairs": [1]}`, "item 0: want a dict, found number"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadLooGLE(strings.NewReader(tc.in))
			if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want ErrFormat containing %q", err, tc.want)
			}
		})
	}
	docs, err := ReadLooGLE(strings.NewReader(`{"input": "d", "qa_pairs": "none", "question": "none"}` + "\n\n" +
		`{"input": "e", "title": "T", "qa_pairs": [{"Q": "q", "A": "a"}]}`))
	if err != nil || len(docs) != 2 || len(docs[0].Questions) != 0 || docs[0].Title != "#1" ||
		!reflect.DeepEqual(docs[1], Document{Title: "T", Text: "e", Questions: []QA{{"q", "a"}}}) {
		t.Errorf("docs %+v, err %v", docs, err)
	}
}

func TestPyLiteral(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want any
	}{
		{`'a'`, "a"},
		{`"it's"`, "it's"},
		{`'It\'s \"q\" \\ \n\t\x41\u00e9\U0001F600\101\q'`, "It's \"q\" \\ \n\tAé😀A\\q"},
		{`'ab' "cd"`, "abcd"},
		{`'''multi
line'''`, "multi\nline"},
		{`[1, -2.5, 3e2, True, False, None]`, []any{1.0, -2.5, 300.0, true, false, nil}},
		{`( 'a' , ('b',) , )`, []any{"a", []any{"b"}}},
		{`{'Q': 'q?', 'A': ['x', {'k': 'v'}],}`, map[string]any{"Q": "q?", "A": []any{"x", map[string]any{"k": "v"}}}},
		{"[\n  'a',\n  'b'\n]", []any{"a", "b"}},
		{`[]`, []any{}},
		{`{}`, map[string]any{}},
	} {
		got, err := (&pyParser{s: tc.in}).literal()
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: got %#v, %v; want %#v", tc.in, got, err, tc.want)
		}
	}
	for _, in := range []string{``, `'a`, `"a\"`, "'a\nb'", `[1, 2`, `[1 2]`, `{1: 'a'}`, `{'a' 'b'}`, `{'a': }`,
		`Truex`, `x`, `'\x4'`, `'\UFFFFFFFF'`, `1.2.3`, `[] 1`, strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1)} {
		if v, err := (&pyParser{s: in}).literal(); err == nil {
			t.Errorf("%q: got %#v, want an error", in, v)
		}
	}
}

// requests builds the requests of the multi-turn conversations, all of
// them, with the Qwen3 tokenizer.
func multiTurnRequests(t *testing.T, chat bool) []workload.Request {
	t.Helper()
	convs, _ := readShareGPT(t, multiTurn)
	reqs, err := ShareGPTRequests(convs, Options{Tokenizer: qwen(t), Chat: chat, Sessions: 2, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 4+3+1 {
		t.Fatalf("%d requests, want 8 (one per user turn)", len(reqs))
	}
	return reqs
}

// TestShareGPTTurnPrefix is the property multi-turn replay is for: each
// turn re-sends the conversation so far, so turn k+1's token ids start
// with turn k's prompt: exactly in text mode, and in chat mode as far as
// Qwen3's chat template allows: the rendered chat of turn k is a text
// prefix of turn k+1's, but its last token, the "\n" after
// "<|im_start|>assistant", merges with an answer that starts with a new
// line (as the engine's own tokenization of the whole chat merges them).
// In text mode turn k+1 also carries the recorded answer's ids up to its
// last pre-token (whose last bytes may merge with the "\n\n" after it).
func TestShareGPTTurnPrefix(t *testing.T) {
	tok := qwen(t)
	for _, chat := range []bool{false, true} {
		reqs := multiTurnRequests(t, chat)
		last := map[string]workload.Request{}
		for i, r := range reqs {
			if r.ID != i {
				t.Fatalf("request %d has ID %d", i, r.ID)
			}
			prev, ok := last[r.Session]
			last[r.Session] = r
			if r.AwaitPrevious != ok {
				t.Errorf("chat %v request %d: AwaitPrevious %v, want %v", chat, i, r.AwaitPrevious, ok)
			}
			// Tokens are the encoding of what is sent.
			want := tok.Encode(r.Text)
			if chat {
				var err error
				if want, err = tok.EncodeChat(toChat(r.Messages), tokenize.ChatOptions{AddGenerationPrompt: true}); err != nil {
					t.Fatal(err)
				}
			}
			if !slices.Equal(r.Tokens, want) {
				t.Fatalf("chat %v request %d: Tokens are not the encoding of its prompt", chat, i)
			}
			if r.Messages[len(r.Messages)-1].Role != "user" {
				t.Errorf("request %d ends with a %s message", i, r.Messages[len(r.Messages)-1].Role)
			}
			if !ok {
				continue
			}
			n := len(prev.Tokens)
			if chat {
				n-- // the generation prompt's last "\n"
				pc, _ := tok.ApplyChatTemplate(toChat(prev.Messages), tokenize.ChatOptions{AddGenerationPrompt: true})
				rc, _ := tok.ApplyChatTemplate(toChat(r.Messages), tokenize.ChatOptions{AddGenerationPrompt: true})
				if !strings.HasPrefix(rc, pc) {
					t.Errorf("session %s: turn %d's chat does not start with the previous turn's", r.Session, len(r.Messages)/2)
				}
			}
			if len(r.Tokens) <= n || !slices.Equal(r.Tokens[:n], prev.Tokens[:n]) {
				t.Errorf("chat %v session %s: turn %d's ids do not start with the previous turn's %d",
					chat, r.Session, len(r.Messages)/2, n)
			}
			if chat {
				continue
			}
			answer := r.Messages[len(r.Messages)-2].Content
			withAnswer := tok.Encode(prev.Text + " " + strings.TrimSpace(answer))
			n = len(withAnswer) - 1
			if !slices.Equal(r.Tokens[:n], withAnswer[:n]) {
				t.Errorf("session %s: turn %d does not carry the previous prompt and answer as ids", r.Session, len(r.Messages)/2)
			}
		}
	}
}

func toChat(msgs []workload.Message) []tokenize.Message {
	out := make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		out[i] = tokenize.Message{Role: m.Role, Content: m.Content}
	}
	return out
}

func TestShareGPTText(t *testing.T) {
	got := ShareGPTText([]workload.Message{{Role: "user", Content: " Hi\n"}, {Role: "assistant", Content: "Hello.\n"}, {Role: "user", Content: "Bye"}})
	want := "User: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"
	if got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestShareGPTOutputs(t *testing.T) {
	tok := qwen(t)
	convs, _ := readShareGPT(t, multiTurn)
	reqs, err := ShareGPTRequests(convs, Options{Tokenizer: tok, MaxOutputTokens: 20, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		c := convs[slices.IndexFunc(convs, func(c Conversation) bool { return c.ID == r.Group })]
		end := len(r.Messages)
		want := UnansweredOutputTokens
		if end < len(c.Messages) {
			want = max(1, len(tok.Encode(c.Messages[end].Content)))
		}
		if want = min(want, 20); r.OutputTokens != want {
			t.Errorf("%s turn %d: output %d, want %d", r.Group, end/2, r.OutputTokens, want)
		}
	}
	// --output-tokens and --requests.
	reqs, err = ShareGPTRequests(convs, Options{Tokenizer: tok, OutputTokens: 7, Requests: 3})
	if err != nil || len(reqs) != 3 || reqs[0].OutputTokens != 7 {
		t.Errorf("%d requests, err %v; want 3 of output 7", len(reqs), err)
	}
	if _, err := ShareGPTRequests(nil, Options{Tokenizer: tok}); !errors.Is(err, ErrEmpty) {
		t.Errorf("no conversations: err %v, want ErrEmpty", err)
	}
}

func TestLooGLERequests(t *testing.T) {
	tok := qwen(t)
	reqs, err := Load(workload.DatasetSpec{Name: workload.DatasetLooGLE, File: looGLESample, MaxOutputTokens: 64, Sessions: 1},
		workload.Spec{Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 36 {
		t.Fatalf("%d requests, want 36 (one per question)", len(reqs))
	}
	docTokens := map[string]int{}
	first := map[string][]uint32{}
	for i, r := range reqs {
		if !strings.HasPrefix(r.Text, "Please answer the question based on the long texts below. \n") || !strings.HasSuffix(r.Text, "\nAnswer: ") {
			t.Fatalf("request %d: text %.80q…", i, r.Text)
		}
		if r.AwaitPrevious || r.Session != "" || r.OutputTokens < 1 || r.OutputTokens > 64 {
			t.Errorf("request %d: %+v", i, r)
		}
		if p, ok := first[r.Group]; ok {
			n := 0
			for n < min(len(p), len(r.Tokens)) && p[n] == r.Tokens[n] {
				n++
			}
			docTokens[r.Group] = max(docTokens[r.Group], n)
		} else {
			first[r.Group] = r.Tokens
		}
	}
	if len(first) != 2 {
		t.Fatalf("%d documents, want 2", len(first))
	}
	for g, n := range docTokens {
		if n < 10000 {
			t.Errorf("questions on %s share %d tokens, want the document (over 10,000)", g, n)
		}
	}
	if !slices.Equal(reqs[0].Tokens, tok.Encode(reqs[0].Text)) {
		t.Error("Tokens are not the encoding of Text")
	}
}

func TestLoadShareGPTSample(t *testing.T) {
	d := workload.DefaultDatasetSpec()
	d.Name, d.File = workload.DatasetShareGPT, shareGPTSample
	reqs, err := Load(d, workload.Spec{Requests: 50, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 50 {
		t.Fatalf("%d requests, want 50", len(reqs))
	}
	for _, r := range reqs {
		if r.OutputTokens != UnansweredOutputTokens || len(r.Messages) != 1 || r.AwaitPrevious || len(r.Tokens) < 5 {
			t.Errorf("request %d: output %d, %d messages, %d tokens", r.ID, r.OutputTokens, len(r.Messages), len(r.Tokens))
		}
	}
	for _, tc := range []struct {
		d    workload.DatasetSpec
		want string
	}{
		{workload.DatasetSpec{Name: "nope", File: "x", MaxOutputTokens: 1, Sessions: 1}, `--dataset "nope"`},
		{workload.DatasetSpec{Name: "loogle", MaxOutputTokens: 1, Sessions: 1}, "needs its FILE"},
		{workload.DatasetSpec{Name: "loogle", File: "x", Sessions: 1}, "--max-output-tokens 0"},
		{workload.DatasetSpec{Name: "loogle", File: "/nonexistent", MaxOutputTokens: 1, Sessions: 1}, "no such file"},
		{workload.DatasetSpec{Name: "loogle", File: shareGPTSample, MaxOutputTokens: 1, Sessions: 1}, "loogle line 1"},
		{workload.DatasetSpec{Name: "sharegpt", File: looGLESample, MaxOutputTokens: 1, Sessions: 1}, "want a JSON array"},
	} {
		if _, err := Load(tc.d, workload.Spec{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", tc.d, err, tc.want)
		}
	}
}
