package advise

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/capacity"
)

func pol(name string, c float64) capacity.Policy {
	return capacity.Policy{Name: name, Outcome: capacity.Outcome{Capacity: c}}
}

func TestRecommend(t *testing.T) {
	slo, err := capacity.ParseSLO("ttft_p90=2s")
	if err != nil {
		t.Fatal(err)
	}
	above := pol("e2", 100)
	above.Outcome.AboveMax = true
	for _, tt := range []struct {
		name string
		ps   []capacity.Policy
		want Recommendation
	}{
		{"clear winner", []capacity.Policy{pol("round-robin", 35), pol("sglang", 55), pol("e2", 60)},
			Recommendation{Policy: "e2", Next: "sglang", VsNext: 60.0 / 55, VsRoundRobin: 60.0 / 35,
				Text: "run e2: 60 req/s at ttft_p90=2s, 1.09× sglang, 1.71× round-robin"}},
		{"tie within the tolerance", []capacity.Policy{pol("round-robin", 6.25), pol("sglang", 30), pol("e2", 30), pol("prefix", 25)},
			Recommendation{Policy: "sglang", Tied: []string{"e2"}, Next: "prefix", VsNext: 1.2, VsRoundRobin: 4.8,
				Text: "run sglang or e2: a tie within 5% (the search's tolerance) at ttft_p90=2s, 30 and 30 req/s, 1.20× prefix, 4.80× round-robin"}},
		{"just outside the tolerance", []capacity.Policy{pol("prefix", 20), pol("e2", 21.5)},
			Recommendation{Policy: "e2", Next: "prefix", VsNext: 21.5 / 20, Text: "run e2: 21.5 req/s at ttft_p90=2s, 1.07× prefix"}},
		{"round-robin next", []capacity.Policy{pol("round-robin", 10), pol("e2", 20)},
			Recommendation{Policy: "e2", Next: "round-robin", VsNext: 2, VsRoundRobin: 2, Text: "run e2: 20 req/s at ttft_p90=2s, 2.00× round-robin"}},
		{"round-robin best", []capacity.Policy{pol("round-robin", 20), pol("e2", 10)},
			Recommendation{Policy: "round-robin", Next: "e2", VsNext: 2, Text: "run round-robin: 20 req/s at ttft_p90=2s, 2.00× e2"}},
		{"round-robin met nothing", []capacity.Policy{pol("round-robin", 0), pol("prefix", 10), pol("e2", 20)},
			Recommendation{Policy: "e2", Next: "prefix", VsNext: 2, Text: "run e2: 20 req/s at ttft_p90=2s, 2.00× prefix; round-robin met it at no rate tried"}},
		{"above the search's max", []capacity.Policy{pol("prefix", 50), above},
			Recommendation{Policy: "e2", Next: "prefix", VsNext: 2,
				Text: "run e2: ≥ 100 req/s at ttft_p90=2s, ≥ 2.00× prefix (its search's highest rate still met: raise --slo-max-rate to see how far it goes)"}},
		{"alone", []capacity.Policy{pol("e2", 7)}, Recommendation{Policy: "e2", Text: "run e2: 7 req/s at ttft_p90=2s"}},
		{"none met", []capacity.Policy{pol("round-robin", 0), pol("e2", 0)},
			Recommendation{Text: "no policy met ttft_p90=2s at any rate tried: the cluster is too small for this traffic at this objective (more replicas, or a looser objective)"}},
	} {
		got := Recommend(slo, tt.ps, 0.05)
		if got.Policy != tt.want.Policy || !slices.Equal(got.Tied, tt.want.Tied) || got.Next != tt.want.Next ||
			!near(got.VsNext, tt.want.VsNext) || !near(got.VsRoundRobin, tt.want.VsRoundRobin) || got.Text != tt.want.Text {
			t.Errorf("%s:\n got %+v\nwant %+v", tt.name, got, tt.want)
		}
	}
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }

// testConfig advises on testdata/shared.jsonl (240 requests of 5,120
// tokens, 4,096 of them one of 6 system prompts of Zipf-like popularity)
// on 2 × mistral-7b-a6000.
func testConfig(t *testing.T) Config {
	c := DefaultConfig()
	c.Sim.Workload.Trace = filepath.Join("testdata", "shared.jsonl")
	c.Sim.Workload.TraceOptions.BlockTokens = 1024
	c.Sim.Replicas, c.Sim.SLO, c.Sim.Quiet = 2, "ttft_p90=2s", true
	dir := t.TempDir()
	c.JSONPath, c.HTMLPath = filepath.Join(dir, "advice.json"), filepath.Join(dir, "advice.html")
	return c
}

// TestRunOnTrace runs the whole advice on a small trace: the statistics,
// a capacity line for every policy compared, and a recommendation naming
// the policy of the highest capacity, in the text, the JSON and the HTML.
func TestRunOnTrace(t *testing.T) {
	c := testConfig(t)
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	out := stdout.String()
	t.Logf("\n%s", out)
	for _, want := range []string{"traffic:\ntrace testdata/shared.jsonl\n", "shared-token ratio", "capacity at ttft_p90=2s on 2 × mistral-7b-a6000", "\nrecommendation: run "} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q", want)
		}
	}
	_, table, _ := strings.Cut(out, "capacity at ")
	policies := strings.Split(DefaultPolicies, ",")
	for _, p := range policies {
		if !regexp.MustCompile(`(?m)^ +` + regexp.QuoteMeta(p) + ` +[0-9.]+ +`).MatchString(table) {
			t.Errorf("the capacity table has no line for %s", p)
		}
	}
	raw, err := os.ReadFile(c.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	var doc Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Policies) != len(policies) || doc.Traffic.Stats.Requests != 240 || doc.SLO != "ttft_p90=2s" {
		t.Fatalf("document: %d policies, %d requests, slo %q", len(doc.Policies), doc.Traffic.Stats.Requests, doc.SLO)
	}
	best := doc.Policies[0]
	for _, p := range doc.Policies {
		if p.CapacityRPS > best.CapacityRPS {
			best = p
		}
	}
	rec := doc.Recommendation
	if best.CapacityRPS <= 0 || rec.Policy != best.Policy || !strings.HasPrefix(rec.Text, "run "+best.Policy) ||
		!strings.Contains(out, "recommendation: "+rec.Text+"\n") {
		t.Errorf("recommendation %+v; want it to name %s (%g req/s), the highest capacity", rec, best.Policy, best.CapacityRPS)
	}
	for _, r := range doc.Results {
		if r.CapacityRPS == nil || r.SLOMet == nil || r.GoodputRPS == nil {
			t.Fatalf("run %s at %g lacks the SLO fields", r.Policy, r.Rate)
		}
	}
	html, err := os.ReadFile(c.HTMLPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<h2>Recommendation</h2>", "<h2>Traffic: prefix sharing</h2>", "<svg", rec.Text} {
		if !strings.Contains(string(html), want) {
			t.Errorf("HTML lacks %q", want)
		}
	}
	if strings.Contains(string(html), "<script") || strings.Contains(string(html), `href="results.json"`) {
		t.Error("HTML is not self-contained")
	}
}

func TestValidate(t *testing.T) {
	for _, tt := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Sim.Workload.Spec.Name = "toolbench" }, "exactly one of --trace FILE or --workload NAME"},
		{func(c *Config) { c.Sim.SLO = " " }, "--slo is required"},
		{func(c *Config) { c.Sim.Replicas = 0 }, "--replicas 0"},
		{func(c *Config) { c.BlockSize = 0 }, "--block-size 0"},
		{func(c *Config) { c.Sim.Rates = "1,2" }, "the capacity search chooses the rates"},
		{func(c *Config) { c.Sim.SLO = "ttft_p90" }, "advise: --slo: slo: target"},
		{func(c *Config) { c.Sim.Workload.Trace = "testdata/none.jsonl" }, "advise: analyze: workload: open trace"},
	} {
		c := testConfig(t)
		tt.edit(&c)
		if err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("error %v, want %q", err, tt.want)
		}
	}
}
