package main

import (
	"os"
	"os/signal"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/demo"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// newDemoCmd is `prefixlb demo`: its flags (and demo_llamacpp.go's) fill a
// demo.Config, and demo.Run runs and compares the policies.
func newDemoCmd() *cobra.Command {
	c := &demo.Config{Workload: workload.DefaultFlags()}
	c.Workload.Spec = workload.DefaultSpec("toolbench")
	c.Workload.Spec.ToolBench.Zipf = 1.1
	c.Workload.Spec.Requests = 900
	c.Workload.Arrival.Rate = 36
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run replicas and the router on loopback and compare policies live",
		Long: `demo starts N modelled GPU replicas (prefixlb engine) and the router
(prefixlb serve) in this process on loopback, drives the same open-loop
workload through each policy in turn, over real HTTP and SSE, with fresh
replicas each time, and prints the comparison. Nothing but the GPU is
simulated: the replicas' time comes from the cost profile.

Each replica publishes its KV-cache events (vLLM's ZeroMQ stream) on loopback
and the router follows them, so it knows every replica's cache exactly
(--no-kv-events: the router mirrors the caches from its own decisions).

The replicas and the router share a real tokenizer (--tokenizer, the bundled
Qwen3 one by default; none: one token per word and text-chunk keys), which the
router checks against each replica's /tokenize at start. --mode chat sends
every request as a chat (one user message holding the prompt as text), so the
chat template and tokenizer run end to end in the router and the replicas;
the default sends token ids.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("workload-replicas") {
				c.Workload.Spec.Replicas = c.Replicas
			}
			c.Changed = cmd.Flags().Changed
			if c.PrefillReplicas > 0 && !cmd.Flags().Changed("policies") {
				c.Policies = "e2-pd,round-robin-pd,llmd-pd,dynamo-pd"
			}
			if c.PrefillReplicas > 0 && !cmd.Flags().Changed("profile") {
				// A pull is priced by the KV bytes a token takes, which a
				// roofline profile knows and the default fitted one does not.
				c.Profile = "llama3.1-8b-h100"
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			return demo.Run(ctx, *c, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	c.Workload.AddFlags(fs)
	fs.IntVar(&c.Replicas, "replicas", 4, "number of replicas")
	fs.IntVar(&c.PrefillReplicas, "prefill-replicas", 0, "make the first K replicas prefill replicas and the rest decode replicas (P/D disaggregation; --policies default to e2-pd,round-robin-pd,llmd-pd,dynamo-pd and --profile to llama3.1-8b-h100, whose KV size prices the pulls)")
	fs.StringVar(&c.Profile, "profile", "mistral-7b-a6000", "replicas' cost profile (name or YAML file)")
	fs.StringVar(&c.Policies, "policies", "round-robin,e2", "comma-separated policies to compare")
	fs.Float64Var(&c.Speedup, "speedup", 1, "run the modelled GPUs this many times faster (the arrival rate is scaled to match)")
	fs.StringVar(&c.JSONPath, "json", "", "write the comparison as JSON to this file (- for stdout)")
	fs.BoolVarP(&c.Verbose, "verbose", "v", false, "log the replicas' and the router's messages")
	fs.BoolVar(&c.NoKVEvents, "no-kv-events", false, "do not publish KV events: the router mirrors the replicas' caches from its decisions")
	fs.BoolVar(&c.Hold, "hold", false, "after the comparison, keep the last policy's replicas, router and dashboard running until Ctrl-C")
	fs.StringVar(&c.Tokenizer, "tokenizer", keying.TokenizerQwen3, "tokenizer of the replicas and the router: qwen3 (bundled), a tokenizer.json, a model directory, or none")
	addLlamaCppFlags(fs, c)
	fs.StringVar(&c.Mode, "mode", string(loadgen.ModeCompletions), "how prompts are sent: completions (token ids), text (/v1/completions with text: one whole-word token of the tokenizer per id) or chat (the same text as a user message to /v1/chat/completions)")
	return cmd
}

func init() { rootCmd.AddCommand(newDemoCmd()) }
