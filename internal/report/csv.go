package report

import (
	"encoding/csv"
	"fmt"
	"io"
	"strconv"
)

// CSVHeader is the header row of the per-request CSV, in column order; the
// names match RequestRecord's JSON names.
var CSVHeader = []string{
	"id", "policy", "rate", "replica", "session", "group",
	"arrival_s", "sent_s", "ttft_ms", "latency_ms", "tpot_ms",
	"prompt_tokens", "cached_tokens", "output_tokens", "error",
}

// WriteCSV writes recs to w as CSV with a [CSVHeader] row. Floats are written
// in the shortest form that reads back to the same value.
func WriteCSV(w io.Writer, recs []RequestRecord) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(CSVHeader); err != nil {
		return fmt.Errorf("report: write csv: %w", err)
	}
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	row := make([]string, len(CSVHeader))
	for _, r := range recs {
		row = append(row[:0],
			strconv.Itoa(r.ID), r.Policy, f(r.Rate), r.Replica, r.Session, r.Group,
			f(r.ArrivalS), f(r.SentS), f(r.TTFTMs), f(r.LatencyMs), f(r.TPOTMs),
			strconv.Itoa(r.PromptTokens), strconv.Itoa(r.CachedTokens), strconv.Itoa(r.OutputTokens),
			r.Error)
		if err := cw.Write(row); err != nil {
			return fmt.Errorf("report: write csv: %w", err)
		}
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		return fmt.Errorf("report: write csv: %w", err)
	}
	return nil
}

// WriteCSVFile writes recs to the file at path (see [WriteCSV]), creating or
// truncating it.
func WriteCSVFile(path string, recs []RequestRecord) error {
	return writeFile(path, func(w io.Writer) error { return WriteCSV(w, recs) })
}
