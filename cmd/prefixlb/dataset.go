package main

import (
	"fmt"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/dataset"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// addDatasetFlags registers --dataset and its flags on fs for f (bench,
// sim and analyze) and wires the reader; withTokenizer also registers
// --tokenizer for the dataset's tokenizer (sim and analyze: bench has its
// own, which it hands to the dataset).
func addDatasetFlags(fs *pflag.FlagSet, f *workload.Flags, withTokenizer bool) {
	f.AddDatasetFlags(fs)
	f.LoadDataset = dataset.Load
	if withTokenizer {
		fs.StringVar(&f.Dataset.Tokenizer, "tokenizer", "", "--dataset: the tokenizer its text is encoded with, qwen3 (bundled), a tokenizer.json or a model directory (default: the bundled Qwen3, as bench's)")
	}
}

// datasetArgs accepts no argument, or, with --dataset, the dataset's FILE
// (the one argument), which it puts in f.Dataset.File.
func datasetArgs(f *workload.Flags) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if f.Dataset.Name == "" {
			return cobra.NoArgs(cmd, args)
		}
		if len(args) != 1 {
			return fmt.Errorf("--dataset %s takes one argument, its FILE; got %d", f.Dataset.Name, len(args))
		}
		f.Dataset.File = args[0]
		return nil
	}
}
