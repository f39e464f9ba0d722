// Command prefixlb is a prefix-cache-aware load balancer for LLM inference
// replicas, with a cluster simulator, a replica model behind vLLM's API and a
// load generator. Each job is a subcommand; this file only wires them.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// rootCmd is the prefixlb command; subcommands add themselves in init()
// functions of their own files (sim.go, serve.go, ...).
var rootCmd = &cobra.Command{
	Use:   "prefixlb",
	Short: "Prefix-cache-aware load balancer for LLM inference replicas",
	Long: `prefixlb routes each LLM request to the replica that already holds its prompt
prefix in KV cache, weighs that against what each replica costs in GPU time, and
replicates hot prefixes (Preble's E2). It also simulates a cluster, models a GPU
replica behind vLLM's API, and generates load, so you can measure which router to
run on your own traffic.`,
	SilenceUsage:  true,
	SilenceErrors: true,
}

func main() {
	if err := rootCmd.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "prefixlb:", err)
		os.Exit(1)
	}
}
