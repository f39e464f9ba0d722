package report

import (
	"cmp"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// WriteHTML writes report.html: one self-contained HTML document (inline
// CSS and SVG, no script, no external resource) with the results table and
// the charts of a run:
//
//   - mean and p99 TTFT and latency against rate per policy (the figure of
//     [WriteChart]);
//   - mean and p99 TTFT against rate with the oracle bound drawn in as a
//     dashed line, when results carry OracleTTFT;
//   - the TTFT distribution (CDF) per policy, one panel per rate;
//   - requests started per replica over time, one panel per policy and rate;
//   - the prefix hit ratio over time per policy, one panel per rate.
//
// The charts over time and the CDFs come from recs (they are left out when
// recs is empty). notes are shown under the title, one paragraph each (the
// command line, for instance).
func WriteHTML(w io.Writer, results []Result, recs []RequestRecord, notes ...string) error {
	return writeHTML(w, nil, true, results, recs, notes)
}

// Section is a titled block of preformatted text (a table, a verdict) that
// WriteHTMLSections shows before the results.
type Section struct {
	Title, Text string
}

// WriteHTMLSections writes a self-contained report as WriteHTML does, with
// sections first, each a heading and its text as preformatted, and no
// links to the --out files beside it (a report that stands alone, such as
// `prefixlb advise --html`).
func WriteHTMLSections(w io.Writer, sections []Section, results []Result, recs []RequestRecord, notes ...string) error {
	return writeHTML(w, sections, false, results, recs, notes)
}

// WriteHTMLSectionsFile writes WriteHTMLSections' report to the file at
// path, creating or truncating it.
func WriteHTMLSectionsFile(path string, sections []Section, results []Result, recs []RequestRecord, notes ...string) error {
	return writeFile(path, func(w io.Writer) error { return WriteHTMLSections(w, sections, results, recs, notes...) })
}

func writeHTML(w io.Writer, sections []Section, fileLinks bool, results []Result, recs []RequestRecord, notes []string) error {
	var b strings.Builder
	title := chartTitle(results)
	fmt.Fprintf(&b, `<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/><title>%s</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2329;margin:24px auto;max-width:1000px;padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:32px;border-bottom:1px solid #e3e7eb;padding-bottom:4px}
pre{background:#f4f6f8;padding:10px;overflow:auto;font-size:12px}
figure{margin:12px 0}figure svg{max-width:100%%;height:auto}figcaption{color:#6b7682;font-size:13px}
.note{color:#6b7682}
</style></head><body>
<h1>%s</h1>
`, html.EscapeString(title), html.EscapeString(title))
	for _, n := range notes {
		fmt.Fprintf(&b, "<p class=\"note\">%s</p>\n", html.EscapeString(n))
	}
	if fileLinks {
		b.WriteString(`<p class="note">Files: <a href="results.json">results.json</a> · <a href="requests.csv">requests.csv</a> · <a href="chart.svg">chart.svg</a></p>` + "\n")
	}
	for _, s := range sections {
		fmt.Fprintf(&b, "<h2>%s</h2>\n<pre>%s</pre>\n", html.EscapeString(s.Title), html.EscapeString(s.Text))
	}
	b.WriteString("<h2>Results</h2>\n<pre>")
	var tb strings.Builder
	if err := WriteTable(&tb, results); err != nil {
		return err
	}
	b.WriteString(html.EscapeString(tb.String()))
	b.WriteString("</pre>\n")

	b.WriteString("<h2>TTFT and latency against rate</h2>\n")
	var cb strings.Builder
	if err := WriteChart(&cb, results); err != nil {
		return err
	}
	chart := cb.String()
	if i := strings.Index(chart, "<svg"); i >= 0 {
		chart = chart[i:] // drop the XML declaration: the SVG is inline
	}
	figure(&b, "chart-rate", chart, "Mean and p99 of TTFT and end-to-end latency against the offered rate, one line per policy.")

	if oracle := oracleFigure(results); oracle != "" {
		b.WriteString("<h2>TTFT against the oracle bound</h2>\n")
		figure(&b, "chart-oracle", oracle, "Dashed: the TTFT an ideal router would achieve on the same workload (the simulator's oracle bound).")
	}
	if len(recs) > 0 {
		runs := groupRuns(recs)
		b.WriteString("<h2>TTFT distribution</h2>\n")
		for _, rate := range runRates(runs) {
			figure(&b, "chart-cdf", cdfFigure(runs, rate), fmt.Sprintf("Cumulative distribution of TTFT at %g req/s, one line per policy (x axis up to the largest p99).", rate))
		}
		b.WriteString("<h2>Load per replica over time</h2>\n")
		for _, r := range runs {
			if svg := loadFigure(r); svg != "" {
				figure(&b, "chart-load", svg, fmt.Sprintf("Requests started per second on each replica, %s at %g req/s.", r.policy, r.rate))
			}
		}
		b.WriteString("<h2>Prefix hit ratio over time</h2>\n")
		for _, rate := range runRates(runs) {
			figure(&b, "chart-hit", hitFigure(runs, rate), fmt.Sprintf("Cached prompt tokens / prompt tokens of the requests started in each interval, at %g req/s.", rate))
		}
	}
	b.WriteString("</body></html>\n")
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("report: write html: %w", err)
	}
	return nil
}

// WriteHTMLFile writes the report to the file at path (see [WriteHTML]),
// creating or truncating it.
func WriteHTMLFile(path string, results []Result, recs []RequestRecord, notes ...string) error {
	return writeFile(path, func(w io.Writer) error { return WriteHTML(w, results, recs, notes...) })
}

func figure(b *strings.Builder, class, svg, caption string) {
	fmt.Fprintf(b, "<figure class=\"%s\">\n%s<figcaption>%s</figcaption></figure>\n", class, svg, html.EscapeString(caption))
}

// run is the records of one policy at one rate.
type run struct {
	policy string
	rate   float64
	recs   []RequestRecord
}

// groupRuns groups recs by policy and rate, in order of first appearance.
func groupRuns(recs []RequestRecord) []run {
	var runs []run
	index := map[string]int{}
	for _, r := range recs {
		k := r.Policy + "\x00" + strconv.FormatFloat(r.Rate, 'g', -1, 64)
		i, ok := index[k]
		if !ok {
			i = len(runs)
			index[k] = i
			runs = append(runs, run{policy: r.Policy, rate: r.Rate})
		}
		runs[i].recs = append(runs[i].recs, r)
	}
	return runs
}

// runRates lists the runs' rates in increasing order.
func runRates(runs []run) []float64 {
	var rates []float64
	for _, r := range runs {
		if !slices.Contains(rates, r.rate) {
			rates = append(rates, r.rate)
		}
	}
	slices.Sort(rates)
	return rates
}

// policyIndex numbers the policies of runs in order of first appearance, so
// that a policy keeps its colour across figures.
func policyIndex(runs []run) map[string]int {
	idx := map[string]int{}
	for _, r := range runs {
		if _, ok := idx[r.policy]; !ok {
			idx[r.policy] = len(idx)
		}
	}
	return idx
}

// plotSeries is one line of a plot.
type plotSeries struct {
	name   string
	style  int  // palette index (seriesStyle)
	dashed bool // drawn dashed (a bound, not a measurement)
	pts    [][2]float64
}

// plot is one panel: a line chart with linear axes from 0.
type plot struct {
	title, xlabel, ylabel string
	xmax, ymax            float64 // 0: from the data
	series                []plotSeries
}

// Plot geometry, in SVG user units.
const (
	plotW, plotH = 960, 300
)

// svgPlots lays plots side by side (two per row) in one SVG figure with a
// shared legend.
func svgPlots(plots ...plot) string {
	var b strings.Builder
	cols := min(len(plots), 2)
	pw := plotW / max(cols, 1)
	rows := (len(plots) + cols - 1) / max(cols, 1)
	// Legend: every distinct series name across the plots.
	type entry struct {
		name   string
		style  int
		dashed bool
	}
	var legend []entry
	for _, p := range plots {
		for _, s := range p.series {
			if !slices.ContainsFunc(legend, func(e entry) bool { return e.name == s.name }) {
				legend = append(legend, entry{s.name, s.style, s.dashed})
			}
		}
	}
	lh := 18 * ((len(legend) + 5) / 6)
	height := lh + 10 + rows*plotH
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		plotW, height, plotW, height)
	fmt.Fprintf(&b, `<rect x="0" y="0" width="%d" height="%d" fill="white"/>`+"\n", plotW, height)
	for i, e := range legend {
		x, y := 20+(i%6)*155, 14+(i/6)*18
		color, dash := seriesStyle(e.style)
		if e.dashed {
			dash = ` stroke-dasharray="6 4"`
		}
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2.5"%s/><text x="%d" y="%d">%s</text>`+"\n",
			x, y, x+24, y, color, dash, x+30, y+4, esc(e.name))
	}
	for i, p := range plots {
		writePlot(&b, p, (i%cols)*pw, lh+10+(i/cols)*plotH, pw)
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// writePlot draws p with its top-left corner at (px, py), w wide.
func writePlot(b *strings.Builder, p plot, px, py, w int) {
	x0, x1 := float64(px+plotLeft), float64(px+w-plotRight)
	y0, y1 := float64(py+plotTop), float64(py+plotH-plotBottom)
	xmax, ymax := p.xmax, p.ymax
	for _, s := range p.series {
		for _, pt := range s.pts {
			if p.xmax == 0 {
				xmax = max(xmax, finite(pt[0]))
			}
			if p.ymax == 0 {
				ymax = max(ymax, finite(pt[1]))
			}
		}
	}
	if p.ymax == 0 {
		ymax *= 1.05
	}
	if xmax <= 0 {
		xmax = 1
	}
	if ymax <= 0 {
		ymax = 1
	}
	xt, xstep := niceTicks(0, xmax, 6)
	yt, ystep := niceTicks(0, ymax, 5)
	xhi, yhi := xt[len(xt)-1], yt[len(yt)-1]
	if p.xmax > 0 {
		xhi = p.xmax
	}
	if p.ymax > 0 {
		yhi = p.ymax
	}
	sx := func(v float64) float64 { return x0 + min(finite(v), xhi)/xhi*(x1-x0) }
	sy := func(v float64) float64 { return y1 - min(finite(v), yhi)/yhi*(y1-y0) }
	fmt.Fprintf(b, `<g class="panel">`+"\n")
	fmt.Fprintf(b, `<text x="%s" y="%d" text-anchor="middle" font-size="13" font-weight="bold">%s</text>`+"\n",
		f1((x0+x1)/2), py+plotTop-10, esc(p.title))
	for _, v := range yt {
		if v > yhi*(1+1e-9) {
			continue
		}
		y := f1(sy(v))
		fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="#e5e5e5"/>`, f1(x0), y, f1(x1), y)
		fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n", f1(x0-6), y, tickLabel(v, ystep))
	}
	for _, v := range xt {
		if v > xhi*(1+1e-9) {
			continue
		}
		x := f1(sx(v))
		fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="#333"/>`, x, f1(y1), x, f1(y1+5))
		fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="middle">%s</text>`+"\n", x, f1(y1+18), tickLabel(v, xstep))
	}
	fmt.Fprintf(b, `<polyline points="%s,%s %s,%s %s,%s" fill="none" stroke="#333"/>`+"\n", f1(x0), f1(y0), f1(x0), f1(y1), f1(x1), f1(y1))
	fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="middle">%s</text>`+"\n", f1((x0+x1)/2), f1(y1+38), esc(p.xlabel))
	cy := (y0 + y1) / 2
	fmt.Fprintf(b, `<text x="%d" y="%s" text-anchor="middle" transform="rotate(-90 %d %s)">%s</text>`+"\n", px+16, f1(cy), px+16, f1(cy), esc(p.ylabel))
	for _, s := range p.series {
		if len(s.pts) == 0 {
			continue
		}
		color, dash := seriesStyle(s.style)
		if s.dashed {
			dash = ` stroke-dasharray="6 4"`
		}
		var d strings.Builder
		for j, pt := range s.pts {
			c := "L"
			if j == 0 {
				c = "M"
			}
			fmt.Fprintf(&d, "%s%s %s ", c, f1(sx(pt[0])), f1(sy(pt[1])))
		}
		fmt.Fprintf(b, `<path d="%s" fill="none" stroke="%s" stroke-width="2"%s><title>%s</title></path>`+"\n",
			strings.TrimSpace(d.String()), color, dash, esc(s.name))
		if len(s.pts) == 1 {
			fmt.Fprintf(b, `<circle cx="%s" cy="%s" r="3" fill="%s"/>`+"\n", f1(sx(s.pts[0][0])), f1(sy(s.pts[0][1])), color)
		}
	}
	b.WriteString("</g>\n")
}

// oracleFigure plots mean and p99 TTFT against rate per policy with the
// oracle bound dashed; "" when no result carries one.
func oracleFigure(results []Result) string {
	ss := groupSeries(results)
	type bound struct{ rate, mean, p99 float64 }
	var oracle []bound
	for _, r := range results {
		if r.OracleTTFT != nil && !slices.ContainsFunc(oracle, func(o bound) bool { return o.rate == r.Rate }) {
			oracle = append(oracle, bound{r.Rate, r.OracleTTFT.Mean, r.OracleTTFT.P99})
		}
	}
	if len(oracle) == 0 {
		return ""
	}
	slices.SortFunc(oracle, func(a, b bound) int { return cmp.Compare(a.rate, b.rate) })
	mk := func(title string, v func(Summary) float64, ov func(bound) float64) plot {
		p := plot{title: title, xlabel: "request rate (req/s)", ylabel: title + " (ms)"}
		for i, s := range ss {
			ps := plotSeries{name: s.name, style: i}
			for _, r := range s.points {
				ps.pts = append(ps.pts, [2]float64{r.Rate, v(r.TTFT)})
			}
			p.series = append(p.series, ps)
		}
		o := plotSeries{name: "oracle bound", style: len(ss) % len(palette), dashed: true}
		for _, b := range oracle {
			o.pts = append(o.pts, [2]float64{b.rate, ov(b)})
		}
		p.series = append(p.series, o)
		return p
	}
	return svgPlots(
		mk("Mean TTFT", func(s Summary) float64 { return s.Mean }, func(b bound) float64 { return b.mean }),
		mk("P99 TTFT", func(s Summary) float64 { return s.P99 }, func(b bound) float64 { return b.p99 }),
	)
}

// cdfFigure plots the TTFT CDF of every policy at rate.
func cdfFigure(runs []run, rate float64) string {
	idx := policyIndex(runs)
	p := plot{title: fmt.Sprintf("TTFT CDF at %g req/s", rate), xlabel: "TTFT (ms)", ylabel: "fraction of requests", ymax: 1}
	for _, r := range runs {
		if r.rate != rate {
			continue
		}
		var v []float64
		for _, rec := range r.recs {
			if !rec.Failed() {
				v = append(v, finite(rec.TTFTMs))
			}
		}
		if len(v) == 0 {
			continue
		}
		slices.Sort(v)
		p.xmax = max(p.xmax, Percentile(v, 99)*1.1)
		// At most ~200 points: the CDF's steps at evenly spaced ranks.
		s := plotSeries{name: r.policy, style: idx[r.policy], pts: [][2]float64{{0, 0}}}
		step := max(1, len(v)/200)
		for i := 0; i < len(v); i += step {
			s.pts = append(s.pts, [2]float64{v[i], float64(i+1) / float64(len(v))})
		}
		s.pts = append(s.pts, [2]float64{v[len(v)-1], 1})
		p.series = append(p.series, s)
	}
	return svgPlots(p)
}

// timeBuckets splits the span of recs' start times into about 40 buckets and
// returns the bucket width in seconds and each record's bucket.
func timeBuckets(recs []RequestRecord) (width float64, n int, bucket func(RequestRecord) int) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range recs {
		lo, hi = min(lo, r.start()), max(hi, r.start())
	}
	span := hi - lo
	if !(span > 0) {
		span = 1
	}
	n = 40
	width = span / float64(n)
	return width, n, func(r RequestRecord) int { return min(int((r.start()-lo)/width), n-1) }
}

// loadFigure plots requests started per second on each replica over time
// for one run; "" when its records name no replica.
func loadFigure(r run) string {
	var names []string
	for _, rec := range r.recs {
		if rec.Replica != "" && !slices.Contains(names, rec.Replica) {
			names = append(names, rec.Replica)
		}
	}
	if len(names) == 0 {
		return ""
	}
	slices.SortFunc(names, compareNatural)
	width, n, bucket := timeBuckets(r.recs)
	counts := make(map[string][]float64, len(names))
	for _, name := range names {
		counts[name] = make([]float64, n)
	}
	for _, rec := range r.recs {
		if rec.Replica != "" {
			counts[rec.Replica][bucket(rec)]++
		}
	}
	p := plot{title: fmt.Sprintf("%s at %g req/s", r.policy, r.rate), xlabel: "time since start (s)", ylabel: "requests started per second"}
	for i, name := range names {
		s := plotSeries{name: name, style: i}
		for k, c := range counts[name] {
			s.pts = append(s.pts, [2]float64{(float64(k) + 0.5) * width, c / width})
		}
		p.series = append(p.series, s)
	}
	return svgPlots(p)
}

// hitFigure plots the prefix hit ratio over time of every policy at rate.
func hitFigure(runs []run, rate float64) string {
	idx := policyIndex(runs)
	p := plot{title: fmt.Sprintf("Prefix hit ratio at %g req/s", rate), xlabel: "time since start (s)", ylabel: "hit ratio", ymax: 1}
	for _, r := range runs {
		if r.rate != rate {
			continue
		}
		width, n, bucket := timeBuckets(r.recs)
		cached, prompt := make([]float64, n), make([]float64, n)
		for _, rec := range r.recs {
			if !rec.Failed() {
				k := bucket(rec)
				cached[k] += float64(rec.CachedTokens)
				prompt[k] += float64(rec.PromptTokens)
			}
		}
		s := plotSeries{name: r.policy, style: idx[r.policy]}
		for k := range n {
			if prompt[k] > 0 {
				s.pts = append(s.pts, [2]float64{(float64(k) + 0.5) * width, cached[k] / prompt[k]})
			}
		}
		p.series = append(p.series, s)
	}
	return svgPlots(p)
}

// compareNatural orders names with their digit runs compared as numbers
// (replica-2 before replica-10).
func compareNatural(a, b string) int {
	for a != "" && b != "" {
		da, db := digits(a), digits(b)
		if da > 0 && db > 0 {
			na, _ := strconv.Atoi(a[:da])
			nb, _ := strconv.Atoi(b[:db])
			if c := cmp.Compare(na, nb); c != 0 {
				return c
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return cmp.Compare(a[0], b[0])
		}
		a, b = a[1:], b[1:]
	}
	return cmp.Compare(len(a), len(b))
}

func digits(s string) int {
	i := 0
	for i < len(s) && i < 9 && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return i
}
