package demo

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
)

func rec(id int, replica string, ttft float64) report.RequestRecord {
	return report.RequestRecord{ID: id, Policy: "e2", Replica: replica, ArrivalS: float64(id), TTFTMs: ttft,
		LatencyMs: 2 * ttft, PromptTokens: 100, CachedTokens: 50, OutputTokens: 4}
}

// twoRounds are two rounds of one policy on three replicas, llama-2 serving
// no request.
func twoRounds() []llamaRun {
	return []llamaRun{
		{
			out: loadgen.Output{Records: []report.RequestRecord{rec(0, "llama-1", 10), rec(1, "llama-0", 20)},
				Timings: []*loadgen.Timings{{PromptN: 100}, nil}, Elapsed: 2 * time.Second},
			prefill: map[string]float64{"llama-0": 1.5, "llama-1": 2, "llama-2": 0},
			prompt:  map[string]float64{"llama-0": 100, "llama-1": 150, "llama-2": 0},
			cal:     []report.CalibrationFit{{Replica: "llama-0", PrefillSecondsPer1K: 1}},
		},
		{
			out:     loadgen.Output{Records: []report.RequestRecord{rec(0, "llama-0", 30)}, Elapsed: 3 * time.Second},
			prefill: map[string]float64{"llama-0": 0.5, "llama-1": 1, "llama-2": 0.25},
			prompt:  map[string]float64{"llama-0": 50, "llama-1": 20, "llama-2": 10},
			cal:     []report.CalibrationFit{{Replica: "llama-0", PrefillSecondsPer1K: 2}},
		},
	}
}

func TestPoolRuns(t *testing.T) {
	l := poolLabels{Rate: 1, Workload: "workload toolbench", Replicas: 3, Profile: "llamacpp-tiny-cpu"}
	res := poolRuns("e2", twoRounds(), l)
	if res.Policy != "e2" || res.Rate != 1 || res.Workload != l.Workload || res.Replicas != 3 || res.Profile != l.Profile {
		t.Errorf("labels: %+v", res)
	}
	if res.Requests != 3 || res.Completed != 3 {
		t.Errorf("pooled %d requests (%d completed), want 3", res.Requests, res.Completed)
	}
	if res.DurationS != 5 {
		t.Errorf("duration %v s, want the rounds' 2+3", res.DurationS)
	}
	if want := (10.0 + 20 + 30) / 3; res.TTFT.Mean != want {
		t.Errorf("mean TTFT %v, want %v", res.TTFT.Mean, want)
	}
	// The last round's calibration, not the first's.
	if !res.Calibrated || len(res.Calibration) != 1 || res.Calibration[0].PrefillSecondsPer1K != 2 {
		t.Errorf("calibration %+v, want the last round's", res.Calibration)
	}
	type row struct {
		name     string
		requests int
		seconds  float64
		tokens   int
	}
	want := []row{{"llama-0", 2, 2, 150}, {"llama-1", 1, 3, 170}, {"llama-2", 0, 0.25, 10}}
	if len(res.PerReplica) != len(want) {
		t.Fatalf("per replica %+v, want %d rows", res.PerReplica, len(want))
	}
	for i, w := range want {
		got := res.PerReplica[i]
		if got.Replica != w.name || got.Requests != w.requests || got.PrefillSeconds != w.seconds || got.PrefillTokens != w.tokens {
			t.Errorf("row %d: %+v, want %+v", i, got, w)
		}
	}
}

func TestPoolRunsNoCalibration(t *testing.T) {
	runs := twoRounds()
	runs[1].cal = nil
	if res := poolRuns("rr", runs, poolLabels{}); res.Calibrated || res.Calibration != nil {
		t.Errorf("calibrated %v %+v without the last round's fits", res.Calibrated, res.Calibration)
	}
	if res := poolRuns("rr", nil, poolLabels{}); res.Requests != 0 || len(res.PerReplica) != 0 {
		t.Errorf("no runs: %+v", res)
	}
}

func TestWritePrefillTable(t *testing.T) {
	var b bytes.Buffer
	writePrefillTable(&b, []report.Result{
		poolRuns("e2", twoRounds(), poolLabels{}),
		{Policy: "round-robin", PerReplica: []report.ReplicaResult{{Replica: "a", PrefillSeconds: 0}, {Replica: "b", PrefillSeconds: 4}}},
	})
	want := "prefill seconds per replica (llamacpp:prompt_seconds_total), and max/min over replicas:\n" +
		"  e2             total    5.2 s: llama-0 2.0, llama-1 3.0, llama-2 0.2; max/min 12.00\n" +
		"  round-robin    total    4.0 s: a 0.0, b 4.0; max/min inf\n"
	if b.String() != want {
		t.Errorf("got\n%s\nwant\n%s", b.String(), want)
	}
}

func TestWriteRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "records.jsonl")
	runs := map[string][]llamaRun{"e2": twoRounds(), "round-robin": twoRounds()[:1]}
	if err := writeRecords(path, []string{"round-robin", "e2"}, runs); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	type line struct {
		ID      int              `json:"id"`
		Round   int              `json:"round"`
		Timings *loadgen.Timings `json:"timings"`
	}
	var got []line
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("%q: %v", sc.Text(), err)
		}
		if !strings.Contains(sc.Text(), `"timings":`) {
			t.Errorf("%q has no timings field", sc.Text())
		}
		got = append(got, l)
	}
	// round-robin's round 0 (2), then e2's rounds 0 (2) and 1 (1).
	want := []struct {
		id, round int
		timed     bool
	}{{0, 0, true}, {1, 0, false}, {0, 0, true}, {1, 0, false}, {0, 1, false}}
	if len(got) != len(want) {
		t.Fatalf("%d lines, want %d", len(got), len(want))
	}
	for i, w := range want {
		if got[i].ID != w.id || got[i].Round != w.round || (got[i].Timings != nil) != w.timed {
			t.Errorf("line %d: %+v, want %+v", i, got[i], w)
		}
	}
	if err := writeRecords(filepath.Join(t.TempDir(), "no", "such", "dir"), nil, nil); err == nil || !strings.HasPrefix(err.Error(), "demo: --records: ") {
		t.Errorf("unwritable path: %v", err)
	}
}

func TestSplitPolicies(t *testing.T) {
	got := splitPolicies(" round-robin, ,e2,")
	if strings.Join(got, "|") != "round-robin|e2" {
		t.Errorf("got %q", got)
	}
}
