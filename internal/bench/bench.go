// Package bench is `prefixlb bench`: a generated workload or a trace
// (internal/workload) sent open-loop to an OpenAI-compatible endpoint by the
// load generator (internal/loadgen), and reported as a table, JSON and the
// --out files (internal/report).
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// Config is one benchmark run: the flags of `prefixlb bench`.
type Config struct {
	// Workload is the generated workload (Spec.Name) or the trace (Trace):
	// exactly one of them.
	Workload workload.Flags
	// Load configures the load generator: Target, Model, Policy (the
	// run's label), MaxInFlight, RequestTimeout, ProgressAlways. Run sets
	// Mode, MaxDuration, Rate, Progress, Header and Workload from the
	// fields below.
	Load loadgen.Config
	// Mode is how prompts are sent (loadgen.Mode).
	Mode string
	// Tokenizer renders text and chat prompts (modes text and chat):
	// "qwen3" for the bundled one, a tokenizer.json or a model directory
	// (keying.LoadTokenizer). "": the bundled Qwen3, checked against the
	// target's /tokenize, with a warning when it differs or cannot be
	// checked (setupText).
	Tokenizer string
	// Duration stops sending after it (0: send every request). When
	// RequestsGiven is false, enough requests are generated to fill it.
	Duration      time.Duration
	RequestsGiven bool
	// Headers are extra request headers, "Name: value" each.
	Headers []string
	// JSONPath gets the results as JSON ("": none; "-": stdout instead of
	// the table); OutDir gets results.json, requests.csv, chart.svg and
	// report.html.
	JSONPath string
	OutDir   string
	// SLO, when set, makes the run a live capacity measurement at this
	// objective (internal/capacity's syntax, e.g. "ttft_p90=2s"): each
	// stage of Workload.Ramp is one step at its rate (RunSLO).
	// SLOKeepGoing runs every stage even after one missed.
	SLO          string
	SLOKeepGoing bool
}

// Run loads the workload, sends it to c.Load.Target, and reports what it
// measured, also when ctx ends first (the error then says so). With c.SLO
// it measures the capacity at it over the ramp's stages instead (RunSLO).
func Run(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	dataset := c.Workload.Dataset.Name != ""
	if c.SLO != "" {
		if dataset {
			return errors.New("bench: --slo does not take --dataset")
		}
		return RunSLO(ctx, c, stdout, stderr)
	}
	f, cfg := c.Workload, c.Load
	if n := btoi(f.Trace != "") + btoi(f.Spec.Name != "") + btoi(dataset); n != 1 {
		return errors.New("bench: give exactly one of --workload NAME, --trace FILE or --dataset NAME FILE")
	}
	if c.Duration < 0 {
		return fmt.Errorf("bench: --duration %v: want ≥ 0", c.Duration)
	}
	if f.Trace == "" && c.Duration > 0 && !c.RequestsGiven {
		f.Spec.Requests = Requests(&f, c.Duration)
	} else if dataset && !c.RequestsGiven {
		f.Spec.Requests = 0 // the whole dataset
	}
	cfg.Mode = loadgen.Mode(c.Mode)
	cfg.MaxDuration = c.Duration
	cfg.Rate = f.Arrival.Rate
	cfg.Progress = stderr
	h, err := ParseHeaders(c.Headers)
	if err != nil {
		return err
	}
	cfg.Header = h
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	var text *textSetup
	if dataset {
		// A dataset is tokenized with the tokenizer in force, which must
		// be known before it is read.
		if text, err = c.text(ctx, cfg, true, stderr); err != nil {
			return err
		}
		f.Dataset.Tokenizer = c.Tokenizer
		f.Dataset.Chat = cfg.Mode == loadgen.ModeChat
	}
	reqs, skipped, err := f.Load()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	for _, le := range skipped {
		fmt.Fprintf(stderr, "skipped: %v\n", &le)
	}
	if p := f.Arrival.Process; (p != workload.ArrivalPoisson && p != workload.ArrivalGamma) &&
		(f.Trace != "" || (p != "" && p != workload.ArrivalAuto)) {
		// Arrivals not drawn at --rate: label with the offered rate.
		cfg.Rate = OfferedRate(reqs, c.Duration)
	}
	cfg.Workload = f.Spec.Name
	switch {
	case dataset:
		cfg.Workload = f.Dataset.Name
	case f.Trace != "":
		cfg.Workload = filepath.Base(f.Trace)
	}
	if c.OutDir != "" {
		if err := os.MkdirAll(c.OutDir, 0o755); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	}
	fmt.Fprintf(stderr, "bench: %s, %d requests → %s (%s)\n",
		f.Describe(), len(reqs), cfg.Target, cfg.Mode)
	if !dataset {
		if text, err = c.text(ctx, cfg, false, stderr); err != nil {
			return err
		}
	}
	out, runErr := loadgen.Run(ctx, text.apply(cfg), reqs)
	if runErr != nil && !errors.Is(runErr, context.Canceled) {
		return fmt.Errorf("bench: %w", runErr)
	}
	text.annotate(&out.Result)
	checkSizes(out.Result, stderr)
	// Interrupted runs still report what they measured.
	if err := Write(stdout, out, c.JSONPath, c.OutDir); err != nil {
		return err
	}
	if runErr != nil {
		return fmt.Errorf("bench: %w", runErr)
	}
	return nil
}

// text sets up the rendering of text and chat prompts (setupText) and
// writes its header line to stderr; nil in completions mode, which sends
// token ids, unless the run replays a dataset, which is tokenized with the
// tokenizer in force in every mode.
func (c Config) text(ctx context.Context, cfg loadgen.Config, dataset bool, stderr io.Writer) (*textSetup, error) {
	if !dataset && cfg.Mode != loadgen.ModeText && cfg.Mode != loadgen.ModeChat {
		if c.Tokenizer != "" {
			fmt.Fprintf(stderr, "bench: --tokenizer %s is not used: --mode %s sends token ids\n", c.Tokenizer, cfg.Mode)
		}
		return nil, nil
	}
	t, err := setupText(ctx, c.Tokenizer, cfg.Mode, cfg.Target, cfg.Header, stderr)
	if err != nil {
		return nil, err
	}
	if dataset {
		// The dataset's own text is sent, and in chat mode its token
		// counts already hold the chat template's tokens.
		t.dataset, t.hasTemplate, t.template = true, false, 0
	}
	fmt.Fprintln(stderr, t.header(cfg.Mode))
	return t, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Requests returns how many requests to generate so that the arrival
// process almost surely still has requests due at the end of d: the expected
// count λd plus four standard deviations of a Poisson count, plus 10.
func Requests(f *workload.Flags, d time.Duration) int {
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

// OfferedRate returns the requests per second reqs offer over their
// arrival span, cut at d when d > 0.
func OfferedRate(reqs []workload.Request, d time.Duration) float64 {
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

// ParseHeaders parses "Name: value" header flags (none: nil).
func ParseHeaders(hs []string) (http.Header, error) {
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

// Write prints the results table to stdout (or the JSON, for jsonPath "-")
// and writes the files asked for: jsonPath, and outDir's results.json,
// requests.csv, chart.svg and report.html.
// fmtMs formats milliseconds for the P/D line.
func fmtMs(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// writeErrorClasses lists each class of failure with its count and its
// first message, most frequent first.
func writeErrorClasses(w io.Writer, classes map[string]report.ErrorClassCount) {
	for _, e := range report.SortedErrorClasses(classes) {
		fmt.Fprintf(w, "%6d × %s\n", e.Count, e.Example)
	}
}

func Write(stdout io.Writer, out loadgen.Output, jsonPath, outDir string) error {
	results := []report.Result{out.Result}
	if jsonPath == "-" {
		if err := report.WriteJSON(stdout, results); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	} else {
		fmt.Fprintf(stdout, "model %s, %s elapsed, %d delayed by --max-inflight\n",
			out.Model, out.Elapsed.Round(time.Millisecond), out.Result.Delayed)
		if err := report.WriteTable(stdout, results); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		writeErrorClasses(stdout, out.Result.ErrorClasses)
		if pd := out.Result.PD; pd != nil {
			fmt.Fprintf(stdout, "P/D: %d disaggregated (prefill replicas %v), %d local; TTFT p50/p99 ms %s/%s disaggregated, %s/%s local\n",
				pd.Disaggregated, pd.ByPrefill, pd.Local, fmtMs(pd.TTFTDisaggregated.P50), fmtMs(pd.TTFTDisaggregated.P99),
				fmtMs(pd.TTFTLocal.P50), fmtMs(pd.TTFTLocal.P99))
		}
		if jsonPath != "" {
			if err := report.WriteJSONFile(jsonPath, results); err != nil {
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
