package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/report"
)

// TestDatasetCommands: sim and analyze take the same dataset file with the
// same flags, tokenize it the same way (the bundled Qwen3), and agree on
// what it holds: analyze's request count and mean prompt are those of the
// requests sim simulated (its requests.csv).
func TestDatasetCommands(t *testing.T) {
	for _, tc := range []struct{ name, file string }{
		{"loogle", "../../testdata/loogle-sample.jsonl"},
		{"sharegpt", "../../internal/dataset/testdata/multiturn.json"},
		{"sharegpt", "../../testdata/sharegpt-sample.json"},
	} {
		t.Run(filepath.Base(tc.file), func(t *testing.T) {
			var out, errb bytes.Buffer
			an := analyzeCmd()
			an.SetArgs([]string{"--dataset", tc.name, tc.file, "--json", "-"})
			an.SetOut(&out)
			an.SetErr(&errb)
			if err := an.Execute(); err != nil {
				t.Fatalf("analyze: %v\n%s", err, errb.String())
			}
			var doc struct {
				Source string `json:"source"`
				Stats  struct {
					Requests     int `json:"requests"`
					PromptTokens struct {
						Mean float64 `json:"mean"`
					} `json:"prompt_tokens"`
				} `json:"stats"`
			}
			if err := json.Unmarshal(out.Bytes(), &doc); err != nil {
				t.Fatalf("analyze --json: %v\n%s", err, out.String())
			}

			dir := t.TempDir()
			sim := newSimCmd()
			sim.SetArgs([]string{"--dataset", tc.name, tc.file, "--replicas", "2", "--rate", "2",
				"--policies", "round-robin,e2", "--out", dir, "-q"})
			out.Reset()
			sim.SetOut(&out)
			sim.SetErr(&errb)
			if err := sim.Execute(); err != nil {
				t.Fatalf("sim: %v\n%s", err, errb.String())
			}
			fh, err := os.Open(filepath.Join(dir, "results.json"))
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			res, err := report.ReadJSON(fh)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range res.Results {
				if r.Requests != doc.Stats.Requests || r.Errors != 0 {
					t.Errorf("sim %s: %d requests, %d errors; analyze: %d requests", r.Policy, r.Requests, r.Errors, doc.Stats.Requests)
				}
			}
			csv, err := os.ReadFile(filepath.Join(dir, "requests.csv"))
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(strings.TrimSpace(string(csv)), "\n")
			col := slices.Index(strings.Split(lines[0], ","), "prompt_tokens")
			if col < 0 {
				t.Fatalf("requests.csv has no prompt_tokens: %s", lines[0])
			}
			sum, n := 0.0, 0
			for _, l := range lines[1:] {
				var v float64
				if err := json.Unmarshal([]byte(strings.Split(l, ",")[col]), &v); err != nil {
					t.Fatal(err)
				}
				sum += v
				n++
			}
			if n != 2*doc.Stats.Requests || sum/float64(n) != doc.Stats.PromptTokens.Mean {
				t.Errorf("sim simulated %d requests of %.3f prompt tokens on average; analyze counts 2 × %d of %.3f",
					n, sum/float64(n), doc.Stats.Requests, doc.Stats.PromptTokens.Mean)
			}
		})
	}
}
