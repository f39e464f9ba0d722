package report

import (
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Chart geometry, in SVG user units (pixels).
const (
	chartW      = 960 // whole figure
	legendH     = 56  // title and legend band above the panels
	panelW      = chartW / 2
	panelH      = 320
	plotLeft    = 70 // room for y tick labels and the axis title
	plotRight   = 20
	plotTop     = 30 // room for the panel title
	plotBottom  = 46 // room for x tick labels and the axis title
	legendItemH = 18
)

// palette is Tableau 10, distinguishable in print and by most colour-blind
// readers; series beyond ten reuse it with a dashed line.
var palette = []string{
	"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
	"#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
}

// panel is one measure plotted against rate.
type panel struct {
	title string
	value func(Result) float64 // milliseconds
}

// chartPanels are the four panels of Preble's figures (mean and p99 of TTFT
// and of end-to-end latency against request rate), in reading order.
var chartPanels = []panel{
	{"Mean TTFT", func(r Result) float64 { return r.TTFT.Mean }},
	{"P99 TTFT", func(r Result) float64 { return r.TTFT.P99 }},
	{"Mean latency", func(r Result) float64 { return r.Latency.Mean }},
	{"P99 latency", func(r Result) float64 { return r.Latency.P99 }},
}

// series is the results of one policy, sorted by rate.
type series struct {
	name   string
	points []Result
}

// WriteChart writes an SVG figure of results to w: four panels (mean TTFT,
// p99 TTFT, mean latency, p99 latency) against request rate, one line with
// point markers per policy, and a legend. Each panel holds exactly one <path>
// per policy; a policy measured at a single rate shows as a marker. Y axes are
// linear from 0 and switch from ms to s when values reach 10 s. When the
// results span several workloads, series are named "policy / workload".
func WriteChart(w io.Writer, results []Result) error {
	ss := groupSeries(results)
	var b strings.Builder
	legendRows := legendLayout(ss)
	top := legendH + (max(len(legendRows), 1)-1)*legendItemH
	height := top + 2*panelH
	fmt.Fprintf(&b, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		chartW, height, chartW, height)
	fmt.Fprintf(&b, `<rect x="0" y="0" width="%d" height="%d" fill="white"/>`+"\n", chartW, height)
	fmt.Fprintf(&b, `<text x="%d" y="20" text-anchor="middle" font-size="15" font-weight="bold">%s</text>`+"\n",
		chartW/2, esc(chartTitle(results)))
	writeLegend(&b, ss, legendRows)
	if len(ss) == 0 {
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">no results</text>`+"\n", chartW/2, top+panelH)
	} else {
		xlo, xhi := rateRange(ss)
		for i, p := range chartPanels {
			writePanel(&b, p, ss, (i%2)*panelW, top+(i/2)*panelH, xlo, xhi)
		}
	}
	b.WriteString("</svg>\n")
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("report: write chart: %w", err)
	}
	return nil
}

// WriteChartFile writes the chart of results to the file at path (see
// [WriteChart]), creating or truncating it.
func WriteChartFile(path string, results []Result) error {
	return writeFile(path, func(w io.Writer) error { return WriteChart(w, results) })
}

// chartTitle names the workload (and replicas and profile) when all results
// share them.
func chartTitle(results []Result) string {
	title := "prefixlb"
	if len(results) == 0 {
		return title
	}
	same := func(f func(Result) string) string {
		v := f(results[0])
		for _, r := range results[1:] {
			if f(r) != v {
				return ""
			}
		}
		return v
	}
	parts := []string{title}
	if wl := same(func(r Result) string { return r.Workload }); wl != "" {
		parts = append(parts, wl)
	}
	if n := same(func(r Result) string { return strconv.Itoa(r.Replicas) }); n != "" && n != "0" {
		parts = append(parts, n+" replicas")
	}
	if p := same(func(r Result) string { return r.Profile }); p != "" {
		parts = append(parts, p)
	}
	if t := same(func(r Result) string { return r.Target }); t != "" {
		parts = append(parts, t)
	}
	return strings.Join(parts, " — ")
}

// groupSeries groups results by policy (and workload, when there are
// several), in order of first appearance, each sorted by rate.
func groupSeries(results []Result) []series {
	workloads := map[string]bool{}
	for _, r := range results {
		workloads[r.Workload] = true
	}
	var ss []series
	index := map[string]int{}
	for _, r := range results {
		name := r.Policy
		if len(workloads) > 1 {
			name += " / " + r.Workload
		}
		i, ok := index[name]
		if !ok {
			i = len(ss)
			index[name] = i
			ss = append(ss, series{name: name})
		}
		ss[i].points = append(ss[i].points, r)
	}
	for i := range ss {
		slices.SortStableFunc(ss[i].points, func(a, b Result) int {
			switch {
			case a.Rate < b.Rate:
				return -1
			case a.Rate > b.Rate:
				return 1
			}
			return 0
		})
	}
	return ss
}

// legendLayout splits the series into rows of the legend that fit the width.
func legendLayout(ss []series) [][]int {
	var rows [][]int
	var row []int
	x := 0
	for i, s := range ss {
		wd := legendItemW(s.name)
		if len(row) > 0 && x+wd > chartW-40 {
			rows = append(rows, row)
			row, x = nil, 0
		}
		row = append(row, i)
		x += wd
	}
	if len(row) > 0 {
		rows = append(rows, row)
	}
	return rows
}

// legendItemW estimates the width of one legend entry (swatch and label).
func legendItemW(name string) int { return 34 + 7*len([]rune(name)) + 18 }

// writeLegend draws the legend rows, centred under the title. Swatches are
// <line> elements so that each panel's <path> count stays one per series.
func writeLegend(b *strings.Builder, ss []series, rows [][]int) {
	for ri, row := range rows {
		total := 0
		for _, i := range row {
			total += legendItemW(ss[i].name)
		}
		x := (chartW - total) / 2
		y := 40 + ri*legendItemH
		for _, i := range row {
			color, dash := seriesStyle(i)
			fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2.5"%s/>`,
				x, y, x+24, y, color, dash)
			fmt.Fprintf(b, `<circle cx="%d" cy="%d" r="3" fill="%s"/>`, x+12, y, color)
			fmt.Fprintf(b, `<text x="%d" y="%d">%s</text>`+"\n", x+30, y+4, esc(ss[i].name))
			x += legendItemW(ss[i].name)
		}
	}
}

// seriesStyle returns the colour and extra stroke attributes of series i.
func seriesStyle(i int) (color, dash string) {
	color = palette[i%len(palette)]
	if i >= len(palette) {
		dash = ` stroke-dasharray="6 3"`
	}
	return color, dash
}

// rateRange returns the x-axis data range over all series' rates, widened
// around a single rate so that it sits in the middle of the panel.
func rateRange(ss []series) (lo, hi float64) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, s := range ss {
		for _, p := range s.points {
			lo, hi = min(lo, finite(p.Rate)), max(hi, finite(p.Rate))
		}
	}
	if lo == hi {
		if lo == 0 {
			return 0, 1
		}
		return lo - math.Abs(lo)/2, hi + math.Abs(hi)/2
	}
	return lo, hi
}

// writePanel draws one panel with its top-left corner at (px, py).
func writePanel(b *strings.Builder, p panel, ss []series, px, py int, xlo, xhi float64) {
	x0, x1 := float64(px+plotLeft), float64(px+panelW-plotRight)
	y0, y1 := float64(py+plotTop), float64(py+panelH-plotBottom)

	ymax := 0.0
	for _, s := range ss {
		for _, r := range s.points {
			ymax = max(ymax, finite(p.value(r)))
		}
	}
	unit, scale := "ms", 1.0
	if ymax >= 10000 {
		unit, scale = "s", 1000
	}
	ymax = ymax / scale * 1.05 // headroom: a top point never sits on the frame
	if ymax <= 0 {
		ymax = 1
	}
	yt, ystep := niceTicks(0, ymax, 5)
	ylo, yhi := yt[0], yt[len(yt)-1]
	xt, xstep := niceTicks(xlo, xhi, 6)
	xlo, xhi = xt[0], xt[len(xt)-1]

	sx := func(v float64) float64 { return x0 + (v-xlo)/(xhi-xlo)*(x1-x0) }
	sy := func(v float64) float64 { return y1 - (v-ylo)/(yhi-ylo)*(y1-y0) }

	fmt.Fprintf(b, `<g class="panel">`+"\n")
	fmt.Fprintf(b, `<text x="%s" y="%d" text-anchor="middle" font-size="13" font-weight="bold">%s</text>`+"\n",
		f1((x0+x1)/2), py+plotTop-10, esc(p.title))
	// Grid and ticks.
	for _, v := range yt {
		y := f1(sy(v))
		fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="#e5e5e5"/>`, f1(x0), y, f1(x1), y)
		fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n",
			f1(x0-6), y, tickLabel(v, ystep))
	}
	for _, v := range xt {
		x := f1(sx(v))
		fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="#333"/>`, x, f1(y1), x, f1(y1+5))
		fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="middle">%s</text>`+"\n", x, f1(y1+18), tickLabel(v, xstep))
	}
	// Axes and their titles.
	fmt.Fprintf(b, `<polyline points="%s,%s %s,%s %s,%s" fill="none" stroke="#333"/>`+"\n",
		f1(x0), f1(y0), f1(x0), f1(y1), f1(x1), f1(y1))
	fmt.Fprintf(b, `<text x="%s" y="%s" text-anchor="middle">request rate (req/s)</text>`+"\n",
		f1((x0+x1)/2), f1(y1+38))
	cy := (y0 + y1) / 2
	fmt.Fprintf(b, `<text x="%d" y="%s" text-anchor="middle" transform="rotate(-90 %d %s)">%s (%s)</text>`+"\n",
		px+16, f1(cy), px+16, f1(cy), esc(p.title), unit)
	// One path per series, then its markers.
	for i, s := range ss {
		color, dash := seriesStyle(i)
		var d strings.Builder
		for j, r := range s.points {
			cmd := "L"
			if j == 0 {
				cmd = "M"
			}
			fmt.Fprintf(&d, "%s%s %s ", cmd, f1(sx(finite(r.Rate))), f1(sy(finite(p.value(r))/scale)))
		}
		fmt.Fprintf(b, `<path d="%s" fill="none" stroke="%s" stroke-width="2"%s><title>%s</title></path>`+"\n",
			strings.TrimSpace(d.String()), color, dash, esc(s.name))
		for _, r := range s.points {
			v := finite(p.value(r))
			fmt.Fprintf(b, `<circle cx="%s" cy="%s" r="3" fill="%s"><title>%s</title></circle>`+"\n",
				f1(sx(finite(r.Rate))), f1(sy(v/scale)), color,
				esc(fmt.Sprintf("%s: rate %g, %s %.4g ms", s.name, r.Rate, p.title, v)))
		}
	}
	b.WriteString("</g>\n")
}

// niceTicks returns about n evenly spaced "nice" tick values (steps of 1, 2,
// 2.5 or 5 times a power of ten) covering [lo, hi], first ≤ lo and last ≥ hi,
// and the step between them. This is Heckbert's "nice numbers for graph
// labels" (Graphics Gems, 1990) with 2.5 added as a step.
func niceTicks(lo, hi float64, n int) ([]float64, float64) {
	if !(hi > lo) {
		hi = lo + 1
	}
	raw := (hi - lo) / float64(max(n-1, 1))
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	step := 10 * mag
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= raw {
			step = m * mag
			break
		}
	}
	first := math.Floor(lo/step) * step
	last := math.Ceil(hi/step) * step
	var ticks []float64
	for i := 0; ; i++ {
		v := first + float64(i)*step
		ticks = append(ticks, v)
		if v >= last-step/1e6 || i > 100 {
			break
		}
	}
	return ticks, step
}

// tickLabel formats a tick value with just the decimals its step needs.
func tickLabel(v, step float64) string {
	dec := 0
	if step > 0 {
		dec = max(0, int(math.Ceil(-math.Log10(step)-1e-9)))
		if frac := step * math.Pow(10, float64(dec)); math.Abs(frac-math.Round(frac)) > 1e-6 {
			dec++ // steps like 2.5·10^k need one more decimal
		}
	}
	if math.Abs(v) < step/1e6 {
		v = 0 // avoid "-0"
	}
	return strconv.FormatFloat(v, 'f', dec, 64)
}

// f1 formats a coordinate with one decimal.
func f1(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// finite maps NaN and ±Inf to 0 so that one bad value cannot break the figure.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}

// esc escapes s for use as SVG text or attribute content.
func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder never fails
	return b.String()
}
