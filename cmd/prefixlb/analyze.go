package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/workload"
	"github.com/spf13/cobra"
)

// analyzeCmd prints the prefix-sharing statistics of a trace or a generated
// workload (workload.Analyze).
func analyzeCmd() *cobra.Command {
	f := workload.DefaultFlags()
	f.Spec.Name = ""
	var (
		blockSize int
		jsonOut   string
	)
	cmd := &cobra.Command{
		Use:   "analyze --trace FILE [--trace-format mooncake|azure|jsonl] | --workload NAME [generator flags]",
		Short: "Prefix-sharing statistics of a trace or workload",
		Long: `analyze reports how much a prefix cache could save on a trace or a generated
workload: the shared-token ratio with an unlimited cache (per-request mean, as
Preble reports it, and token-weighted), the fraction of blocks that continue a
leading run of blocks seen earlier (Mooncake's infinite-cache hit ratio), the
popularity of shared prefixes, the session structure and the length
distributions. Trace formats are described in docs/traces.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if (f.Trace == "") == (f.Spec.Name == "") {
				return fmt.Errorf("analyze: give exactly one of --trace FILE or --workload NAME")
			}
			reqs, skipped, err := f.Load()
			if err != nil {
				return fmt.Errorf("analyze: %w", err)
			}
			for _, le := range skipped {
				fmt.Fprintf(cmd.ErrOrStderr(), "skipped: %v\n", &le)
			}
			st, err := workload.Analyze(reqs, blockSize)
			if err != nil {
				return err
			}
			if jsonOut != "" {
				if err := writeJSON(jsonOut, cmd.OutOrStdout(), st, f.Describe(), len(skipped)); err != nil {
					return fmt.Errorf("analyze: %w", err)
				}
				if jsonOut == "-" {
					return nil
				}
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "%s\n", f.Describe())
			if len(skipped) > 0 {
				fmt.Fprintf(out, "skipped %d malformed lines\n", len(skipped))
			}
			return st.WriteTable(out)
		},
	}
	fs := cmd.Flags()
	f.AddFlags(fs)
	fs.IntVar(&blockSize, "block-size", blocks.DefaultBlockSize, "KV block size in tokens for the sharing figures (Mooncake traces: 512)")
	fs.StringVar(&jsonOut, "json", "", "also write the statistics as JSON to FILE (- for stdout, instead of the table)")
	return cmd
}

func writeJSON(name string, stdout io.Writer, st workload.Stats, source string, skipped int) error {
	doc := struct {
		Source  string         `json:"source"`
		Skipped int            `json:"skipped_lines"`
		Stats   workload.Stats `json:"stats"`
	}{source, skipped, st}
	if name == "-" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(doc)
	}
	fh, err := os.Create(name)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(fh)
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

func init() {
	rootCmd.AddCommand(analyzeCmd())
}
