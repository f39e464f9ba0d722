package report

import (
	"bytes"
	"os"
	"testing"
)

// FuzzReadJSON feeds the results-file reader arbitrary bytes: it must not
// panic, and what it accepts writes out to a file that reads back to the same
// bytes (writing is a fixed point after one read).
func FuzzReadJSON(f *testing.F) {
	if golden, err := os.ReadFile("testdata/results.golden.json"); err == nil {
		f.Add(golden)
	}
	for _, s := range []string{
		`{"results":[]}`, `{"results":null}`, `{}`, `null`, `[]`,
		`{"results":[{"policy":"e2","rate":1.5,"ttft_ms":{"p50":1e308}}]}`,
		`{"results":[{"policy":"e2","rate":"fast"}]}`,
		`{"results":[{"replicas":[{"name":"a","requests":-1}]}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := ReadJSON(bytes.NewReader(data))
		if err != nil {
			return
		}
		var once bytes.Buffer
		if err := WriteJSON(&once, file.Results); err != nil {
			t.Fatalf("write what was read: %v", err)
		}
		again, err := ReadJSON(bytes.NewReader(once.Bytes()))
		if err != nil {
			t.Fatalf("read back %q: %v", once.Bytes(), err)
		}
		var twice bytes.Buffer
		if err := WriteJSON(&twice, again.Results); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(once.Bytes(), twice.Bytes()) {
			t.Fatalf("not a fixed point:\n%s\n%s", once.Bytes(), twice.Bytes())
		}
	})
}
