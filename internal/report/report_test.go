package report

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"flag"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite golden files in testdata")

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*max(1, math.Abs(b)) }

func TestPercentile(t *testing.T) {
	one2ten := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	tests := []struct {
		name   string
		sorted []float64
		p      float64
		want   float64
	}{
		{"empty", nil, 50, 0},
		{"single", []float64{7}, 99, 7},
		{"p0 is min", one2ten, 0, 1},
		{"p100 is max", one2ten, 100, 10},
		{"clamped below", one2ten, -5, 1},
		{"clamped above", one2ten, 150, 10},
		// h = 9·0.5 = 4.5 → 5 + 0.5·(6−5)
		{"p50 even n", one2ten, 50, 5.5},
		// h = 9·0.9 = 8.1 → 9 + 0.1·(10−9)
		{"p90", one2ten, 90, 9.1},
		// h = 9·0.99 = 8.91 → 9 + 0.91
		{"p99", one2ten, 99, 9.91},
		// h = 3·0.25 = 0.75 → 10 + 0.75·(20−10)
		{"p25 of 4", []float64{10, 20, 30, 40}, 25, 17.5},
		{"p50 odd n", []float64{1, 2, 100}, 50, 2},
		{"ties", []float64{3, 3, 3, 3}, 90, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.sorted, tt.p); !near(got, tt.want) {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tt.sorted, tt.p, got, tt.want)
			}
		})
	}
}

func TestSamplesSummary(t *testing.T) {
	var s Samples
	if got := s.Summary(); got != (Summary{}) {
		t.Errorf("empty Summary() = %+v, want zero", got)
	}
	// Added out of order; NaN ignored.
	for _, v := range []float64{10, 1, 9, 2, 8, 3, math.NaN(), 7, 4, 6, 5} {
		s.Add(v)
	}
	if s.Len() != 10 {
		t.Fatalf("Len() = %d, want 10", s.Len())
	}
	got := s.Summary()
	want := Summary{Mean: 5.5, P50: 5.5, P90: 9.1, P99: 9.91}
	if !near(got.Mean, want.Mean) || !near(got.P50, want.P50) || !near(got.P90, want.P90) || !near(got.P99, want.P99) {
		t.Errorf("Summary() = %+v, want %+v", got, want)
	}
	// Adding after a percentile re-sorts.
	s.Add(100)
	if got := s.Percentile(100); got != 100 {
		t.Errorf("Percentile(100) after Add = %v, want 100", got)
	}
}

func TestSummarizeLeavesInput(t *testing.T) {
	in := []float64{3, 1, 2}
	got := Summarize(in)
	if !slices.Equal(in, []float64{3, 1, 2}) {
		t.Errorf("Summarize modified its input: %v", in)
	}
	if got.P50 != 2 || got.Mean != 2 {
		t.Errorf("Summarize = %+v, want mean 2, p50 2", got)
	}
}

func TestTPOT(t *testing.T) {
	tests := []struct {
		ttft, lat float64
		out       int
		want      float64
	}{
		{100, 1100, 11, 100},
		{100, 1100, 1, 0},
		{100, 100, 0, 0},
		{50, 250, 5, 50},
	}
	for _, tt := range tests {
		if got := TPOT(tt.ttft, tt.lat, tt.out); !near(got, tt.want) {
			t.Errorf("TPOT(%v, %v, %d) = %v, want %v", tt.ttft, tt.lat, tt.out, got, tt.want)
		}
	}
}

// buildRecords is a small run worked out by hand in TestBuild.
func buildRecords() []RequestRecord {
	return []RequestRecord{
		{ID: 0, Replica: "r1", ArrivalS: 0, TTFTMs: 100, LatencyMs: 1100, PromptTokens: 1000, CachedTokens: 0, OutputTokens: 11, ITLMs: []float64{90, 110}},
		{ID: 1, Replica: "r2", ArrivalS: 1, TTFTMs: 200, LatencyMs: 600, PromptTokens: 1000, CachedTokens: 800, OutputTokens: 5, ITLMs: []float64{100}},
		// Sent late: finishes at 2.5 + 1.5 = 4 s, the end of the run.
		{ID: 2, Replica: "r1", ArrivalS: 2, SentS: 2.5, TTFTMs: 300, LatencyMs: 1500, PromptTokens: 2000, CachedTokens: 1200, OutputTokens: 1},
		// Failed: excluded from everything but Requests, Errors and the span.
		{ID: 3, Replica: "r2", ArrivalS: 3, TTFTMs: 0, LatencyMs: 50, PromptTokens: 500, Error: "http 503: overloaded"},
	}
}

func TestBuild(t *testing.T) {
	got := Build("e2", 1.5, buildRecords(), 0)
	want := Result{
		Policy: "e2", Rate: 1.5, Requests: 4, Errors: 1, Completed: 3,
		// TTFT over 100, 200, 300.
		TTFT: Summary{Mean: 200, P50: 200, P90: 280, P99: 298},
		// Latency over 600, 1100, 1500: p90 h=1.8 → 1100+0.8·400.
		Latency: Summary{Mean: 3200.0 / 3, P50: 1100, P90: 1420, P99: 1492},
		// TPOT: (1100−100)/10 = 100 and (600−200)/4 = 100; request 2 has 1 token.
		TPOT: Summary{Mean: 100, P50: 100, P90: 100, P99: 100},
		ITL:  &Summary{Mean: 100, P50: 100, P90: 108, P99: 109.8},
		// (0 + 800 + 1200) / (1000 + 1000 + 2000).
		PrefixHitRatio: 0.5,
		// Span from 0 s to 4 s (request 2 ends last).
		DurationS: 4, ThroughputRPS: 0.75, OutputTokensPerS: 17.0 / 4,
		PerReplica: []ReplicaResult{
			{Replica: "r1", Requests: 2, TTFT: Summary{Mean: 200, P50: 200, P90: 280, P99: 298}, PrefixHitRatio: 0.4, OutputTokens: 12},
			{Replica: "r2", Requests: 2, Errors: 1, TTFT: Summary{Mean: 200, P50: 200, P90: 200, P99: 200}, PrefixHitRatio: 0.8, OutputTokens: 5},
		},
	}
	gj, _ := json.Marshal(round(got))
	wj, _ := json.Marshal(round(want))
	if !bytes.Equal(gj, wj) {
		t.Errorf("Build:\n got %s\nwant %s", gj, wj)
	}

	// An explicit duration overrides the span.
	got = Build("e2", 1.5, buildRecords(), 10*time.Second)
	if got.DurationS != 10 || !near(got.ThroughputRPS, 0.3) || !near(got.OutputTokensPerS, 1.7) {
		t.Errorf("Build with duration 10s: duration %v, rps %v, tok/s %v; want 10, 0.3, 1.7",
			got.DurationS, got.ThroughputRPS, got.OutputTokensPerS)
	}
}

func TestBuildEmpty(t *testing.T) {
	got := Build("random", 2, nil, 0)
	want := Result{Policy: "random", Rate: 2}
	gj, _ := json.Marshal(got)
	wj, _ := json.Marshal(want)
	if !bytes.Equal(gj, wj) {
		t.Errorf("Build(nil) = %s, want %s", gj, wj)
	}
}

// round rounds every float of r to 9 significant decimals, so that results
// computed in a different order compare equal.
func round(r Result) Result {
	f := func(v float64) float64 { return math.Round(v*1e9) / 1e9 }
	s := func(x Summary) Summary { return Summary{f(x.Mean), f(x.P50), f(x.P90), f(x.P99)} }
	r.TTFT, r.Latency, r.TPOT = s(r.TTFT), s(r.Latency), s(r.TPOT)
	if r.ITL != nil {
		x := s(*r.ITL)
		r.ITL = &x
	}
	r.PrefixHitRatio, r.ThroughputRPS, r.OutputTokensPerS, r.DurationS =
		f(r.PrefixHitRatio), f(r.ThroughputRPS), f(r.OutputTokensPerS), f(r.DurationS)
	for i := range r.PerReplica {
		r.PerReplica[i].TTFT = s(r.PerReplica[i].TTFT)
		r.PerReplica[i].PrefixHitRatio = f(r.PerReplica[i].PrefixHitRatio)
	}
	return r
}

// goldenResults is the content of testdata/results.golden.json.
func goldenResults() []Result {
	oracle := Summary{Mean: 80, P50: 70, P90: 150, P99: 200}
	return []Result{
		{
			Policy: "e2", Rate: 12, Requests: 5000,
			TTFT:           Summary{Mean: 120.5, P50: 100, P90: 250, P99: 900},
			Latency:        Summary{Mean: 5000, P50: 4500, P90: 8000, P99: 12000},
			TPOT:           Summary{Mean: 20, P50: 19, P90: 25, P99: 40},
			PrefixHitRatio: 0.8125, ThroughputRPS: 11.9, OutputTokensPerS: 2380, Errors: 2,
			Completed: 4998, DurationS: 420, OracleTTFT: &oracle, TTFTVsOracle: 1.50625,
			Workload: "toolbench", Replicas: 4, Profile: "mistral-7b-a6000", Local: "lpm",
		},
		{
			Policy: "bench", Rate: 3, Requests: 10,
			TTFT:           Summary{Mean: 50, P50: 40, P90: 90, P99: 99},
			Latency:        Summary{Mean: 500, P50: 400, P90: 900, P99: 990},
			TPOT:           Summary{Mean: 5, P50: 4, P90: 9, P99: 9.9},
			PrefixHitRatio: 0.25, ThroughputRPS: 2.5, OutputTokensPerS: 250, Errors: 0,
			Completed: 10, DurationS: 4, ITL: &Summary{Mean: 5, P50: 4, P90: 9, P99: 12},
			Workload: "shared-prefix", Target: "http://127.0.0.1:8000", Delayed: 1,
			SendLag:    &Summary{Mean: 1, P50: 0.5, P90: 2, P99: 3},
			PerReplica: []ReplicaResult{{Replica: "http://10.0.0.1:8000", Requests: 10, TTFT: Summary{Mean: 50, P50: 40, P90: 90, P99: 99}, PrefixHitRatio: 0.25, OutputTokens: 1000}},
		},
	}
}

func TestJSONGolden(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteJSON(&buf, goldenResults()); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join("testdata", "results.golden.json")
	if *update {
		if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if !bytes.Equal(buf.Bytes(), want) {
		t.Errorf("WriteJSON output differs from %s (run with -update if intended):\n%s", path, buf.Bytes())
	}

	// Round trip.
	f, err := ReadJSON(bytes.NewReader(want))
	if err != nil {
		t.Fatal(err)
	}
	gj, _ := json.Marshal(f.Results)
	wj, _ := json.Marshal(goldenResults())
	if !bytes.Equal(gj, wj) {
		t.Errorf("round trip:\n got %s\nwant %s", gj, wj)
	}
}

// TestJSONContract checks the field names and shapes of ARCHITECTURE.md's
// command-line contract, independently of the golden file.
func TestJSONContract(t *testing.T) {
	var buf bytes.Buffer
	// A zero Result still carries every contract field.
	if err := WriteJSON(&buf, []Result{{Policy: "e2"}}); err != nil {
		t.Fatal(err)
	}
	var doc map[string][]map[string]any
	if err := json.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	results, ok := doc["results"]
	if !ok || len(results) != 1 {
		t.Fatalf(`want {"results":[one object]}, got %s`, buf.Bytes())
	}
	r := results[0]
	for _, k := range []string{"policy", "rate", "requests", "prefix_hit_ratio", "throughput_rps", "output_tokens_per_s", "errors"} {
		if _, ok := r[k]; !ok {
			t.Errorf("field %q missing", k)
		}
	}
	for _, k := range []string{"ttft_ms", "latency_ms", "tpot_ms"} {
		m, ok := r[k].(map[string]any)
		if !ok {
			t.Errorf("field %q missing or not an object", k)
			continue
		}
		keys := make([]string, 0, len(m))
		for kk := range m {
			keys = append(keys, kk)
		}
		slices.Sort(keys)
		if want := []string{"mean", "p50", "p90", "p99"}; !slices.Equal(keys, want) {
			t.Errorf("%s keys = %v, want %v", k, keys, want)
		}
	}
	// Nil results are an empty list, not null.
	buf.Reset()
	if err := WriteJSON(&buf, nil); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(strings.Fields(buf.String()), ""); got != `{"results":[]}` {
		t.Errorf("WriteJSON(nil) = %s", got)
	}
}

func TestWriteCSV(t *testing.T) {
	var buf bytes.Buffer
	recs := buildRecords()
	recs[3].Error = `http 503: "overloaded", retry`
	if err := WriteCSV(&buf, recs); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	wantHeader := []string{"id", "policy", "rate", "replica", "session", "group", "arrival_s", "sent_s",
		"ttft_ms", "latency_ms", "tpot_ms", "prompt_tokens", "cached_tokens", "output_tokens", "error"}
	if !slices.Equal(rows[0], wantHeader) {
		t.Errorf("header = %v, want %v", rows[0], wantHeader)
	}
	if len(rows) != 1+len(recs) {
		t.Fatalf("got %d rows, want %d", len(rows), 1+len(recs))
	}
	if want := []string{"2", "", "0", "r1", "", "", "2", "2.5", "300", "1500", "0", "2000", "1200", "1", ""}; !slices.Equal(rows[3], want) {
		t.Errorf("row 3 = %v, want %v", rows[3], want)
	}
	if got := rows[4][14]; got != recs[3].Error {
		t.Errorf("error cell = %q, want %q", got, recs[3].Error)
	}
}

func TestWriteTable(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteTable(&buf, goldenResults()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(buf.String(), "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("got %d lines, want 3:\n%s", len(lines), buf.String())
	}
	for _, w := range []string{"policy", "ttft_ms mean", "p99", "hit", "req/s", "errors", "ttft/oracle"} {
		if !strings.Contains(lines[0], w) {
			t.Errorf("header %q lacks %q", lines[0], w)
		}
	}
	if !strings.HasPrefix(strings.TrimSpace(lines[1]), "e2 ") || !strings.Contains(lines[1], "1.51x") || !strings.Contains(lines[1], "0.812") {
		t.Errorf("row 1 = %q", lines[1])
	}
	if !strings.HasSuffix(strings.TrimRight(lines[2], " "), "-") {
		t.Errorf("row 2 should show - for a missing oracle ratio: %q", lines[2])
	}
	// All lines are aligned to the same width.
	for _, l := range lines[1:] {
		if len(strings.TrimRight(l, " ")) != len(strings.TrimRight(lines[0], " ")) {
			t.Errorf("misaligned:\n%s", buf.String())
			break
		}
	}
	// Without oracle ratios there is no such column.
	buf.Reset()
	if err := WriteTable(&buf, goldenResults()[1:]); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "oracle") {
		t.Errorf("unexpected oracle column:\n%s", buf.String())
	}
	t.Logf("\n%s", buf.String())
}

// svgCounts parses an SVG document and returns, per <g class="panel">, the
// number of <path> elements it holds, plus the number of <circle>s overall.
func svgCounts(t *testing.T, data []byte) (paths []int, circles int) {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(data))
	depth, panelDepth := 0, -1
	sawSVG := false
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v\n%s", err, data)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			depth++
			switch el.Name.Local {
			case "svg":
				sawSVG = true
			case "g":
				for _, a := range el.Attr {
					if a.Name.Local == "class" && a.Value == "panel" {
						panelDepth = depth
						paths = append(paths, 0)
					}
				}
			case "path":
				if panelDepth < 0 {
					t.Errorf("<path> outside a panel")
				} else {
					paths[len(paths)-1]++
				}
			case "circle":
				circles++
			}
		case xml.EndElement:
			if depth == panelDepth {
				panelDepth = -1
			}
			depth--
		}
	}
	if !sawSVG {
		t.Fatal("no <svg> element")
	}
	return paths, circles
}

func TestWriteChart(t *testing.T) {
	sweep := func(policies []string, rates []float64) []Result {
		var rs []Result
		for pi, p := range policies {
			for _, r := range rates {
				v := float64(pi+1) * r * r * 10
				rs = append(rs, Result{Policy: p, Rate: r, Workload: "toolbench",
					TTFT:    Summary{Mean: v, P99: 3 * v},
					Latency: Summary{Mean: 100 * v, P99: 300 * v}})
			}
		}
		return rs
	}
	tests := []struct {
		name     string
		results  []Result
		policies int
		points   int
	}{
		{"sweep", sweep([]string{"e2", "round-robin", "least-load <&>"}, []float64{2, 4, 6, 8, 10, 12}), 3, 18},
		{"one rate", sweep([]string{"e2", "random"}, []float64{5}), 2, 2},
		{"one result at rate 0", []Result{{Policy: "e2"}}, 1, 1},
		{"many policies", sweep(strings.Split("a,b,c,d,e,f,g,h,i,j,k,l,m", ","), []float64{1, 2}), 13, 26},
		{"empty", nil, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			if err := WriteChart(&buf, tt.results); err != nil {
				t.Fatal(err)
			}
			paths, circles := svgCounts(t, buf.Bytes())
			wantPanels := 4
			if tt.policies == 0 {
				wantPanels = 0
			}
			if len(paths) != wantPanels {
				t.Fatalf("got %d panels, want %d", len(paths), wantPanels)
			}
			for i, n := range paths {
				if n != tt.policies {
					t.Errorf("panel %d has %d paths, want %d (one per policy)", i, n, tt.policies)
				}
			}
			// One marker per point per panel, plus one per legend entry.
			if want := 4*tt.points + tt.policies; tt.policies > 0 && circles != want {
				t.Errorf("got %d circles, want %d", circles, want)
			}
			if strings.Contains(buf.String(), "NaN") || strings.Contains(buf.String(), "Inf") {
				t.Errorf("chart contains NaN or Inf coordinates")
			}
		})
	}
}

func TestNiceTicks(t *testing.T) {
	tests := []struct {
		lo, hi float64
		n      int
		want   []float64
	}{
		{0, 9.3, 5, []float64{0, 2.5, 5, 7.5, 10}},
		{0, 1, 5, []float64{0, 0.25, 0.5, 0.75, 1}},
		{2, 12, 6, []float64{2, 4, 6, 8, 10, 12}},
		{0, 870, 5, []float64{0, 250, 500, 750, 1000}},
		{2.5, 7.5, 6, []float64{2, 3, 4, 5, 6, 7, 8}},
		{5, 5, 5, []float64{5, 5.25, 5.5, 5.75, 6}},
	}
	for _, tt := range tests {
		got, _ := niceTicks(tt.lo, tt.hi, tt.n)
		ok := len(got) == len(tt.want)
		for i := 0; ok && i < len(got); i++ {
			ok = near(got[i], tt.want[i])
		}
		if !ok {
			t.Errorf("niceTicks(%v, %v, %d) = %v, want %v", tt.lo, tt.hi, tt.n, got, tt.want)
		}
	}
	for _, tt := range []struct {
		v, step float64
		want    string
	}{{2.5, 2.5, "2.5"}, {1000, 250, "1000"}, {0.75, 0.25, "0.75"}, {4, 2, "4"}, {0.2, 0.1, "0.2"}} {
		if got := tickLabel(tt.v, tt.step); got != tt.want {
			t.Errorf("tickLabel(%v, %v) = %q, want %q", tt.v, tt.step, got, tt.want)
		}
	}
}

func TestWriteFiles(t *testing.T) {
	dir := t.TempDir()
	rs := goldenResults()
	if err := WriteJSONFile(filepath.Join(dir, "results.json"), rs); err != nil {
		t.Fatal(err)
	}
	if err := WriteCSVFile(filepath.Join(dir, "requests.csv"), buildRecords()); err != nil {
		t.Fatal(err)
	}
	if err := WriteChartFile(filepath.Join(dir, "chart.svg"), rs); err != nil {
		t.Fatal(err)
	}
	if err := WriteJSONFile(filepath.Join(dir, "missing", "x.json"), rs); err == nil {
		t.Error("WriteJSONFile into a missing directory: want an error")
	}
}

// TestBuildPD: a run whose responses named prefill replicas is split into
// disaggregated and local requests; one that named none has no PD.
func TestBuildPD(t *testing.T) {
	recs := []RequestRecord{
		{ID: 0, Replica: "d0", PrefillReplica: "p0", TTFTMs: 30, LatencyMs: 40, OutputTokens: 2},
		{ID: 1, Replica: "d1", PrefillReplica: "p0", TTFTMs: 50, LatencyMs: 60, OutputTokens: 2},
		{ID: 2, Replica: "d0", TTFTMs: 10, LatencyMs: 20, OutputTokens: 2},
		{ID: 3, Replica: "d1", PrefillReplica: "p1", Error: "boom"},
	}
	pd := Build("e2-pd", 1, recs, time.Second).PD
	if pd == nil || pd.Disaggregated != 2 || pd.Local != 1 || pd.ByPrefill["p0"] != 2 || pd.ByPrefill["p1"] != 0 ||
		pd.TTFTLocal.P50 != 10 || pd.TTFTDisaggregated.P50 < 30 || pd.TTFTDisaggregated.P50 > 50 {
		t.Errorf("PD %+v", pd)
	}
	for i := range recs {
		recs[i].PrefillReplica = ""
	}
	if pd := Build("e2", 1, recs, time.Second).PD; pd != nil {
		t.Errorf("no prefill replica named, PD %+v", pd)
	}
}
