package report

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
)

// WriteTable writes results to w as a text table with aligned columns, one
// row per result in the given order: TTFT mean/p90/p99 and latency mean/p99
// in ms, the prefix hit ratio, throughput in requests and output tokens per
// second, and errors. A "ttft/oracle" column is added when any result carries
// TTFTVsOracle, and "prompt_tok" and "workload_tok" (the mean prompt as the
// server counted it, "-" when it reported none, and as the workload gave it)
// when any carries WorkloadPromptTokensMean.
func WriteTable(w io.Writer, results []Result) error {
	oracle, busy, prompt := false, false, false
	for _, r := range results {
		if r.WorkloadPromptTokensMean > 0 {
			prompt = true
		}
		if r.TTFTVsOracle > 0 {
			oracle = true
		}
		if r.Utilization > 0 {
			busy = true
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	cols := []string{"policy", "rate", "reqs", "ttft_ms mean", "p90", "p99",
		"latency_ms mean", "p99", "hit", "req/s", "tok/s", "errors"}
	if busy {
		cols = append(cols, "busy")
	}
	if oracle {
		cols = append(cols, "ttft/oracle")
	}
	if prompt {
		cols = append(cols, "prompt_tok", "workload_tok")
	}
	// A trailing tab makes the last column a tab-terminated cell, so that
	// AlignRight aligns it too.
	line := func(cells []string) {
		fmt.Fprint(tw, strings.Join(cells, "\t")+"\t\n")
	}
	// Policies read better left-aligned: pad them to a common width.
	width := len(cols[0])
	for _, r := range results {
		width = max(width, len(r.Policy))
	}
	left := func(s string) string { return s + strings.Repeat(" ", width-len(s)) }
	cols[0] = left(cols[0])
	line(cols)
	for _, r := range results {
		cells := []string{
			left(r.Policy), num(r.Rate), strconv.Itoa(r.Requests),
			ms(r.TTFT.Mean), ms(r.TTFT.P90), ms(r.TTFT.P99),
			ms(r.Latency.Mean), ms(r.Latency.P99),
			strconv.FormatFloat(r.PrefixHitRatio, 'f', 3, 64),
			strconv.FormatFloat(r.ThroughputRPS, 'f', 2, 64),
			strconv.FormatFloat(r.OutputTokensPerS, 'f', 0, 64),
			strconv.Itoa(r.Errors),
		}
		if busy {
			cells = append(cells, strconv.FormatFloat(100*r.Utilization, 'f', 0, 64)+"%")
		}
		if oracle {
			c := "-"
			if r.TTFTVsOracle > 0 {
				c = strconv.FormatFloat(r.TTFTVsOracle, 'f', 2, 64) + "x"
			}
			cells = append(cells, c)
		}
		if prompt {
			c := "-"
			if r.PromptTokensMean > 0 {
				c = strconv.FormatFloat(r.PromptTokensMean, 'f', 0, 64)
			}
			cells = append(cells, c, strconv.FormatFloat(r.WorkloadPromptTokensMean, 'f', 0, 64))
		}
		line(cells)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("report: write table: %w", err)
	}
	return nil
}

// ms formats a duration in milliseconds with a precision that suits its size.
func ms(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
}

// num formats v in its shortest exact form.
func num(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
