// Package benchtext builds the long conversations prefixlb's benchmarks
// send, from internal/tokenize's testdata/bench_text.json.gz (ShareGPT
// prompts and LooGLE documents; see the file's "note" for sources and
// licences). It reads the file from the source tree, so it serves tests
// and benchmarks only.
package benchtext

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// Chat60k returns the messages of a ~58k-token conversation (a system
// prompt, LooGLE documents cut to 57,000 of tok's tokens, the assistant's
// answer) and a ~2k-token new user turn of ShareGPT prompts.
func Chat60k(tok *tokenize.Tokenizer) (history []map[string]string, tail string, err error) {
	_, here, _, _ := runtime.Caller(0)
	f, err := os.Open(filepath.Join(filepath.Dir(here), "..", "testdata", "bench_text.json.gz"))
	if err != nil {
		return nil, "", fmt.Errorf("benchtext: %w", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, "", fmt.Errorf("benchtext: %w", err)
	}
	var d struct {
		ShareGPT []string `json:"sharegpt"`
		Loogle   []string `json:"loogle"`
	}
	if err := json.NewDecoder(zr).Decode(&d); err != nil {
		return nil, "", fmt.Errorf("benchtext: %w", err)
	}
	docText := strings.Join(d.Loogle, "\n\n") + "\n\n"
	if ids := tok.Encode(docText); len(ids) > 57000 {
		docText = strings.ToValidUTF8(tok.Decode(ids[:57000]), "")
	}
	history = []map[string]string{
		{"role": "system", "content": "You are a careful research assistant. Answer from the documents."},
		{"role": "user", "content": "Read these documents.\n\n" + docText},
		{"role": "assistant", "content": "I have read the documents. What would you like to know?"},
	}
	var t strings.Builder
	for _, p := range d.ShareGPT {
		if t.Len() > 8000 {
			break
		}
		t.WriteString(p)
		t.WriteString("\n")
	}
	return history, t.String(), nil
}

// ChatJSON is a chat completion body for model "m" with history and a last
// user turn, streamed.
func ChatJSON(history []map[string]string, last string) ([]byte, error) {
	msgs := append(append([]map[string]string(nil), history...), map[string]string{"role": "user", "content": last})
	return json.Marshal(map[string]any{"model": "m", "messages": msgs, "max_tokens": 100, "stream": true})
}
