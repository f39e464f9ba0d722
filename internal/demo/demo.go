// Package demo is `prefixlb demo`: a whole cluster on loopback in this
// process (N replicas and the router, `prefixlb serve`, over real HTTP, SSE
// and KV events), the same open-loop workload driven through each policy in
// turn with fresh replicas each time, and the comparison of the runs.
//
// The replicas are modelled GPUs (internal/engine, EngineModel) or real
// llama.cpp llama-server processes on this CPU (internal/llamacpp,
// EngineLlamaCpp), whose runs may repeat in rounds and are pooled per policy.
package demo

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/prompttext"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// The replicas a demo runs (Config.Engine).
const (
	// EngineModel: modelled GPUs, `prefixlb engine` (internal/engine).
	EngineModel = "model"
	// EngineLlamaCpp: llama.cpp llama-server processes (internal/llamacpp).
	EngineLlamaCpp = "llamacpp"
)

// Config is one demo: the flags of `prefixlb demo`.
type Config struct {
	// Workload is the workload every policy runs.
	Workload workload.Flags
	// Replicas is the number of replicas.
	Replicas int
	// PrefillReplicas makes the first PrefillReplicas of them prefill
	// replicas and the rest decode replicas (prefill/decode
	// disaggregation over vLLM's protocol, docs/pd.md); Policies must then
	// disaggregate (e2-pd, llmd-pd, dynamo-pd, round-robin-pd). 0: all
	// aggregated. The modelled engines only.
	PrefillReplicas int
	// Profile is the replicas' cost profile (name or YAML file); with
	// EngineLlamaCpp, the profile the router is told.
	Profile string
	// Policies are the comma-separated policies to compare, in order.
	Policies string
	// Speedup runs the modelled GPUs this many times faster (arrivals are
	// compressed alike; figures are reported in the modelled GPU's time).
	Speedup float64
	// JSONPath gets the comparison as JSON ("": none, "-": stdout).
	JSONPath string
	// Verbose logs the replicas' and the router's messages to stderr.
	Verbose bool
	// NoKVEvents: the replicas publish no KV events, and the router mirrors
	// their caches from its own decisions.
	NoKVEvents bool
	// Hold keeps the last policy's cluster up after the comparison, until
	// the context ends.
	Hold bool
	// Tokenizer is the replicas' and the router's tokenizer
	// (keying.LoadTokenizer's spec; "" or "none": one token per word and
	// text-chunk keys).
	Tokenizer string
	// Mode is how prompts are sent (loadgen.Mode).
	Mode string
	// Engine is EngineModel or EngineLlamaCpp.
	Engine string
	// LlamaCpp configures EngineLlamaCpp's servers.
	LlamaCpp LlamaCppConfig
	// Changed reports whether the user gave a flag (cobra's
	// FlagSet.Changed); nil: none given. With EngineLlamaCpp, flags not
	// given take CPU-sized defaults (LlamaCppDefaults).
	Changed func(name string) bool

	// text renders a prompt's ids in the text and chat modes (Run sets
	// it: textRenderer); engineTok is the modelled replicas' tokenizer
	// then, when Tokenizer names none (runModel sets it: Qwen3).
	text      func([]uint32) string
	engineTok *tokenize.Tokenizer
}

// Run runs the demo: each policy on a fresh cluster, progress on stderr,
// the comparison on stdout (and JSONPath).
func Run(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	if c.Replicas < 1 {
		return fmt.Errorf("--replicas must be ≥ 1, got %d", c.Replicas)
	}
	if m := loadgen.Mode(c.Mode); m == loadgen.ModeText || m == loadgen.ModeChat {
		text, err := textRenderer(c.Tokenizer)
		if err != nil {
			return err
		}
		c.text = text
	}
	switch c.Engine {
	case EngineModel:
		return runModel(ctx, c, stdout, stderr)
	case EngineLlamaCpp:
		return runLlamaCpp(ctx, c, stdout, stderr)
	default:
		return fmt.Errorf("--engine must be model or llamacpp, got %q", c.Engine)
	}
}

// textRenderer renders each workload token id as one whole-word token of
// the tokenizer spec names (the bundled Qwen3 for "" or "none"), so that a
// text or chat prompt is as many tokens as the workload says
// (prompttext): under that tokenizer, under the modelled engines' word
// tokenizer (one token a word), and under llama.cpp's with the Qwen3
// vocabulary of the demo's model.
func textRenderer(spec string) (func([]uint32) string, error) {
	var tok *tokenize.Tokenizer
	var err error
	if spec == "" || spec == keying.TokenizerNone || spec == keying.TokenizerAuto {
		tok, err = qwen3.Shared()
	} else {
		tok, err = keying.LoadTokenizer(spec)
	}
	if err != nil {
		return nil, fmt.Errorf("text prompts: tokenizer: %w", err)
	}
	r, err := prompttext.Shared(tok)
	if err != nil {
		return nil, fmt.Errorf("text prompts: %w", err)
	}
	return r.Render, nil
}

// newLogger logs to stderr when verbose, else nowhere.
func newLogger(verbose bool, stderr io.Writer) *slog.Logger {
	if verbose {
		return slog.New(slog.NewTextHandler(stderr, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// loadConfig is the load generator's config for one run of policy pol
// against target at rate, its progress on stderr when it is a terminal.
func loadConfig(c Config, target, pol string, rate float64, stderr io.Writer) loadgen.Config {
	lc := loadgen.DefaultConfig()
	lc.Target = target
	lc.Policy = pol
	lc.Mode = loadgen.Mode(c.Mode)
	lc.Text = c.text
	lc.Rate = rate
	lc.Workload = c.Workload.Describe()
	lc.Progress = stderr
	lc.ProgressAlways = false
	return lc
}

// writeJSON writes --json: nothing for "", stdout for "-", else a file.
func writeJSON(path string, stdout io.Writer, results []report.Result) error {
	switch path {
	case "":
		return nil
	case "-":
		return report.WriteJSON(stdout, results)
	default:
		return report.WriteJSONFile(path, results)
	}
}
