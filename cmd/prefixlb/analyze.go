package main

import (
	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/analyze"
	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// analyzeCmd is `prefixlb analyze`: its flags fill an analyze.Config, and
// analyze.Run prints the prefix-sharing statistics of a trace or a
// generated workload.
func analyzeCmd() *cobra.Command {
	c := &analyze.Config{Workload: workload.DefaultFlags()}
	c.Workload.Spec.Name = ""
	cmd := &cobra.Command{
		Use:   "analyze --trace FILE [--trace-format mooncake|azure|jsonl] | --workload NAME [generator flags] | --dataset sharegpt|loogle FILE [--tokenizer T]",
		Short: "Prefix-sharing statistics of a trace or workload",
		Long: `analyze reports how much a prefix cache could save on a trace or a generated
workload: the shared-token ratio with an unlimited cache (per-request mean, as
Preble reports it, and token-weighted), the fraction of blocks that continue a
leading run of blocks seen earlier (Mooncake's infinite-cache hit ratio), the
popularity of shared prefixes, the session structure and the length
distributions. Trace formats and datasets are described in docs/traces.md;
a dataset is tokenized with --tokenizer (default the bundled Qwen3), as sim
and bench tokenize it.`,
		Args: datasetArgs(&c.Workload),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if c.Workload.Dataset.Name != "" && !cmd.Flags().Changed("requests") {
				c.Workload.Spec.Requests = 0 // the whole dataset
			}
			return analyze.Run(*c, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	c.Workload.AddFlags(fs)
	addDatasetFlags(fs, &c.Workload, true)
	fs.IntVar(&c.BlockSize, "block-size", blocks.DefaultBlockSize, "KV block size in tokens for the sharing figures (Mooncake traces: 512)")
	fs.StringVar(&c.JSONPath, "json", "", "also write the statistics as JSON to FILE (- for stdout, instead of the table)")
	return cmd
}

func init() {
	rootCmd.AddCommand(analyzeCmd())
}
