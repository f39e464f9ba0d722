package analyze

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/workload"
)

const trace = "../workload/testdata/mooncake_head50.jsonl"

func traceConfig() Config {
	c := Config{Workload: workload.DefaultFlags(), BlockSize: 16}
	c.Workload.Spec.Name = ""
	c.Workload.Trace = trace
	return c
}

func TestRunTable(t *testing.T) {
	var out, errs bytes.Buffer
	if err := Run(traceConfig(), &out, &errs); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "trace "+trace+"\nrequests ") || !strings.Contains(out.String(), "block size") {
		t.Errorf("table:\n%s", out.String())
	}
}

func TestRunJSON(t *testing.T) {
	c := traceConfig()
	c.JSONPath = "-"
	var out bytes.Buffer
	if err := Run(c, &out, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var doc Document
	if err := json.Unmarshal(out.Bytes(), &doc); err != nil {
		t.Fatalf("%v:\n%s", err, out.String())
	}
	if doc.Source != "trace "+trace || doc.Skipped != 0 || doc.Stats.Requests != 50 {
		t.Errorf("doc %+v", doc)
	}
	// A file gets the same document, and the table still goes to stdout.
	c.JSONPath = filepath.Join(t.TempDir(), "a.json")
	var table bytes.Buffer
	if err := Run(c, &table, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(c.JSONPath); !bytes.Equal(b, out.Bytes()) {
		t.Errorf("file %s, want %s", b, out.String())
	}
	if !strings.HasPrefix(table.String(), "trace ") {
		t.Errorf("table:\n%s", table.String())
	}
}

func TestRunErrors(t *testing.T) {
	c := traceConfig()
	c.Workload.Spec.Name = "toolbench"
	if err := Run(c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || err.Error() != "analyze: give exactly one of --trace FILE, --workload NAME or --dataset NAME FILE" {
		t.Errorf("both: %v", err)
	}
	c = traceConfig()
	c.JSONPath = filepath.Join(t.TempDir(), "no", "dir", "a.json")
	if err := Run(c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.HasPrefix(err.Error(), "analyze: ") {
		t.Errorf("unwritable: %v", err)
	}
}
