// Package qwen3 embeds the Qwen3 tokenizer (gzip-compressed tokenizer.json
// and tokenizer_config.json with its chat template), so programs have a real
// tokenizer offline without a model directory. See README.md for its source
// and licence. Importing the package adds about 2 MB to a binary.
package qwen3

import (
	_ "embed"

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
