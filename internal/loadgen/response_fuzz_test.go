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
		// llama.cpp: usage and timings on the final chunk, no prompt_tokens_details.
		"data: {\"choices\":[{\"text\":\"a\",\"index\":0,\"finish_reason\":null}]}\n\ndata: {\"choices\":[{\"text\":\"\",\"index\":0,\"finish_reason\":\"length\"}],\"usage\":{\"completion_tokens\":3,\"prompt_tokens\":602,\"total_tokens\":605},\"timings\":{\"prompt_n\":1,\"prompt_ms\":6.524,\"prompt_per_token_ms\":6.524,\"predicted_n\":3,\"predicted_ms\":11.721,\"predicted_per_token_ms\":3.907}}\n\ndata: [DONE]\n\n",
		"{\"choices\":[{\"text\":\"a\"}],\"usage\":{\"prompt_tokens\":601,\"completion_tokens\":3},\"timings\":{\"prompt_n\":1,\"prompt_ms\":11.397}}",
		"{\"usage\":{\"prompt_tokens\":5},\"timings\":{\"prompt_n\":-1e300}}",
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
		if (whole.timings == nil) != (bytewise.timings == nil) || (whole.timings != nil && *whole.timings != *bytewise.timings) {
			t.Fatalf("split changes the timings: %+v vs %+v", whole.timings, bytewise.timings)
		}
		if whole.timings != nil && (whole.timings.PromptN < 0 || whole.timings.PromptMs < 0) {
			t.Fatalf("timings %+v", *whole.timings)
		}
		var js outcome
		js.readJSON(bytes.NewReader(body), start)
		if js.err == nil && js.ttft <= 0 {
			t.Fatalf("JSON response read without a TTFT: %+v", js)
		}
	})
}
