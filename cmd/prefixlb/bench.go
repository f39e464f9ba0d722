package main

import (
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/bench"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func init() { rootCmd.AddCommand(benchCmd()) }

// benchCmd is `prefixlb bench`: its flags fill a bench.Config, and bench.Run
// drives the open-loop load generator with the workload and reports it.
func benchCmd() *cobra.Command {
	c := &bench.Config{Workload: workload.DefaultFlags(), Load: loadgen.DefaultConfig()}
	c.Workload.Spec.Name = ""
	cfg := &c.Load
	cmd := &cobra.Command{
		Use:   "bench --target URL --workload NAME|--trace FILE|--dataset NAME FILE --rate R --duration D [--json FILE] [--out DIR]",
		Short: "Open-loop load generator for any OpenAI-compatible endpoint",
		Long: `bench sends a generated workload or a trace to an OpenAI-compatible server
(vLLM, SGLang, llama.cpp's llama-server, prefixlb serve, prefixlb engine)
open-loop: each request leaves at its arrival time whether or not earlier ones
have finished. It streams every response and reports TTFT, inter-token
latency, TPOT and end-to-end latency percentiles, throughput, and the
prefix-cache hit ratio the server reports in
usage.prompt_tokens_details.cached_tokens (vLLM, SGLang) or, from llama.cpp,
usage.prompt_tokens - timings.prompt_n.

By default prompts are sent as token ids to /v1/completions, so requests that
share a prefix share it exactly on the server with no tokenizer involved.
--mode text sends them as text to /v1/completions, --mode chat as one user
message to /v1/chat/completions: each token id becomes one whole-word token
of the target's tokenizer (" word", checked to encode to one token), so a
prompt encodes to exactly the workload's length and prompts sharing N tokens
share a text prefix of N tokens. The tokenizer is --tokenizer (qwen3, a
tokenizer.json or a model directory), else the bundled Qwen3 checked against
the target's /tokenize (a warning when it differs or cannot be checked); the
header line on stderr names it and, in chat mode, the tokens the chat
template adds a request. Each request asks for exactly its output length
(max_tokens = min_tokens, ignore_eos).

The table shows the mean prompt as the target counted it (usage.prompt_tokens)
beside the workload's (JSON prompt_tokens_mean, workload_prompt_tokens_mean);
bench warns when they differ by more than 5% (chat: after the template's
tokens). Failures are listed by class, each with its count and one message
(JSON error_classes: the message with its numbers replaced by N → count and
example).

--dataset sharegpt FILE replays ShareGPT conversations turn by turn, each
turn re-sending the conversation so far with its recorded answers, the next
turn sent only once the previous one's answer has arrived (and not before
its --rate arrival); --dataset loogle FILE sends LooGLE's long documents,
each with its questions. Their real text is sent (--mode text: the
conversation as one text; --mode chat: its messages; --mode completions:
its token ids), tokenized with the tokenizer in force (--tokenizer, else
the bundled Qwen3), so the workload's prompt sizes are the dataset's as
that tokenizer counts them; each request asks for the recorded answer's
length, at most --max-output-tokens (docs/traces.md).

--duration stops sending after D; when --requests is not given, enough
requests are generated to fill D at --rate. The table goes to stdout; --json
writes the results file, --out DIR writes results.json, requests.csv,
chart.svg and report.html there.

--slo 'ttft_p90=2s[,tpot_p90=100ms]' with --ramp 'rate:duration,...' (rising
rates; --arrival ramp implied) measures the target's capacity at the
objective: each ramp stage is one step at its rate, the stages following each
other without a pause, and a request belongs to the stage it is sent in. As
each stage's requests finish, a line on stderr gives its offered rate,
throughput, the SLO's percentiles, whether it met the SLO and its goodput
(requests/s that met every limit). The first stage that misses ends the run
(--slo-keep-going runs every stage); capacity_rps is the highest stage rate
that met the SLO with every lower stage meeting it too. The JSON has one
result per stage with the fields of sim --slo: slo, slo_met, slo_observed,
goodput_rps, capacity_rps, at_capacity (docs/capacity.md).`,
		Example: `  prefixlb bench --target http://127.0.0.1:8080 --workload toolbench --rate 10 --duration 60s --json out.json
  prefixlb bench --target http://127.0.0.1:8080 --workload toolbench --zipf 1.1 \
      --slo ttft_p90=2s --ramp 10:60s,20:60s,30:60s,40:60s,50:60s --json capacity.json`,
		Args: datasetArgs(&c.Workload),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c.RequestsGiven = cmd.Flags().Changed("requests")
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return bench.Run(ctx, *c, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	c.Workload.AddFlags(fs)
	addDatasetFlags(fs, &c.Workload, false)
	fs.StringVar(&cfg.Target, "target", "", "base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000 (required)")
	fs.StringVar(&c.Mode, "mode", string(loadgen.ModeText), "how prompts are sent: text (one whole-word token of the tokenizer per id: what users send), completions (token ids), chat (the same text as a user message to /v1/chat/completions)")
	fs.StringVar(&c.Tokenizer, "tokenizer", "", "--mode text/chat and --dataset: the target's tokenizer, qwen3 (bundled), a tokenizer.json or a model directory (default: the bundled Qwen3, checked against the target's /tokenize)")
	fs.StringVar(&cfg.Model, "model", "", `model name to send (default: the first of GET /v1/models, else "default"); a LoRA adapter's request (--workload lora) sends its adapter instead`)
	fs.StringVar(&cfg.Policy, "label", cfg.Policy, `name of this run in the results' "policy" field (e.g. the router policy behind --target)`)
	fs.DurationVar(&c.Duration, "duration", 0, "stop sending after this long (0: send every request of the workload)")
	fs.IntVar(&cfg.MaxInFlight, "max-inflight", cfg.MaxInFlight, "most requests outstanding at once; requests due beyond it wait and are counted as delayed")
	fs.DurationVar(&cfg.RequestTimeout, "timeout", cfg.RequestTimeout, "per-request timeout (0: none)")
	fs.BoolVar(&cfg.ProgressAlways, "progress", false, "write progress lines to stderr even when it is not a terminal")
	fs.StringArrayVar(&c.Headers, "header", nil, `extra request header "Name: value" (repeatable), e.g. "Authorization: Bearer KEY"`)
	fs.StringVar(&c.JSONPath, "json", "", "write the results as JSON to FILE (- for stdout)")
	fs.StringVar(&c.OutDir, "out", "", "write results.json, requests.csv, chart.svg and report.html to DIR")
	fs.StringVar(&c.SLO, "slo", "", `measure the capacity at this objective over the --ramp stages, e.g. ttft_p90=2s,tpot_p90=100ms (metrics ttft, tpot, e2e)`)
	fs.BoolVar(&c.SLOKeepGoing, "slo-keep-going", false, "--slo: run every --ramp stage, also after one missed the objective")
	_ = cmd.MarkFlagRequired("target")
	return cmd
}
