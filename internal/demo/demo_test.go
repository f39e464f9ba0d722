package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func TestScaleResult(t *testing.T) {
	r := report.Result{TTFT: report.Summary{Mean: 1, P50: 2, P90: 3, P99: 4}, Latency: report.Summary{Mean: 10},
		TPOT: report.Summary{P99: 5}, ITL: &report.Summary{P50: 7}, ThroughputRPS: 8, OutputTokensPerS: 80, DurationS: 3}
	same := r
	scaleResult(&same, 1)
	if same.TTFT != r.TTFT || same.ThroughputRPS != 8 {
		t.Errorf("speedup 1 changed %+v", same)
	}
	scaleResult(&r, 2)
	if r.TTFT != (report.Summary{Mean: 2, P50: 4, P90: 6, P99: 8}) || r.Latency.Mean != 20 || r.TPOT.P99 != 10 || r.ITL.P50 != 14 {
		t.Errorf("times not doubled: %+v", r)
	}
	if r.ThroughputRPS != 4 || r.OutputTokensPerS != 40 || r.DurationS != 6 {
		t.Errorf("rates not halved or duration not doubled: %+v", r)
	}
}

func TestNotes(t *testing.T) {
	if got := speedNote(1); got != "modelled GPUs at real speed (--speedup 1)" {
		t.Errorf("speedNote(1) = %q", got)
	}
	if got := speedNote(2.5); got != "modelled GPUs run 2.5× as fast as real time (--speedup 2.5)" {
		t.Errorf("speedNote(2.5) = %q", got)
	}
	if scaleNote(1) != "" || !strings.Contains(scaleNote(4), "4× as fast") {
		t.Errorf("scaleNote: %q, %q", scaleNote(1), scaleNote(4))
	}
}

func TestLlamaCppDefaults(t *testing.T) {
	c := Config{Workload: workload.DefaultFlags(), Replicas: 4, Profile: "mine", Policies: "e2"}
	c.Workload.Spec.Requests = 900
	given := map[string]bool{"profile": true, "requests": true}
	LlamaCppDefaults(&c, func(name string) bool { return given[name] })
	if c.Profile != "mine" || c.Workload.Spec.Requests != 900 {
		t.Errorf("given flags changed: profile %q, requests %d", c.Profile, c.Workload.Spec.Requests)
	}
	if c.Replicas != 3 || c.Workload.Spec.Replicas != 3 || c.Workload.Arrival.Rate != 1 || c.Workload.Spec.OutputTokens != 24 ||
		c.Policies != "round-robin,least-load,llmd-approx,sglang,prefix,e2" {
		t.Errorf("defaults not applied: %+v", c)
	}
	LlamaCppDefaults(&c, nil)
	if c.Profile != costmodel.LlamaCppTinyCPU || c.Workload.Spec.Requests != 120 {
		t.Errorf("nil changed: every default applies, got profile %q, requests %d", c.Profile, c.Workload.Spec.Requests)
	}
}

func TestRunErrors(t *testing.T) {
	t.Setenv("PREFIXLB_LLAMA_SERVER", "")
	t.Setenv("PREFIXLB_TEST_LLAMA_SERVER", "")
	t.Setenv("PREFIXLB_LLAMA_MODEL", "")
	base := Config{Workload: workload.DefaultFlags(), Replicas: 1, Profile: "mistral-7b-a6000", Speedup: 1,
		Engine: EngineModel, Mode: "completions", LlamaCpp: LlamaCppConfig{Rounds: 1}}
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Replicas = 0 }, "--replicas must be ≥ 1, got 0"},
		{func(c *Config) { c.Engine = "vllm" }, `--engine must be model or llamacpp, got "vllm"`},
		{func(c *Config) { c.Speedup = 0 }, "--speedup must be > 0, got 0"},
		{func(c *Config) { c.Mode = "grpc" }, `--mode must be completions, text or chat, got "grpc"`},
		{func(c *Config) { c.Profile = "nope" }, "costmodel: unknown profile"},
		{func(c *Config) { c.PrefillReplicas = 1 }, "--prefill-replicas must be in [0, --replicas), got 1 of 1"},
		{func(c *Config) { c.Engine = EngineLlamaCpp }, "--engine llamacpp needs llama.cpp's llama-server"},
		{func(c *Config) { c.Engine, c.LlamaCpp.Server, c.LlamaCpp.Rounds = EngineLlamaCpp, "/x/llama-server", 0 }, "--rounds must be ≥ 1, got 0"},
		{func(c *Config) { c.Engine, c.LlamaCpp.Server = EngineLlamaCpp, "/nonexistent/llama-server" }, "--engine llamacpp needs a model"},
	} {
		c := base
		tc.edit(&c)
		err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", c, err, tc.want)
		}
	}
}

// TestRunModel runs a tiny demo end to end: two modelled replicas, KV
// events, no tokenizer, two policies; every goroutine it starts ends.
func TestRunModel(t *testing.T) {
	if testing.Short() {
		t.Skip("starts engines and routers on loopback")
	}
	c := Config{Workload: workload.DefaultFlags(), Replicas: 2, Profile: "mistral-7b-a6000", Policies: "round-robin,e2",
		Speedup: 20, JSONPath: "-", Tokenizer: "none", Mode: "completions", Engine: EngineModel}
	c.Workload.Spec = workload.DefaultSpec("toolbench")
	c.Workload.Spec.Requests = 12
	c.Workload.Spec.OutputTokens = 4
	c.Workload.Arrival.Rate = 10
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"round-robin", "e2 vs round-robin: mean TTFT", "the run went 20× as fast"} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
	i := strings.Index(out, "{\n")
	if i < 0 {
		t.Fatalf("no JSON in stdout:\n%s", out)
	}
	var f report.File
	if err := json.Unmarshal([]byte(out[i:]), &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Results) != 2 || f.Results[1].Policy != "e2" || f.Results[0].Requests != 12 || f.Results[0].Rate != 10 ||
		f.Results[0].Replicas != 2 || f.Results[0].Profile != "mistral-7b-a6000" {
		t.Errorf("results %+v", f.Results)
	}
	for _, r := range f.Results {
		if r.Errors != 0 {
			t.Errorf("%s: %d errors\n%s", r.Policy, r.Errors, stderr.String())
		}
	}
	if _, err := os.Stat("-"); err == nil {
		t.Error(`--json - wrote a file named "-"`)
	}
}

// TestRunModelPD runs the demo on a disaggregated cluster: one prefill and
// two decode replicas under round-robin-pd, every request answered.
func TestRunModelPD(t *testing.T) {
	if testing.Short() {
		t.Skip("starts engines and routers on loopback")
	}
	c := Config{Workload: workload.DefaultFlags(), Replicas: 3, PrefillReplicas: 1, Profile: "llama3.1-8b-h100",
		Policies: "round-robin-pd", Speedup: 20, JSONPath: "-", Tokenizer: "none", Mode: "completions", Engine: EngineModel}
	c.Workload.Spec = workload.DefaultSpec("toolbench")
	c.Workload.Spec.Requests = 12
	c.Workload.Spec.OutputTokens = 4
	c.Workload.Arrival.Rate = 10
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "1 prefill + 2 decode replicas") {
		t.Errorf("stderr does not say the split:\n%s", stderr.String())
	}
	i := strings.Index(stdout.String(), "{\n")
	if i < 0 {
		t.Fatalf("no JSON in stdout:\n%s", stdout.String())
	}
	var f report.File
	if err := json.Unmarshal([]byte(stdout.String()[i:]), &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Results) != 1 || f.Results[0].Errors != 0 || f.Results[0].Requests != 12 {
		t.Fatalf("results %+v", f.Results)
	}
	// The load generator read x-prefixlb-prefill-replica on every answer.
	if pd := f.Results[0].PD; pd == nil || pd.Disaggregated != 12 || pd.ByPrefill["replica-0"] != 12 {
		t.Errorf("P/D split %+v: want all 12 prefilled on replica-0", pd)
	}
}
