package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
	"github.com/spf13/cobra"
)

func init() { rootCmd.AddCommand(benchCmd()) }

// benchCmd is `prefixlb bench`: the open-loop load generator (loadgen.Run)
// driven by a generated workload or a trace (workload.Flags), reported with
// package report.
func benchCmd() *cobra.Command {
	f := workload.DefaultFlags()
	f.Spec.Name = ""
	cfg := loadgen.DefaultConfig()
	var (
		mode     string
		duration time.Duration
		jsonOut  string
		outDir   string
		headers  []string
	)
	cmd := &cobra.Command{
		Use:   "bench --target URL --workload NAME|--trace FILE --rate R --duration D [--json FILE] [--out DIR]",
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
share a prefix share it exactly on the server with no tokenizer involved
(--mode text or chat sends them as words "t<id>" instead). Each request asks
for exactly its output length (max_tokens = min_tokens, ignore_eos).

--duration stops sending after D; when --requests is not given, enough
requests are generated to fill D at --rate. The table goes to stdout; --json
writes the results file, --out DIR writes results.json, requests.csv,
chart.svg and report.html there.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if (f.Trace == "") == (f.Spec.Name == "") {
				return errors.New("bench: give exactly one of --workload NAME or --trace FILE")
			}
			if duration < 0 {
				return fmt.Errorf("bench: --duration %v: want ≥ 0", duration)
			}
			if f.Trace == "" && duration > 0 && !cmd.Flags().Changed("requests") {
				f.Spec.Requests = benchRequests(&f, duration)
			}
			cfg.Mode = loadgen.Mode(mode)
			cfg.MaxDuration = duration
			cfg.Rate = f.Arrival.Rate
			cfg.Progress = cmd.ErrOrStderr()
			h, err := benchHeaders(headers)
			if err != nil {
				return err
			}
			cfg.Header = h
			if err := cfg.Validate(); err != nil {
				return fmt.Errorf("bench: %w", err)
			}
			reqs, skipped, err := f.Load()
			if err != nil {
				return fmt.Errorf("bench: %w", err)
			}
			for _, le := range skipped {
				fmt.Fprintf(cmd.ErrOrStderr(), "skipped: %v\n", &le)
			}
			if p := f.Arrival.Process; (p != workload.ArrivalPoisson && p != workload.ArrivalGamma) &&
				(f.Trace != "" || (p != "" && p != workload.ArrivalAuto)) {
				// Arrivals not drawn at --rate: label with the offered rate.
				cfg.Rate = benchOfferedRate(reqs, duration)
			}
			cfg.Workload = f.Spec.Name
			if f.Trace != "" {
				cfg.Workload = filepath.Base(f.Trace)
			}
			if outDir != "" {
				if err := os.MkdirAll(outDir, 0o755); err != nil {
					return fmt.Errorf("bench: %w", err)
				}
			}

			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			fmt.Fprintf(cmd.ErrOrStderr(), "bench: %s, %d requests → %s (%s)\n",
				f.Describe(), len(reqs), cfg.Target, cfg.Mode)
			out, runErr := loadgen.Run(ctx, cfg, reqs)
			if runErr != nil && !errors.Is(runErr, context.Canceled) {
				return fmt.Errorf("bench: %w", runErr)
			}
			// Interrupted runs still report what they measured.
			if err := benchWrite(cmd, out, jsonOut, outDir); err != nil {
				return err
			}
			if runErr != nil {
				return fmt.Errorf("bench: %w", runErr)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	f.AddFlags(fs)
	fs.StringVar(&cfg.Target, "target", "", "base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000 (required)")
	fs.StringVar(&mode, "mode", string(loadgen.ModeCompletions), "how prompts are sent: completions (token ids), text (words t<id>), chat (/v1/chat/completions)")
	fs.StringVar(&cfg.Model, "model", "", `model name to send (default: the first of GET /v1/models, else "default")`)
	fs.StringVar(&cfg.Policy, "label", cfg.Policy, `name of this run in the results' "policy" field (e.g. the router policy behind --target)`)
	fs.DurationVar(&duration, "duration", 0, "stop sending after this long (0: send every request of the workload)")
	fs.IntVar(&cfg.MaxInFlight, "max-inflight", cfg.MaxInFlight, "most requests outstanding at once; requests due beyond it wait and are counted as delayed")
	fs.DurationVar(&cfg.RequestTimeout, "timeout", cfg.RequestTimeout, "per-request timeout (0: none)")
	fs.BoolVar(&cfg.ProgressAlways, "progress", false, "write progress lines to stderr even when it is not a terminal")
	fs.StringArrayVar(&headers, "header", nil, `extra request header "Name: value" (repeatable), e.g. "Authorization: Bearer KEY"`)
	fs.StringVar(&jsonOut, "json", "", "write the results as JSON to FILE (- for stdout)")
	fs.StringVar(&outDir, "out", "", "write results.json, requests.csv, chart.svg and report.html to DIR")
	_ = cmd.MarkFlagRequired("target")
	return cmd
}

// benchRequests returns how many requests to generate so that the arrival
// process almost surely still has requests due at the end of d: the expected
// count λd plus four standard deviations of a Poisson count, plus 10.
func benchRequests(f *workload.Flags, d time.Duration) int {
	expected := f.Arrival.Rate * d.Seconds()
	if f.Arrival.Process == workload.ArrivalRamp && f.Ramp != "" {
		if stages, err := workload.ParseStages(f.Ramp); err == nil {
			expected = 0
			left := d
			for _, s := range stages {
				t := min(left, s.Duration)
				expected += s.Rate * t.Seconds()
				left -= t
			}
			if left > 0 {
				expected += stages[len(stages)-1].Rate * left.Seconds()
			}
		}
	}
	return int(math.Ceil(expected+4*math.Sqrt(expected))) + 10
}

// benchOfferedRate returns the requests per second reqs offer over their
// arrival span, cut at d when d > 0.
func benchOfferedRate(reqs []workload.Request, d time.Duration) float64 {
	n, last := 0, time.Duration(0)
	for _, r := range reqs {
		if d > 0 && r.Arrival >= d {
			continue
		}
		n++
		last = max(last, r.Arrival)
	}
	if d > 0 {
		last = d
	}
	if last <= 0 {
		return 0
	}
	return float64(n) / last.Seconds()
}

// benchHeaders parses "Name: value" header flags.
func benchHeaders(hs []string) (http.Header, error) {
	if len(hs) == 0 {
		return nil, nil
	}
	h := http.Header{}
	for _, s := range hs {
		k, v, ok := strings.Cut(s, ":")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, fmt.Errorf(`bench: --header %q: want "Name: value"`, s)
		}
		h.Add(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	return h, nil
}

// benchWrite prints the results table and writes the files asked for.
func benchWrite(cmd *cobra.Command, out loadgen.Output, jsonOut, outDir string) error {
	results := []report.Result{out.Result}
	stdout := cmd.OutOrStdout()
	if jsonOut == "-" {
		if err := report.WriteJSON(stdout, results); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	} else {
		fmt.Fprintf(stdout, "model %s, %s elapsed, %d delayed by --max-inflight\n",
			out.Model, out.Elapsed.Round(time.Millisecond), out.Result.Delayed)
		if err := report.WriteTable(stdout, results); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		if jsonOut != "" {
			if err := report.WriteJSONFile(jsonOut, results); err != nil {
				return fmt.Errorf("bench: %w", err)
			}
		}
	}
	if outDir == "" {
		return nil
	}
	if err := report.WriteJSONFile(filepath.Join(outDir, "results.json"), results); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := report.WriteCSVFile(filepath.Join(outDir, "requests.csv"), out.Records); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := report.WriteChartFile(filepath.Join(outDir, "chart.svg"), results); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := report.WriteHTMLFile(filepath.Join(outDir, "report.html"), results, out.Records); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}
