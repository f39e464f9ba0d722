package proxy

import (
	"encoding/json"
	"testing"

	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// chunkInfo is what the tests read of a completion chunk as a client would:
// its texts, usage and error.
type chunkInfo struct {
	Choices []struct {
		Text *string `json:"text"`
	} `json:"choices"`
	Usage *openai.Usage   `json:"usage"`
	Error json.RawMessage `json:"error"`
}

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
