package sweep

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func TestParseReplicaProfiles(t *testing.T) {
	ps, err := ParseReplicaProfiles(" llama3.1-8b-h100*2, llama3.1-8b-a100 ", 3)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range ps {
		names = append(names, p.Name())
	}
	if got := strings.Join(names, ","); got != "llama3.1-8b-h100,llama3.1-8b-h100,llama3.1-8b-a100" {
		t.Errorf("got %s", got)
	}
	for _, tc := range []struct {
		list string
		n    int
		want string
	}{
		{"llama3.1-8b-h100*3", 4, "--replica-profiles names 3 replicas, --replicas is 4"},
		{"llama3.1-8b-h100*x", 1, `"llama3.1-8b-h100*x": the count after * must be a positive integer`},
		{"llama3.1-8b-h100*0", 0, "the count after * must be a positive integer"},
		{",llama3.1-8b-h100", 2, `an empty profile in ",llama3.1-8b-h100"`},
		{"nope", 1, "--replica-profiles: costmodel: unknown profile"},
	} {
		if _, err := ParseReplicaProfiles(tc.list, tc.n); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.list, err, tc.want)
		}
	}
}

func TestProfiles(t *testing.T) {
	sp, err := ResolveProfiles("mistral-7b-a6000", "", "", 4)
	if err != nil {
		t.Fatal(err)
	}
	if d := sp.Distinct(); len(d) != 1 || d[0] != sp.Base || sp.Fastest() != sp.Base || sp.Router != nil {
		t.Errorf("one profile: distinct %v, fastest %v, router %v", d, sp.Fastest(), sp.Router)
	}
	sp, err = ResolveProfiles("mistral-7b-a6000", "llama3.1-8b-a100*2,llama3.1-8b-h100*2", "llama3.1-8b-a100", 4)
	if err != nil {
		t.Fatal(err)
	}
	d := sp.Distinct()
	if len(d) != 2 || d[0].Name() != "llama3.1-8b-a100" || d[1].Name() != "llama3.1-8b-h100" {
		t.Errorf("distinct %v, want a100 then h100", d)
	}
	if sp.Fastest().Name() != "llama3.1-8b-h100" {
		t.Errorf("fastest %s, want the H100", sp.Fastest().Name())
	}
	if len(sp.Router) != 4 || sp.Router[3].Name() != "llama3.1-8b-a100" {
		t.Errorf("router profiles %v", sp.Router)
	}
	if _, err := ResolveProfiles("mistral-7b-a6000", "", "nope", 4); err == nil || !strings.HasPrefix(err.Error(), "--router-profile: ") {
		t.Errorf("bad router profile: %v", err)
	}
}

func TestParseRates(t *testing.T) {
	if r, err := ParseRates(" ", 7); err != nil || len(r) != 1 || r[0] != 7 {
		t.Errorf("empty: %v %v", r, err)
	}
	if r, err := ParseRates("4, 8.5", 7); err != nil || len(r) != 2 || r[1] != 8.5 {
		t.Errorf("list: %v %v", r, err)
	}
	for _, s := range []string{"1,x", "0", "-2"} {
		if _, err := ParseRates(s, 1); err == nil || !strings.HasPrefix(err.Error(), "--rates: ") {
			t.Errorf("%q: %v", s, err)
		}
	}
}

func TestApplyEngine(t *testing.T) {
	given := func(names ...string) func(string) bool {
		return func(n string) bool {
			for _, g := range names {
				if g == n {
					return true
				}
			}
			return false
		}
	}
	c := Config{Engine: EngineVLLM, Slots: DefaultSlots, KVEvents: true, Profile: "p"}
	if err := c.ApplyEngine(); err != nil || c.Slots != 0 || !c.KVEvents || c.Profile != "p" {
		t.Errorf("vllm: %v %+v", err, c)
	}
	c = Config{Engine: EngineVLLM, Slots: 3, Changed: given("slots")}
	if err := c.ApplyEngine(); err == nil || !strings.Contains(err.Error(), "--slots is for --engine llamacpp") {
		t.Errorf("vllm with --slots: %v", err)
	}
	c = Config{Engine: EngineLlamaCpp, Slots: 7, KVEvents: true, Profile: "p"}
	if err := c.ApplyEngine(); err != nil || c.Slots != DefaultSlots || c.KVEvents || c.ChunkBudget != replica.LlamaCppBatch ||
		c.Profile != costmodel.LlamaCppTinyCPU {
		t.Errorf("llamacpp defaults: %v %+v", err, c)
	}
	c = Config{Engine: EngineLlamaCpp, Slots: 3, KVEvents: true, ChunkBudget: 512, Profile: "p",
		Changed: given("slots", "kv-events", "chunk-budget", "profile")}
	if err := c.ApplyEngine(); err != nil || c.Slots != 3 || !c.KVEvents || c.ChunkBudget != 512 || c.Profile != "p" {
		t.Errorf("llamacpp with flags given: %v %+v", err, c)
	}
	c = Config{Engine: EngineLlamaCpp, Changed: given("slots")}
	if err := c.ApplyEngine(); err == nil || err.Error() != "--slots must be ≥ 1, got 0" {
		t.Errorf("zero slots: %v", err)
	}
	c = Config{Engine: "sglang"}
	if err := c.ApplyEngine(); err == nil || err.Error() != `--engine must be vllm or llamacpp, got "sglang"` {
		t.Errorf("unknown engine: %v", err)
	}
}

func TestWriteJSONEngine(t *testing.T) {
	results := []report.Result{{Policy: "e2", Rate: 1}}
	var vllm, plain, llama bytes.Buffer
	if err := WriteJSON(&vllm, EngineVLLM, results); err != nil {
		t.Fatal(err)
	}
	if err := report.WriteJSON(&plain, results); err != nil {
		t.Fatal(err)
	}
	if vllm.String() != plain.String() {
		t.Errorf("vllm's JSON differs from report.WriteJSON's:\n%s\n%s", vllm.String(), plain.String())
	}
	if err := WriteJSON(&llama, EngineLlamaCpp, results); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Results []struct {
			Policy string `json:"policy"`
			Engine string `json:"engine"`
		} `json:"results"`
	}
	if err := json.Unmarshal(llama.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Results) != 1 || doc.Results[0].Engine != EngineLlamaCpp || doc.Results[0].Policy != "e2" {
		t.Errorf("llamacpp JSON %s", llama.String())
	}
	path := filepath.Join(t.TempDir(), "r.json")
	if err := WriteJSONFile(path, EngineLlamaCpp, results); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); string(b) != llama.String() {
		t.Errorf("file %s, want %s", b, llama.String())
	}
}

func TestWriteCalibration(t *testing.T) {
	var b bytes.Buffer
	WriteCalibration(&b, "e2@4", []report.CalibrationFit{{Replica: "replica-0", PrefillSecondsPer1K: 0.1, TruePrefillSecondsPer1K: 0.1,
		PriorPrefillSecondsPer1K: 0.2, PrefillSamples: 5, DecodeStepSeconds: 0.02, TrueDecodeStepSeconds: 0.02, PriorDecodeStepSeconds: 0.03, DecodeSamples: 9}})
	want := "  e2@4             replica-0: prefill     0.1 s (true     0.1, told     0.2;     5 samples), decode step      20 ms (true      20, told      30;     9 samples)\n"
	if b.String() != want {
		t.Errorf("got\n%q\nwant\n%q", b.String(), want)
	}
}

func smallConfig() Config {
	c := Config{Workload: workload.DefaultFlags(), Replicas: 2, Profile: "mistral-7b-a6000", Policies: "round-robin,e2",
		Local: "fcfs", KVEvents: true, EventLag: 10 * time.Millisecond, RouterSeed: 1, Quiet: true, Engine: EngineVLLM}
	c.Workload.Spec = workload.DefaultSpec("toolbench")
	c.Workload.Spec.Requests = 60
	c.Workload.Spec.Replicas = 2
	c.Workload.Arrival.Rate = 8
	return c
}

func TestRun(t *testing.T) {
	c := smallConfig()
	c.Rates = "4,8"
	c.JSONPath = "-"
	c.Policies = "round-robin@lpm,e2"
	c.OutDir = t.TempDir()
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	out := stdout.String()
	i := strings.Index(out, "{\n")
	if i < 0 || !strings.Contains(out[:i], "round-robin") {
		t.Fatalf("want the table then JSON:\n%s", out)
	}
	var f report.File
	if err := json.Unmarshal([]byte(out[i:]), &f); err != nil {
		t.Fatal(err)
	}
	type key struct {
		policy, local string
		rate          float64
	}
	var got []key
	for _, r := range f.Results {
		got = append(got, key{r.Policy, r.Local, r.Rate})
		if r.Requests != 60 || r.Replicas != 2 || r.Profile != "mistral-7b-a6000" || r.OracleTTFT == nil || r.TTFTVsOracle <= 0 {
			t.Errorf("result %+v", r)
		}
	}
	want := []key{{"round-robin@lpm", "lpm", 4}, {"e2", "fcfs", 4}, {"round-robin@lpm", "lpm", 8}, {"e2", "fcfs", 8}}
	if len(got) != len(want) {
		t.Fatalf("results %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("result %d: %v, want %v", i, got[i], want[i])
		}
	}
	for _, name := range []string{"results.json", "requests.csv", "chart.svg", "report.html"} {
		if _, err := os.Stat(filepath.Join(c.OutDir, name)); err != nil {
			t.Error(err)
		}
	}
	if !strings.Contains(stderr.String(), "wrote "+c.OutDir+"/{results.json") {
		t.Errorf("stderr %q", stderr.String())
	}
}

func TestRunDeterministic(t *testing.T) {
	run := func() string {
		var stdout bytes.Buffer
		if err := Run(context.Background(), smallConfig(), &stdout, &bytes.Buffer{}); err != nil {
			t.Fatal(err)
		}
		return stdout.String()
	}
	if a, b := run(), run(); a != b {
		t.Errorf("two runs differ:\n%s\n%s", a, b)
	}
}

func TestRunLlamaCppCalibrated(t *testing.T) {
	c := smallConfig()
	c.Engine = EngineLlamaCpp
	c.Workload.Arrival.Rate = 1
	c.Workload.Spec.Requests = 30
	c.Policies = "e2"
	c.Calibrate = true
	c.JSONPath = filepath.Join(t.TempDir(), "r.json")
	var stdout bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout.String(), "what the router learnt of each replica") || !strings.Contains(stdout.String(), "e2@1") {
		t.Errorf("no calibration lines:\n%s", stdout.String())
	}
	b, err := os.ReadFile(c.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Results []struct {
			Engine      string                  `json:"engine"`
			Profile     string                  `json:"profile"`
			Calibration []report.CalibrationFit `json:"calibration"`
		} `json:"results"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Results) != 1 || doc.Results[0].Engine != EngineLlamaCpp || doc.Results[0].Profile != costmodel.LlamaCppTinyCPU ||
		len(doc.Results[0].Calibration) != 2 {
		t.Errorf("JSON %s", b)
	}
}

func TestRunErrors(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Policies = "nope" }, `policy: unknown policy "nope"`},
		{func(c *Config) { c.Policies = "e2@bogus" }, `--policies "e2@bogus": replica: invalid config`},
		{func(c *Config) { c.Local = "bogus" }, "profile mistral-7b-a6000: replica: invalid config"},
		{func(c *Config) { c.Rates = "x" }, `--rates: "x" is not a positive number`},
		{func(c *Config) { c.Profile = "nope" }, "costmodel: unknown profile"},
		{func(c *Config) { c.Workload.Trace, c.Workload.Spec.Name = "/nonexistent", "" }, "open /nonexistent"},
	} {
		c := smallConfig()
		tc.edit(&c)
		if err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want %q", err, tc.want)
		}
	}
}
