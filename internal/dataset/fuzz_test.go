package dataset

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzReadShareGPT: any input is read or refused with ErrFormat, never a
// panic, and every conversation read alternates user and assistant from a
// user's turn.
func FuzzReadShareGPT(f *testing.F) {
	f.Add([]byte(`[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]`))
	f.Add([]byte(`[{"conversation": [{"from": "gpt", "value": "x"}, {"from": "user", "value": "y"}]}, {"id": 7}]`))
	f.Add([]byte(`[{"conversations": [{"from": "system", "value": "s"}]}] `))
	f.Fuzz(func(t *testing.T, b []byte) {
		convs, st, err := ReadShareGPT(bytes.NewReader(b))
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %v does not wrap ErrFormat", err)
			}
			return
		}
		if len(convs)+st.Dropped != st.Entries {
			t.Fatalf("%d conversations + %d dropped != %d entries", len(convs), st.Dropped, st.Entries)
		}
		for _, c := range convs {
			for i, m := range c.Messages {
				want := "user"
				if i%2 == 1 {
					want = "assistant"
				}
				if m.Role != want {
					t.Fatalf("conversation %s message %d is %s, want %s", c.ID, i, m.Role, want)
				}
			}
		}
	})
}

// FuzzReadLooGLE: any input is read or refused with ErrFormat, never a
// panic.
func FuzzReadLooGLE(f *testing.F) {
	f.Add([]byte(`{"input": "doc", "title": "t", "qa_pairs": "[{'Q': 'q?', 'A': \"it's\"}]"}` + "\n"))
	f.Add([]byte(`{"input": "doc", "qa_pairs": "none"}` + "\n\n" + `{"input": "", "qa_pairs": [{"Q": "q", "A": "a"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		docs, err := ReadLooGLE(bytes.NewReader(b))
		if err != nil && !errors.Is(err, ErrFormat) {
			t.Fatalf("error %v does not wrap ErrFormat", err)
		}
		if err != nil && docs != nil {
			t.Fatal("documents returned with an error")
		}
	})
}

// FuzzPyLiteral: the Python literal parser never panics and never reads
// past its input; what it accepts, it accepts whole.
func FuzzPyLiteral(f *testing.F) {
	for _, s := range []string{`[{'Q': "a\nb", 'A': '\'x\''}]`, `('a', [1, -2.5e3, None, True], {'k': ()})`,
		`'''x'''  "y"`, `'\x41\u00e9\U0001F600\101'`, `[[[[]]]]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p := &pyParser{s: s}
		if _, err := p.literal(); err == nil && p.i != len(s) {
			t.Fatalf("accepted %q but stopped at byte %d", s, p.i)
		}
	})
}
