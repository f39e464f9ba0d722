package workload

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/pflag"
)

// AddFlags registers the generator flags on fs, bound to s (set s to
// DefaultSpec first so the flags show the published defaults):
//
//	--workload NAME --requests N --seed S --workload-replicas N --output-tokens N
//	toolbench:     --tools --zipf --tool-tokens
//	agent:         --agent-envs --agent-steps-max --agent-output-tokens
//	programming:   --programming-prefix-tokens --programming-max-output
//	videoqa:       --videos --video-tokens-per-second --video-max-tokens
//	loogle:        --docs --doc-min-tokens --doc-max-tokens --loogle-max-output
//	coding-agent:  --repos --repo-min-tokens --repo-max-tokens --coding-sessions
//	rag:           --rag-system-tokens --rag-chunks --rag-chunk-tokens
//	shared-prefix: --groups --system-prompt-tokens --questions-per-group --question-tokens --shared-output-tokens
//	lora:          --lora-adapters --lora-zipf --lora-adapter-mb --lora-system-prompts --lora-system-max-tokens
//
// It does not register --replicas: the cluster size belongs to the command
// (sim's --replicas). Preble's "per 2 replicas" counts scale with
// --workload-replicas, which a command may set from its own --replicas when
// the user did not give it (see Flags.Resolve).
func (s *Spec) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&s.Name, "workload", s.Name, "workload generator: "+strings.Join(Names(), ", "))
	fs.IntVar(&s.Requests, "requests", s.Requests, "number of requests to generate")
	fs.Int64Var(&s.Seed, "seed", s.Seed, "random seed (same seed, same workload)")
	fs.IntVar(&s.Replicas, "workload-replicas", s.Replicas, `replicas the workload is sized for: Preble's "per 2 replicas" counts (tools, envs, videos, docs) scale by N/2`)
	fs.IntVar(&s.OutputTokens, "output-tokens", s.OutputTokens, "if > 0, every request generates exactly this many tokens")

	fs.IntVar(&s.ToolBench.Tools, "tools", s.ToolBench.Tools, "toolbench: tools per 2 replicas (Preble: 200)")
	fs.Float64Var(&s.ToolBench.Zipf, "zipf", s.ToolBench.Zipf, "toolbench: tool popularity Zipf exponent; 0 = even (Preble: 1.1 for Zipf)")
	fs.IntVar(&s.ToolBench.DescMedian, "tool-tokens", s.ToolBench.DescMedian, "toolbench: median tool-description tokens")

	fs.IntVar(&s.Agent.Environments, "agent-envs", s.Agent.Environments, "agent: environments per 2 replicas (Preble: 200)")
	fs.IntVar(&s.Agent.StepsMax, "agent-steps-max", s.Agent.StepsMax, "agent: most steps per session")
	fs.IntVar(&s.Agent.Output, "agent-output-tokens", s.Agent.Output, "agent: output tokens per step (Preble: 26)")

	fs.IntVar(&s.Programming.PrefixTokens, "programming-prefix-tokens", s.Programming.PrefixTokens, "programming: shared prefix tokens (Preble: 2400)")
	fs.IntVar(&s.Programming.OutputMax, "programming-max-output", s.Programming.OutputMax, "programming: most output tokens (Preble: 512)")

	fs.IntVar(&s.VideoQA.Videos, "videos", s.VideoQA.Videos, "videoqa: videos per 2 replicas (Preble: 150)")
	fs.IntVar(&s.VideoQA.TokensPerSecond, "video-tokens-per-second", s.VideoQA.TokensPerSecond, "videoqa: tokens per second of video (Preble: 256)")
	fs.IntVar(&s.VideoQA.MaxVideoTokens, "video-max-tokens", s.VideoQA.MaxVideoTokens, "videoqa: most tokens per video (Preble: 8192)")

	fs.IntVar(&s.LooGLE.Documents, "docs", s.LooGLE.Documents, "loogle: documents per 2 replicas (Preble: 24)")
	fs.IntVar(&s.LooGLE.DocMin, "doc-min-tokens", s.LooGLE.DocMin, "loogle: fewest document tokens")
	fs.IntVar(&s.LooGLE.DocMax, "doc-max-tokens", s.LooGLE.DocMax, "loogle: most document tokens")
	fs.IntVar(&s.LooGLE.OutputMax, "loogle-max-output", s.LooGLE.OutputMax, "loogle: most output tokens (Preble: 45)")

	fs.IntVar(&s.CodingAgent.Repos, "repos", s.CodingAgent.Repos, "coding-agent: repositories")
	fs.IntVar(&s.CodingAgent.PrefixMin, "repo-min-tokens", s.CodingAgent.PrefixMin, "coding-agent: fewest repository-prefix tokens")
	fs.IntVar(&s.CodingAgent.PrefixMax, "repo-max-tokens", s.CodingAgent.PrefixMax, "coding-agent: most repository-prefix tokens")
	fs.IntVar(&s.CodingAgent.Concurrent, "coding-sessions", s.CodingAgent.Concurrent, "coding-agent: sessions in progress at once")

	fs.IntVar(&s.RAG.SystemTokens, "rag-system-tokens", s.RAG.SystemTokens, "rag: shared system prompt tokens")
	fs.IntVar(&s.RAG.Chunks, "rag-chunks", s.RAG.Chunks, "rag: retrieved chunks per request")
	fs.IntVar(&s.RAG.ChunkTokens, "rag-chunk-tokens", s.RAG.ChunkTokens, "rag: tokens per chunk")

	fs.IntVar(&s.SharedPrefix.Groups, "groups", s.SharedPrefix.Groups, "shared-prefix: groups G (llm-d: 150)")
	fs.IntVar(&s.SharedPrefix.SystemTokens, "system-prompt-tokens", s.SharedPrefix.SystemTokens, "shared-prefix: system prompt tokens P (llm-d: 6000)")
	fs.IntVar(&s.SharedPrefix.Questions, "questions-per-group", s.SharedPrefix.Questions, "shared-prefix: questions per group U (llm-d: 5)")
	fs.IntVar(&s.SharedPrefix.QuestionTokens, "question-tokens", s.SharedPrefix.QuestionTokens, "shared-prefix: question tokens Q (llm-d: 1200)")
	fs.IntVar(&s.SharedPrefix.Output, "shared-output-tokens", s.SharedPrefix.Output, "shared-prefix: output tokens (llm-d: 1000)")

	fs.IntVar(&s.LoRA.Adapters, "lora-adapters", s.LoRA.Adapters, "lora: LoRA adapters N")
	fs.Float64Var(&s.LoRA.Zipf, "lora-zipf", s.LoRA.Zipf, "lora: adapter popularity Zipf exponent; 0 = even")
	fs.Float64Var(&s.LoRA.AdapterMB, "lora-adapter-mb", s.LoRA.AdapterMB, "lora: adapter size in MB (84: rank 16, all projections, Llama-3.1-8B, bf16)")
	fs.IntVar(&s.LoRA.SystemPrompts, "lora-system-prompts", s.LoRA.SystemPrompts, "lora: system prompts per adapter")
	fs.IntVar(&s.LoRA.SystemMax, "lora-system-max-tokens", s.LoRA.SystemMax, "lora: most system-prompt tokens")
}

// AddFlags registers the arrival flags on fs, bound to a:
//
//	--arrival auto|trace|poisson|gamma|ramp|azure --rate R --cv X
//	--ramp "3:60s,10:60s,..." --time-scale X
//
// A command that defines its own --rate (sim sweeps --rates) can skip this
// and fill a.Rate itself.
func (a *ArrivalSpec) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&a.Process, "arrival", a.Process, "arrival process: auto (trace timestamps, else poisson), trace, poisson, gamma, ramp, azure")
	fs.Float64Var(&a.Rate, "rate", a.Rate, "requests per second (poisson, gamma)")
	fs.Float64Var(&a.CV, "cv", a.CV, "gamma: coefficient of variation of inter-arrival gaps (1 = Poisson)")
	fs.Float64Var(&a.TimeScale, "time-scale", a.TimeScale, "divide trace timestamps by this (2 = replay twice as fast)")
}

// Flags bundles everything a command needs to turn flags into requests: a
// generator Spec or a trace, and an arrival process. Use it as
//
//	f := workload.DefaultFlags()
//	f.AddFlags(cmd.Flags())
//	...
//	reqs, skipped, err := f.Load()
type Flags struct {
	// Spec is the generator, used when Trace is empty.
	Spec Spec
	// Trace is a trace file to read instead of generating ("-" is stdin; a
	// name ending in .gz is gunzipped).
	Trace string
	// TraceFormat is mooncake, azure, jsonl, or "" / "auto" to detect it
	// (DetectTraceFormat).
	TraceFormat string
	// TraceOptions controls the reader.
	TraceOptions TraceOptions
	// Arrival is the arrival process applied after generation or reading.
	Arrival ArrivalSpec
	// Ramp is the ramp in flag form ("3:60s,10:60s"); Resolve parses it into
	// Arrival.Stages.
	Ramp string
	// ArrivalTrace is an Azure CSV whose timestamps the azure process
	// replays; Resolve reads it into Arrival.Timestamps.
	ArrivalTrace string
	// Dataset is a real-text dataset to replay instead of Spec or Trace
	// (Dataset.Name set); LoadDataset reads it.
	Dataset DatasetSpec
	// LoadDataset reads Dataset into requests (internal/dataset.Load; the
	// command wires it, as this package does not tokenize). Nil: a
	// command given --dataset fails with ErrNoDatasets.
	LoadDataset DatasetLoader
	// Priorities and Tenants give requests classes in flag form
	// ("high:0.2,low:0.8", "a:4,b:1"; ParseShares): Load draws each
	// session's (or lone request's) priority and tenant in those
	// proportions (AssignClasses).
	Priorities, Tenants string
}

// DefaultFlags returns the defaults: the toolbench workload with its
// published settings, auto arrivals at 10 requests/s, and the dataset
// defaults (DefaultDatasetSpec) should --dataset be given.
func DefaultFlags() Flags {
	return Flags{Spec: DefaultSpec("toolbench"), Arrival: DefaultArrival(), Dataset: DefaultDatasetSpec()}
}

// Dataset names (--dataset).
const (
	// DatasetShareGPT is ShareGPT's conversations, replayed turn by turn.
	DatasetShareGPT = "sharegpt"
	// DatasetLooGLE is LooGLE's long documents, each asked its questions.
	DatasetLooGLE = "loogle"
)

// DefaultMaxOutputTokens caps a dataset request's output (the recorded
// answer's length): 2048 tokens, the longest prompt + output vLLM's
// benchmarks keep of ShareGPT (is_valid_sequence's max_total_len,
// vllm/benchmarks/datasets/utils.py at 237145ea).
const DefaultMaxOutputTokens = 2048

// DefaultDatasetSessions is how many conversations a dataset replay keeps
// in progress at once, as the coding-agent workload's sessions (8).
const DefaultDatasetSessions = 8

// ErrNoDatasets is returned by Load for a dataset when Flags.LoadDataset
// is nil (a command that reads no datasets).
var ErrNoDatasets = errors.New("workload: this command reads no datasets")

// DatasetSpec names a real-text dataset and how to turn it into requests
// (internal/dataset).
type DatasetSpec struct {
	// Name is the dataset's format, DatasetShareGPT or DatasetLooGLE; "":
	// no dataset.
	Name string
	// File is the dataset file.
	File string
	// Tokenizer is the tokenizer its text is encoded with: qwen3 (the
	// bundled one), a tokenizer.json or a model directory; "": the
	// bundled Qwen3.
	Tokenizer string
	// Chat makes each request's Tokens those of its Messages rendered by
	// the tokenizer's chat template with the generation prompt (what a
	// chat-completions server prefills), else those of its Text.
	Chat bool
	// MaxOutputTokens caps each request's output, the length of the
	// answer the dataset records (> 0).
	MaxOutputTokens int
	// Sessions is how many conversations are in progress at once: a
	// conversation's next turn is taken from one of them at random, so
	// conversations overlap while each keeps its order (> 0).
	Sessions int
}

// DefaultDatasetSpec returns no dataset, with DefaultMaxOutputTokens and
// DefaultDatasetSessions.
func DefaultDatasetSpec() DatasetSpec {
	return DatasetSpec{MaxOutputTokens: DefaultMaxOutputTokens, Sessions: DefaultDatasetSessions}
}

// Validate reports the first invalid field of a dataset that is named.
func (d DatasetSpec) Validate() error {
	switch {
	case d.Name == "":
		return nil
	case d.Name != DatasetShareGPT && d.Name != DatasetLooGLE:
		return fmt.Errorf("workload: --dataset %q: want %s or %s", d.Name, DatasetShareGPT, DatasetLooGLE)
	case d.File == "":
		return fmt.Errorf("workload: --dataset %s needs its FILE", d.Name)
	case d.MaxOutputTokens < 1:
		return fmt.Errorf("workload: --max-output-tokens %d: want ≥ 1", d.MaxOutputTokens)
	case d.Sessions < 1:
		return fmt.Errorf("workload: --dataset-sessions %d: want ≥ 1", d.Sessions)
	}
	return nil
}

// DatasetLoader reads the dataset d names into requests in sending
// order, their arrivals not yet drawn. From s it takes Requests (the most
// to take; 0: all), OutputTokens (when > 0, every request's output) and
// Seed.
type DatasetLoader func(d DatasetSpec, s Spec) ([]Request, error)

// AddDatasetFlags registers the dataset flags on fs, bound to f.Dataset:
//
//	--dataset sharegpt|loogle --max-output-tokens N --dataset-sessions N
//
// The dataset's FILE is the command's one positional argument (the
// command sets Dataset.File), and its tokenizer the command's --tokenizer.
func (f *Flags) AddDatasetFlags(fs *pflag.FlagSet) {
	fs.StringVar(&f.Dataset.Name, "dataset", f.Dataset.Name, "replay a real-text dataset FILE (the one argument) instead of --workload or --trace: sharegpt (conversations turn by turn) or loogle (long documents, several questions each)")
	fs.IntVar(&f.Dataset.MaxOutputTokens, "max-output-tokens", f.Dataset.MaxOutputTokens, "--dataset: cap on each request's output tokens (the recorded answer's length)")
	fs.IntVar(&f.Dataset.Sessions, "dataset-sessions", f.Dataset.Sessions, "--dataset sharegpt: conversations in progress at once")
}

// AddFlags registers all workload, trace and arrival flags on fs: those of
// Spec.AddFlags and ArrivalSpec.AddFlags, and
//
//	--trace FILE --trace-format auto|mooncake|azure|jsonl --skip-malformed
//	--trace-block-tokens N --trace-shared-prefix N --trace-shared-groups N
//	--ramp STAGES --arrival-trace FILE
func (f *Flags) AddFlags(fs *pflag.FlagSet) {
	f.Spec.AddFlags(fs)
	f.Arrival.AddFlags(fs)
	f.addTraceFlags(fs)
	fs.StringVar(&f.Ramp, "ramp", f.Ramp, `ramp stages "rate:duration,..." for --arrival ramp, e.g. "3:60s,10:60s,60:60s"`)
	fs.StringVar(&f.ArrivalTrace, "arrival-trace", f.ArrivalTrace, "Azure CSV whose timestamps --arrival azure replays")
	fs.StringVar(&f.Priorities, "priorities", f.Priorities, `request priorities in proportions "PRIORITY:SHARE,...", PRIORITY an integer or high (1), normal (0), low (-1), e.g. "high:0.2,low:0.8" (drawn per session)`)
	fs.StringVar(&f.Tenants, "tenants", f.Tenants, `tenants in rate proportions "NAME:SHARE,...", e.g. "a:4,b:1" (drawn per session)`)
}

// AddTraceFlags registers only the trace flags (--trace, --trace-format,
// --skip-malformed, --trace-block-tokens, --trace-shared-prefix,
// --trace-shared-groups), for commands that read traces but generate nothing.
func (f *Flags) AddTraceFlags(fs *pflag.FlagSet) { f.addTraceFlags(fs) }

func (f *Flags) addTraceFlags(fs *pflag.FlagSet) {
	fs.StringVar(&f.Trace, "trace", f.Trace, "trace file to replay instead of --workload (.gz allowed, - for stdin)")
	fs.StringVar(&f.TraceFormat, "trace-format", f.TraceFormat, "trace format: mooncake, azure, jsonl (default: detect)")
	fs.BoolVar(&f.TraceOptions.SkipMalformed, "skip-malformed", f.TraceOptions.SkipMalformed, "skip malformed trace lines (reported) instead of failing")
	fs.IntVar(&f.TraceOptions.BlockTokens, "trace-block-tokens", f.TraceOptions.BlockTokens, "tokens per block id in mooncake hash_ids and jsonl blocks (default 512)")
	fs.IntVar(&f.TraceOptions.SharedPrefix, "trace-shared-prefix", f.TraceOptions.SharedPrefix, "azure: tokens of a shared system prompt at the start of each prompt (0 = no sharing)")
	fs.IntVar(&f.TraceOptions.SharedGroups, "trace-shared-groups", f.TraceOptions.SharedGroups, "azure: number of distinct shared system prompts")
}

// Resolve parses the flag-form fields (Ramp, ArrivalTrace) into Arrival and
// validates the choice. Load calls it.
func (f *Flags) Resolve() error {
	if f.Ramp != "" {
		st, err := ParseStages(f.Ramp)
		if err != nil {
			return err
		}
		f.Arrival.Stages = st
	}
	if f.Arrival.Process == ArrivalRamp && len(f.Arrival.Stages) == 0 {
		return fmt.Errorf("%w: --arrival ramp needs --ramp", ErrArrival)
	}
	if f.Arrival.Process == ArrivalTimestamps && len(f.Arrival.Timestamps) == 0 {
		if f.ArrivalTrace == "" {
			return fmt.Errorf("%w: --arrival azure needs --arrival-trace FILE (an Azure CSV)", ErrArrival)
		}
		reqs, _, err := readTraceFile(f.ArrivalTrace, FormatAzure, TraceOptions{SkipMalformed: f.TraceOptions.SkipMalformed, timesOnly: true})
		if err != nil {
			return err
		}
		f.Arrival.Timestamps = make([]time.Duration, len(reqs))
		for i, r := range reqs {
			f.Arrival.Timestamps[i] = r.Arrival
		}
	}
	if _, err := ParseShares(f.Priorities); err != nil {
		return fmt.Errorf("--priorities: %w", err)
	}
	if _, err := ParseShares(f.Tenants); err != nil {
		return fmt.Errorf("--tenants: %w", err)
	}
	if _, err := ParsePriorities(f.Priorities); err != nil {
		return fmt.Errorf("--priorities: %w", err)
	}
	if f.Dataset.Name != "" {
		return f.Dataset.Validate()
	}
	if f.Trace == "" {
		return f.Spec.Validate()
	}
	return nil
}

// Load returns the requests the flags describe: the dataset (read by
// LoadDataset), the trace (with the lines it skipped, if SkipMalformed) or
// the generated workload, with the arrival process applied (a dataset's
// auto arrivals are Poisson at Arrival.Rate) and IDs 0..n-1 in arrival
// order.
func (f *Flags) Load() ([]Request, []LineError, error) {
	if err := f.Resolve(); err != nil {
		return nil, nil, err
	}
	var (
		reqs []Request
		bad  []LineError
		err  error
	)
	switch {
	case f.Dataset.Name != "":
		if f.LoadDataset == nil {
			return nil, nil, ErrNoDatasets
		}
		reqs, err = f.LoadDataset(f.Dataset, f.Spec)
	case f.Trace != "":
		format := f.TraceFormat
		if format == "" || format == "auto" {
			format, err = detectFile(f.Trace)
			if err != nil {
				return nil, nil, err
			}
		}
		opts := f.TraceOptions
		opts.Seed = f.Spec.Seed
		reqs, bad, err = readTraceFile(f.Trace, format, opts)
	default:
		reqs, err = Generate(f.Spec)
	}
	if err != nil {
		return nil, bad, err
	}
	fromTrace := f.Trace != "" && f.Dataset.Name == ""
	if err := f.Arrival.Apply(reqs, f.Spec.Seed, fromTrace); err != nil {
		return nil, bad, err
	}
	if err := AssignClasses(reqs, f.Priorities, f.Tenants, f.Spec.Seed); err != nil {
		return nil, bad, err
	}
	return reqs, bad, nil
}

// Describe names the source of the requests, for reports.
func (f *Flags) Describe() string {
	if f.Dataset.Name != "" {
		return fmt.Sprintf("dataset %s %s", f.Dataset.Name, f.Dataset.File)
	}
	if f.Trace != "" {
		return "trace " + f.Trace
	}
	return fmt.Sprintf("workload %s (%d requests, seed %d)", f.Spec.Name, f.Spec.Requests, f.Spec.Seed)
}

// openTrace opens name ("-" is stdin), gunzipping a .gz file.
func openTrace(name string) (io.ReadCloser, error) {
	if name == "-" {
		return io.NopCloser(os.Stdin), nil
	}
	fh, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("workload: open trace: %w", err)
	}
	if !strings.HasSuffix(name, ".gz") {
		return fh, nil
	}
	zr, err := gzip.NewReader(fh)
	if err != nil {
		fh.Close()
		return nil, fmt.Errorf("workload: open trace %s: %w", name, err)
	}
	return struct {
		io.Reader
		io.Closer
	}{zr, fh}, nil
}

func readTraceFile(name, format string, opts TraceOptions) ([]Request, []LineError, error) {
	rc, err := openTrace(name)
	if err != nil {
		return nil, nil, err
	}
	defer rc.Close()
	return ReadTrace(rc, format, opts)
}

func detectFile(name string) (string, error) {
	if name == "-" {
		return "", errors.New("workload: give --trace-format when reading a trace from stdin")
	}
	rc, err := openTrace(name)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	head, _ := bufio.NewReader(rc).Peek(4096)
	return DetectTraceFormat(name, head), nil
}

// DetectTraceFormat guesses a trace's format from its file name and first
// bytes: a .csv name (before any .gz) or a TIMESTAMP header is azure, a first
// line with "hash_ids" is mooncake, anything else jsonl.
func DetectTraceFormat(name string, head []byte) string {
	base := strings.TrimSuffix(strings.ToLower(name), ".gz")
	line, _, _ := bytes.Cut(head, []byte("\n"))
	switch {
	case filepath.Ext(base) == ".csv", bytes.HasPrefix(bytes.ToUpper(bytes.TrimSpace(line)), []byte("TIMESTAMP")):
		return FormatAzure
	case bytes.Contains(line, []byte(`"hash_ids"`)):
		return FormatMooncake
	}
	return FormatJSONL
}
