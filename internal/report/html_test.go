package report

import (
	"encoding/xml"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"
)

// htmlRecords is two policies at two rates on three replicas, 60 requests
// each, the second policy with growing hits.
func htmlRecords() ([]Result, []RequestRecord) {
	var recs []RequestRecord
	var results []Result
	for _, rate := range []float64{4, 8} {
		for pi, pol := range []string{"round-robin", "e2"} {
			var run []RequestRecord
			for i := range 60 {
				cached := 0
				if pi == 1 {
					cached = 10 * i
				}
				run = append(run, RequestRecord{
					ID: i, Policy: pol, Rate: rate, Replica: fmt.Sprintf("replica-%d", (i*(pi+1))%3),
					ArrivalS: float64(i) / rate, TTFTMs: float64(50 + i*(2-pi)), LatencyMs: float64(500 + i),
					PromptTokens: 1000, CachedTokens: cached, OutputTokens: 10,
				})
			}
			r := Build(pol, rate, run, 0)
			o := Summary{Mean: 40, P99: 60}
			r.OracleTTFT = &o
			results = append(results, r)
			recs = append(recs, run...)
		}
	}
	return results, recs
}

// figures returns the SVG of each <figure class="NAME"> of page.
func figures(t *testing.T, page string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	re := regexp.MustCompile(`(?s)<figure class="([a-z-]+)">\s*(<svg.*?</svg>)`)
	for _, m := range re.FindAllStringSubmatch(page, -1) {
		out[m[1]] = append(out[m[1]], m[2])
	}
	return out
}

func TestWriteHTML(t *testing.T) {
	results, recs := htmlRecords()
	var b strings.Builder
	if err := WriteHTML(&b, results, recs, "prefixlb sim --rates 4,8"); err != nil {
		t.Fatal(err)
	}
	page := b.String()

	// Well-formed: the document parses as XML once its doctype is dropped.
	dec := xml.NewDecoder(strings.NewReader(strings.TrimPrefix(page, "<!DOCTYPE html>\n")))
	for {
		_, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("report.html is not well-formed: %v", err)
		}
	}

	// Self-contained: no script, no stylesheet link, no reference to
	// another origin (the SVG namespace is a name, not a fetch).
	scan := strings.ReplaceAll(page, `xmlns="http://www.w3.org/2000/svg"`, "")
	if m := regexp.MustCompile(`(?i)<script|<link|<img|<iframe|@import|url\(|src=|https?://`).FindString(scan); m != "" {
		t.Errorf("report.html refers to something outside itself: %q", m)
	}
	if !strings.Contains(page, "prefixlb sim --rates 4,8") {
		t.Error("note missing")
	}

	// Every chart, once per rate or per run, with one line per series.
	figs := figures(t, page)
	for _, tc := range []struct {
		name  string
		count int
		paths int // <path> per figure
	}{
		{"chart-rate", 1, 4 * 2},         // four panels, two policies
		{"chart-oracle", 1, 2 * (2 + 1)}, // two panels, two policies and the bound
		{"chart-cdf", 2, 2},              // a panel per rate, a line per policy
		{"chart-load", 4, 3},             // a panel per run, a line per replica
		{"chart-hit", 2, 2},              // a panel per rate, a line per policy
	} {
		got := figs[tc.name]
		if len(got) != tc.count {
			t.Errorf("%s: %d figures, want %d", tc.name, len(got), tc.count)
			continue
		}
		for _, svg := range got {
			if n := strings.Count(svg, "<path "); n != tc.paths {
				t.Errorf("%s: %d paths, want %d", tc.name, n, tc.paths)
			}
		}
	}
	if n := strings.Count(figs["chart-oracle"][0], `stroke-dasharray="6 4"`); n < 2 {
		t.Errorf("oracle bound not dashed: %d dashed paths", n)
	}
	for _, want := range []string{"replica-0", "replica-1", "replica-2", "TTFT CDF at 4 req/s", "Prefix hit ratio at 8 req/s"} {
		if !strings.Contains(page, want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

// TestWriteHTMLResultsOnly: without records (or an oracle), only the rate
// chart is drawn.
func TestWriteHTMLResultsOnly(t *testing.T) {
	results, _ := htmlRecords()
	for i := range results {
		results[i].OracleTTFT = nil
	}
	var b strings.Builder
	if err := WriteHTML(&b, results, nil); err != nil {
		t.Fatal(err)
	}
	figs := figures(t, b.String())
	if len(figs) != 1 || len(figs["chart-rate"]) != 1 {
		t.Errorf("figures %v", len(figs))
	}
}

func TestCompareNatural(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"replica-2", "replica-10", -1}, {"r10", "r9", 1}, {"a", "a", 0}, {"a", "ab", -1}, {"b", "a1", 1},
	} {
		if got := compareNatural(tc.a, tc.b); got != tc.want {
			t.Errorf("compareNatural(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.want)
		}
	}
}

// TestWriteHTMLSections: sections come first, escaped, and the stand-alone
// report links to no files beside it.
func TestWriteHTMLSections(t *testing.T) {
	results, recs := htmlRecords()
	var b strings.Builder
	secs := []Section{{Title: "Recommendation", Text: "run e2: 1.5× <round-robin>"}, {Title: "Table", Text: "  a  b\n  1  2\n"}}
	if err := WriteHTMLSections(&b, secs, results, recs, "note"); err != nil {
		t.Fatal(err)
	}
	s := b.String()
	i, j, k := strings.Index(s, "<h2>Recommendation</h2>\n<pre>run e2: 1.5× &lt;round-robin&gt;</pre>"), strings.Index(s, "<h2>Table</h2>\n<pre>  a  b\n  1  2\n</pre>"), strings.Index(s, "<h2>Results</h2>")
	if i < 0 || j < i || k < j {
		t.Errorf("sections missing or not before the results (%d, %d, %d)", i, j, k)
	}
	if strings.Contains(s, `href="results.json"`) {
		t.Error("stand-alone report links to results.json")
	}
	if len(figures(t, s)) == 0 {
		t.Error("no figures")
	}
	var plain strings.Builder
	if err := WriteHTML(&plain, results, recs); err != nil || !strings.Contains(plain.String(), `href="results.json"`) {
		t.Errorf("WriteHTML lost its file links: %v", err)
	}
}
