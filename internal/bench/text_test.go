package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/engine/enginetest"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// startEngine runs a prefixlb engine (an H100 8B profile 1000 times
// faster) behind a loopback server until the test ends; withQwen3 makes it
// count prompts with the bundled Qwen3 tokenizer (prefixlb engine
// --tokenizer qwen3), else with its one-token-a-word tokenizer.
func startEngine(t *testing.T, withQwen3 bool, edit func(*engine.Config)) string {
	t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	cfg := engine.DefaultConfig()
	cfg.Replica.Profile = prof
	cfg.TimeScale = 1000
	cfg.Logger = slog.New(slog.DiscardHandler)
	if withQwen3 {
		tok, err := qwen3.Shared()
		if err != nil {
			t.Fatal(err)
		}
		cfg.SetTokenizer(tok)
	}
	if edit != nil {
		edit(&cfg)
	}
	return enginetest.Start(t, cfg)
}

// runBench runs bench with the shared-prefix workload (small) against
// target and returns its result, the table and stderr.
func runBench(t *testing.T, target, mode, tokenizer string) (report.Result, string, string) {
	t.Helper()
	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec("shared-prefix")
	f.Spec.Requests = 24
	f.Spec.SharedPrefix = workload.SharedPrefixParams{Groups: 3, SystemTokens: 1500, Questions: 4, QuestionTokens: 120, Output: 4}
	f.Arrival.Rate = 200
	return runBenchFlags(t, target, mode, tokenizer, f)
}

// runBenchSmall is runBench with prompts of a few hundred tokens at 2
// requests a second, for a CPU engine.
func runBenchSmall(t *testing.T, target, mode string) (report.Result, string, string) {
	t.Helper()
	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec("shared-prefix")
	f.Spec.Requests = 8
	f.Spec.SharedPrefix = workload.SharedPrefixParams{Groups: 2, SystemTokens: 300, Questions: 2, QuestionTokens: 30, Output: 2}
	f.Arrival.Rate = 2
	return runBenchFlags(t, target, mode, "", f)
}

// runBenchFlags runs bench with the workload f against target.
func runBenchFlags(t *testing.T, target, mode, tokenizer string, f workload.Flags) (report.Result, string, string) {
	t.Helper()
	c := Config{Workload: f, Load: loadgen.DefaultConfig(), Mode: mode, RequestsGiven: true, Tokenizer: tokenizer}
	c.Load.Target = target
	c.JSONPath = t.TempDir() + "/r.json"
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("bench: %v\n%s", err, stderr.String())
	}
	fh, err := os.Open(c.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	file, err := report.ReadJSON(fh)
	if err != nil {
		t.Fatal(err)
	}
	if len(file.Results) != 1 {
		t.Fatalf("%d results, want 1", len(file.Results))
	}
	return file.Results[0], stdout.String(), stderr.String()
}

// TestTextSizeMatchesEngine is issue 31's acceptance test: bench --mode
// text and --mode chat against an engine counting prompts with Qwen3 send
// prompts the engine counts as the workload's length (chat: plus the
// template's tokens), within 2% (exactly, in fact), with the tokenizer
// learnt from the engine's /tokenize.
func TestTextSizeMatchesEngine(t *testing.T) {
	target := startEngine(t, true, nil)
	for _, mode := range []string{"text", "chat"} {
		t.Run(mode, func(t *testing.T) {
			res, table, stderr := runBench(t, target, mode, "")
			t.Logf("stderr:\n%s\ntable:\n%s", stderr, table)
			if res.Errors != 0 || res.Completed == 0 {
				t.Fatalf("%d errors, %d completed: %v", res.Errors, res.Completed, res.ErrorClasses)
			}
			if !strings.Contains(stderr, "bench: tokenizer qwen3 (bundled; the target's /tokenize gives the same ids)") || strings.Contains(stderr, "warning") {
				t.Errorf("stderr does not name the tokenizer learnt from /tokenize, or warns:\n%s", stderr)
			}
			want := res.WorkloadPromptTokensMean
			if mode == "chat" {
				if res.ChatTemplateTokens <= 0 || !strings.Contains(stderr, "chat template adds ") {
					t.Errorf("chat template tokens %d, stderr:\n%s", res.ChatTemplateTokens, stderr)
				}
				want += float64(res.ChatTemplateTokens)
			}
			if res.WorkloadPromptTokensMean < 1000 || math.Abs(res.PromptTokensMean/want-1) > 0.02 {
				t.Errorf("engine counted %.1f prompt tokens a request, want %.1f (workload %.1f + template %d) within 2%%",
					res.PromptTokensMean, want, res.WorkloadPromptTokensMean, res.ChatTemplateTokens)
			}
			if res.PromptTokensMean != want {
				t.Logf("not exact: engine %.3f, want %.3f", res.PromptTokensMean, want)
			}
			if res.Tokenizer == "" || !strings.Contains(table, "prompt_tok") {
				t.Errorf("tokenizer %q; table lacks prompt_tok:\n%s", res.Tokenizer, table)
			}
		})
	}
}

// TestTextTokenizerFlag: --tokenizer qwen3 is used without asking the
// target, and the header says so.
func TestTextTokenizerFlag(t *testing.T) {
	target := startEngine(t, true, nil)
	res, _, stderr := runBench(t, target, "text", "qwen3")
	if !strings.Contains(stderr, "bench: tokenizer qwen3 (--tokenizer)") {
		t.Errorf("stderr:\n%s", stderr)
	}
	if res.PromptTokensMean != res.WorkloadPromptTokensMean {
		t.Errorf("engine %.2f, workload %.2f", res.PromptTokensMean, res.WorkloadPromptTokensMean)
	}
}

// TestTextWarnings: against an engine counting one token a word (not
// Qwen3), bench warns that /tokenize differs and that the sizes differ.
func TestTextWarnings(t *testing.T) {
	target := startEngine(t, false, nil)
	res, _, stderr := runBench(t, target, "text", "")
	for _, w := range []string{"bench: warning: the target's /tokenize gives other ids than the bundled Qwen3 tokenizer",
		"bench: tokenizer qwen3 (bundled; the target's /tokenize DIFFERS: give --tokenizer)",
	} {
		if !strings.Contains(stderr, w) {
			t.Errorf("stderr lacks %q:\n%s", w, stderr)
		}
	}
	// The word tokenizer counts a whole prompt of " word"s as one token a
	// word, so the sizes agree; a prompt of words it splits would not.
	t.Logf("engine %.1f, workload %.1f", res.PromptTokensMean, res.WorkloadPromptTokensMean)

	var buf bytes.Buffer
	checkSizes(report.Result{PromptTokensMean: 6273, WorkloadPromptTokensMean: 1000}, &buf)
	if !strings.Contains(buf.String(), "bench: warning: the target counted 6273 prompt tokens a request, the workload 1000: +527.3%") {
		t.Errorf("checkSizes: %q", buf.String())
	}
	buf.Reset()
	checkSizes(report.Result{PromptTokensMean: 1040, WorkloadPromptTokensMean: 1000, ChatTemplateTokens: 9}, &buf)
	if buf.Len() != 0 {
		t.Errorf("checkSizes within 5%%: %q", buf.String())
	}
	checkSizes(report.Result{PromptTokensMean: 1100, WorkloadPromptTokensMean: 1000, ChatTemplateTokens: 9}, &buf)
	if !strings.Contains(buf.String(), "the workload 1000 + 9 of chat template: +0.9%") && !strings.Contains(buf.String(), "+ 9 of chat template") {
		t.Errorf("checkSizes with template: %q", buf.String())
	}
}

// TestErrorClassesSummary: 400s from an engine whose context is too short
// for the prompts are one class in the JSON and one line of the table.
func TestErrorClassesSummary(t *testing.T) {
	target := startEngine(t, true, func(c *engine.Config) { c.MaxModelLen = 1000 })
	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec("shared-prefix")
	f.Spec.Requests = 12
	f.Spec.SharedPrefix = workload.SharedPrefixParams{Groups: 2, SystemTokens: 1500, Questions: 2, QuestionTokens: 10 + 0, Output: 4}
	f.Arrival.Rate = 200
	c := Config{Workload: f, Load: loadgen.DefaultConfig(), Mode: "text", RequestsGiven: true, JSONPath: "-"}
	c.Load.Target = target
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	var file report.File
	if err := json.Unmarshal(stdout.Bytes(), &file); err != nil {
		t.Fatal(err)
	}
	res := file.Results[0]
	if res.Errors != 12 || len(res.ErrorClasses) != 1 {
		t.Fatalf("%d errors in classes %v, want 12 in one class", res.Errors, res.ErrorClasses)
	}
	for class, e := range res.ErrorClasses {
		if e.Count != 12 || !strings.HasPrefix(class, "http 400") || !strings.HasPrefix(e.Example, "http 400") {
			t.Errorf("class %q = %+v", class, e)
		}
		c.JSONPath = ""
		stdout.Reset()
		if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(stdout.String(), "    12 × http 400: ") {
			t.Errorf("table lacks the error class line:\n%s", stdout.String())
		}
		t.Logf("\n%s", stdout.String())
	}
}
