package bench

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/llamacpp"
)

// TestTextSizeLlamaCpp: against a real llama-server (a tiny random-weight
// model carrying Qwen3's tokenizer; PREFIXLB_TEST_LLAMA_SERVER), bench
// learns the tokenizer from llama.cpp's /tokenize and its text prompts are
// the workload's size as llama.cpp counts them (usage.prompt_tokens),
// within 2%; chat prompts too, after the template's tokens.
func TestTextSizeLlamaCpp(t *testing.T) {
	binary, model, skip := llamacpp.ForTest()
	if skip != "" {
		t.Skip(skip)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := llamacpp.Start(ctx, llamacpp.Default(binary, model))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	for _, mode := range []string{"text", "chat"} {
		t.Run(mode, func(t *testing.T) {
			res, table, stderr := runBenchSmall(t, srv.URL, mode)
			t.Logf("stderr:\n%s\ntable:\n%s", stderr, table)
			if res.Errors != 0 {
				t.Fatalf("%d errors: %v", res.Errors, res.ErrorClasses)
			}
			if !strings.Contains(stderr, "the target's /tokenize gives the same ids") {
				t.Errorf("the tokenizer was not learnt from llama.cpp's /tokenize:\n%s", stderr)
			}
			want := res.WorkloadPromptTokensMean + float64(res.ChatTemplateTokens)
			if math.Abs(res.PromptTokensMean/want-1) > 0.02 {
				t.Errorf("llama.cpp counted %.1f prompt tokens a request, want %.1f (workload %.1f + template %d) within 2%%",
					res.PromptTokensMean, want, res.WorkloadPromptTokensMean, res.ChatTemplateTokens)
			}
		})
	}
}
