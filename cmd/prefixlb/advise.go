package main

import (
	"os"
	"os/signal"
	"strings"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/advise"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// adviseCmd is `prefixlb advise`: its flags fill an advise.Config, and
// advise.Run analyses the traffic, searches every policy's capacity at the
// SLO in the simulator and recommends one.
func adviseCmd() *cobra.Command {
	d := advise.DefaultConfig()
	c := &d
	cmd := &cobra.Command{
		Use:   "advise --trace FILE | --workload NAME --replicas N --profile P --slo ttft_p90=2s [--policies a,b] [--html FILE] [--json FILE]",
		Short: "Which router to run for your traffic: each policy's capacity at an SLO, and the winner",
		Long: `advise answers which router to run for a given traffic on a given cluster.
It prints the traffic's prefix-sharing statistics (as prefixlb analyze does),
then searches every policy's capacity at the objective in the simulator (as
prefixlb sim --slo does: the highest request rate at which every target
holds, each rate a full simulation of the same requests, bisection to
--slo-tolerance), prints them in one table, and recommends the policy with
the highest capacity, by how much it beats the next one and round-robin.
Policies whose capacities are within the search's tolerance of each other
cannot be told apart and are reported as a tie.

A trace is offered at its own rate first and compressed or stretched in time
for the other rates; a generated workload starts at --rate (Poisson).
--html FILE writes a self-contained report (tables and charts), --json FILE
the statistics, capacities, recommendation and every simulated run
(docs/capacity.md).`,
		Example: `  prefixlb advise --trace mytrace.jsonl --replicas 8 --profile qwen3-32b-h100x2 --slo ttft_p90=2s --html advice.html
  prefixlb advise --workload toolbench --zipf 1.1 --replicas 4 --requests 1000 --rate 40 --slo ttft_p90=2s,tpot_p90=100ms`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("workload-replicas") {
				c.Sim.Workload.Spec.Replicas = c.Sim.Replicas
			}
			c.Sim.Changed = cmd.Flags().Changed
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			return advise.Run(ctx, *c, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	s := &c.Sim
	s.Workload.AddFlags(fs)
	fs.IntVar(&s.Replicas, "replicas", s.Replicas, "number of replicas")
	fs.StringVar(&s.Profile, "profile", s.Profile, "cost profile: a name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file, optionally :time_scale=X")
	fs.StringVar(&s.Policies, "policies", s.Policies, "comma-separated policies to compare: "+strings.Join(policy.Names(), ", "))
	fs.StringVar(&s.Local, "local", s.Local, "replicas' local scheduler: fcfs, lpm, priority")
	fs.IntVar(&s.ChunkBudget, "chunk-budget", 0, "prefill token budget per iteration: vLLM's max_num_batched_tokens (0: each profile's engine default)")
	fs.IntVar(&s.MaxSeqs, "max-seqs", 0, "most requests running at once per replica: vLLM's max_num_seqs (0: each profile's engine default)")
	fs.IntVar(&s.MaxLoras, "max-loras", 0, "LoRA adapters each replica holds in GPU slots (vLLM's --max-loras; 0: not modelled as slots)")
	fs.BoolVar(&s.KVEvents, "kv-events", s.KVEvents, "feed the router the replicas' KV events (else it mirrors caches from its own decisions)")
	fs.StringVar(&s.SLO, "slo", "", "the objective, e.g. ttft_p90=2s,tpot_p90=100ms (metrics ttft, tpot, e2e; required)")
	fs.Float64Var(&s.SLOTolerance, "slo-tolerance", s.SLOTolerance, "the search stops when the lowest rate that missed is within this fraction above the highest that met; capacities this close are a tie")
	fs.Float64Var(&s.SLOMaxRate, "slo-max-rate", 0, "highest rate a search tries (0: 1024 × its start)")
	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "KV block size in tokens for the sharing statistics (Mooncake traces: 512)")
	fs.StringVar(&c.JSONPath, "json", "", "write the statistics, capacities, recommendation and every run as JSON to FILE (- for stdout, instead of the text)")
	fs.StringVar(&c.HTMLPath, "html", "", "write a self-contained HTML report to FILE")
	fs.BoolVarP(&s.Quiet, "quiet", "q", false, "no progress output")
	_ = cmd.MarkFlagRequired("slo")
	return cmd
}

func init() { rootCmd.AddCommand(adviseCmd()) }
