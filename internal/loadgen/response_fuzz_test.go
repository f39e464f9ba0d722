package loadgen

import (
	"bytes"
	"testing"
	"testing/iotest"
	"time"
)

// FuzzReadResponse feeds the load generator's response readers (an SSE
// stream of OpenAI chunks, or one JSON response) arbitrary bodies: they must
// not panic, and where reads split the stream must not change the outcome.
func FuzzReadResponse(f *testing.F) {
	for _, s := range []string{
		"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: {\"error\":{\"message\":\"boom\"}}\n\n",
		"event: error\ndata: {\"message\":\"x\"}\n\n",
		"data: not json\n\n",
		"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
		"{\"choices\":[{\"text\":\"a\"}],\"usage\":{\"completion_tokens\":-4}}",
		"{\"error\":\"plain\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		start := time.Now()
		var whole, bytewise outcome
		whole.readStream(bytes.NewReader(body), start, 512)
		bytewise.readStream(iotest.OneByteReader(bytes.NewReader(body)), start, 512)
		if (whole.err == nil) != (bytewise.err == nil) || whole.outputTokens != bytewise.outputTokens ||
			whole.promptTokens != bytewise.promptTokens || whole.cachedTokens != bytewise.cachedTokens {
			t.Fatalf("split changes the outcome: %+v vs %+v", whole, bytewise)
		}
		if whole.err == nil && len(whole.itl) > 0 && whole.ttft == 0 {
			t.Fatalf("inter-token latencies without a first token: %+v", whole)
		}
		var js outcome
		js.readJSON(bytes.NewReader(body), start)
		if js.err == nil && js.ttft <= 0 {
			t.Fatalf("JSON response read without a TTFT: %+v", js)
		}
	})
}
