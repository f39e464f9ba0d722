// Package qwen3 embeds the Qwen3 tokenizer (gzip-compressed tokenizer.json
// and tokenizer_config.json with its chat template), so programs have a real
// tokenizer offline without a model directory. See README.md for its source
// and licence. Importing the package adds about 2 MB to a binary.
package qwen3

import (
	"bytes"
	"compress/gzip"
	_ "embed"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

//go:embed tokenizer.json.gz
var tokenizerJSONGz []byte

//go:embed tokenizer_config.json
var tokenizerConfigJSON []byte

// Load parses the embedded Qwen3 tokenizer. It takes about a second; callers
// should load once and share the result, which is safe for concurrent use.
func Load() (*tokenize.Tokenizer, error) {
	return tokenize.NewGzip(tokenizerJSONGz, tokenizerConfigJSON)
}

// Shared is Load done once per process: every caller gets the same
// tokenizer (tests of several packages load it this way).
var Shared = sync.OnceValues(Load)

// WriteDir writes the tokenizer as a Hugging Face tokenizer directory
// (tokenizer.json and tokenizer_config.json) into dir, for tools that read
// one: llama.cpp's make_tiny_gguf.py builds a model around it.
func WriteDir(dir string) error {
	zr, err := gzip.NewReader(bytes.NewReader(tokenizerJSONGz))
	if err != nil {
		return fmt.Errorf("qwen3: %w", err)
	}
	tj, err := io.ReadAll(zr)
	if err != nil {
		return fmt.Errorf("qwen3: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tj, 0o644); err != nil {
		return fmt.Errorf("qwen3: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), tokenizerConfigJSON, 0o644); err != nil {
		return fmt.Errorf("qwen3: %w", err)
	}
	return nil
}
