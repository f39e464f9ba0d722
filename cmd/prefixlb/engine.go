package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

func init() { rootCmd.AddCommand(engineCmd()) }

// engineOptions are the flags of `prefixlb engine`.
type engineOptions struct {
	listen          string
	profile         string
	kvEvents        string
	kvReplay        string
	kvEncoding      string
	kvBind          bool
	kvTopic         string
	tokenizer       string
	shutdownTimeout time.Duration
	verbose         bool
}

// engineCmd is `prefixlb engine`: one modelled replica (package engine)
// served over HTTP until SIGINT or SIGTERM.
func engineCmd() *cobra.Command {
	o := &engineOptions{}
	cfg := engine.DefaultConfig()
	cmd := &cobra.Command{
		Use:   "engine --listen ADDR --profile NAME [--kv-events tcp://*:5557] [--time-scale X]",
		Short: "Serve a modelled GPU replica behind vLLM's HTTP API",
		Long: `engine serves one modelled GPU replica (continuous batching, chunked prefill,
a KV cache with prefix caching and LRU eviction) behind vLLM's OpenAI-compatible
API, in real time: /v1/completions and /v1/chat/completions (streamed or not,
with usage.prompt_tokens_details.cached_tokens), /v1/models, /health, /tokenize
and /metrics with vLLM's metric names. Put several behind 'prefixlb serve' to try
a router without GPUs.

Every request generates exactly max_tokens tokens (as with ignore_eos) of
deterministic text: the same request always gets the same answer. Text prompts
are tokenized one token per word, unless --tokenizer names a real tokenizer
(qwen3, bundled; a tokenizer.json; or a model directory): then prompts are
tokenized, and chats rendered with its chat template, exactly as vLLM does, in
/v1/* and /tokenize alike. --time-scale X runs the model X times faster
than the profile says; latencies in /metrics are real (scaled) time.

--kv-events ENDPOINT publishes the KV cache's changes as vLLM's KV events
(ZeroMQ PUB, [topic, seq, msgpack batch]; docs/kv-events.md): like vLLM, an
endpoint with '*' (tcp://*:5557) is bound, any other is dialled (for a router
that binds one SUB). The replay ROUTER socket (--kv-replay, default the events
port + 1) is always bound.`,
		Example: `  prefixlb engine --listen 127.0.0.1:8001 --profile llama3.1-8b-h100
  prefixlb engine --listen :8000 --profile mistral-7b-a6000 --time-scale 10 --local lpm
  prefixlb engine --listen 127.0.0.1:8001 --kv-events 'tcp://*:5557'   # replay on tcp://*:5558`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			level := slog.LevelInfo
			if o.verbose {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
			return runEngine(ctx, o, cfg, log)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8000", "address to serve HTTP on")
	fs.StringVar(&o.profile, "profile", costmodel.Llama31_8BH100, "cost profile name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file")
	fs.StringVar(&cfg.Model, "model", cfg.Model, "model name served in /v1/models and responses")
	fs.BoolVar(&cfg.StrictModel, "strict-model", false, "answer 404 to requests naming another model (as vLLM does)")
	fs.Float64Var(&cfg.TimeScale, "time-scale", 1, "run the model this many times faster than real time")
	fs.IntVar(&cfg.Replica.BlockSize, "block-size", cfg.Replica.BlockSize, "KV block size in tokens")
	fs.IntVar(&cfg.Replica.KVCapacity, "kv-capacity", 0, "KV cache size in tokens (0: the profile's)")
	fs.IntVar(&cfg.Replica.ChunkBudget, "chunk-budget", cfg.Replica.ChunkBudget, "prefill token budget per iteration, decodes included: vLLM's max_num_batched_tokens (0: the profile's engine default, e.g. 8192 on an H100; -1: no chunked prefill)")
	fs.IntVar(&cfg.Replica.MaxRunning, "max-running", cfg.Replica.MaxRunning, "most requests running at once: vLLM's max_num_seqs (0: the profile's engine default)")
	fs.StringVar(&cfg.Replica.Local, "local", cfg.Replica.Local, "local scheduler: fcfs, lpm, priority")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", cfg.MaxModelLen, "most prompt plus output tokens per request")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body accepted")
	fs.IntVar(&cfg.DefaultMaxTokens, "default-max-tokens", cfg.DefaultMaxTokens, "output tokens of a request without max_tokens")
	fs.StringVar(&o.kvEvents, "kv-events", "", "publish KV-cache events on this ZMQ endpoint: tcp://*:PORT binds, tcp://HOST:PORT dials")
	fs.StringVar(&o.kvReplay, "kv-replay", "", "ZMQ endpoint of the KV-event replay socket, always bound (default: --kv-events with port+1)")
	fs.BoolVar(&o.kvBind, "kv-bind", false, "bind --kv-events even without * (e.g. tcp://127.0.0.1:5557: loopback only)")
	fs.StringVar(&o.kvEncoding, "kv-encoding", "array", "KV-event encoding: array (vLLM <= 0.23) or map (vLLM >= 0.26)")
	fs.StringVar(&o.kvTopic, "kv-topic", "", "KV-event topic (default kv@<listen>@<model>, as vLLM)")
	fs.StringVar(&o.tokenizer, "tokenizer", "", "real tokenizer: qwen3 (bundled), a tokenizer.json or a model directory (default: one token per word)")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 10*time.Second, "how long to let requests in flight finish on SIGINT/SIGTERM")
	fs.BoolVarP(&o.verbose, "verbose", "v", false, "debug logging")
	return cmd
}

// kvPublisherConfig turns the --kv-* flags into a publisher config, with
// vLLM's defaults and its bind-or-dial rule.
func kvPublisherConfig(o *engineOptions, model string, log *slog.Logger) (kvevents.PublisherConfig, error) {
	pc := kvevents.PublisherConfig{
		Endpoint:       o.kvEvents,
		Dial:           !strings.Contains(o.kvEvents, "*") && !o.kvBind,
		ReplayEndpoint: o.kvReplay,
		Topic:          o.kvTopic,
		Logger:         log,
	}
	switch o.kvEncoding {
	case "array":
		pc.Encoding = kvevents.EncodingArray
	case "map":
		pc.Encoding = kvevents.EncodingMap
		pc.ReplayTopicFrame = true // vLLM 0.26 sends both
	default:
		return pc, fmt.Errorf("engine: --kv-encoding must be array or map, got %q", o.kvEncoding)
	}
	if pc.ReplayEndpoint == "" {
		ep, err := engine.DefaultReplayEndpoint(o.kvEvents)
		if err != nil {
			return pc, fmt.Errorf("engine: --kv-events: %w", err)
		}
		pc.ReplayEndpoint = ep
	}
	if pc.Topic == "" {
		pc.Topic = engine.DefaultKVTopic(o.listen, model)
	}
	if err := pc.Validate(); err != nil {
		return pc, fmt.Errorf("engine: %w", err)
	}
	return pc, nil
}

// setEngineTokenizer makes the engine tokenize prompts and chats with tok
// through a prefix cache of its own.
func setEngineTokenizer(cfg *engine.Config, tok *tokenize.Tokenizer) {
	c := tokenize.NewPrefixCache(tok, 0)
	cfg.Tokenizer = c
	cfg.ChatEncoder = c
}

// runEngine serves one engine until ctx is done, then shuts down gracefully.
func runEngine(ctx context.Context, o *engineOptions, cfg engine.Config, log *slog.Logger) error {
	if cfg.TimeScale <= 0 {
		return fmt.Errorf("engine: --time-scale must be positive, got %v", cfg.TimeScale)
	}
	prof, err := costmodel.Resolve(o.profile)
	if err != nil {
		return fmt.Errorf("engine: --profile: %w", err)
	}
	cfg.Replica.Profile = prof
	cfg.Logger = log
	if o.tokenizer != "" && o.tokenizer != "none" {
		tok, err := keying.LoadTokenizer(o.tokenizer)
		if err != nil {
			return fmt.Errorf("engine: --tokenizer: %w", err)
		}
		setEngineTokenizer(&cfg, tok)
	}
	var pub *kvevents.Publisher
	if o.kvEvents != "" {
		pc, err := kvPublisherConfig(o, cfg.Model, log)
		if err != nil {
			return err
		}
		pub = kvevents.NewPublisher(pc)
		cfg.KVPublisher = pub
		log.Info("publishing KV events", "endpoint", pc.Endpoint, "bind", !pc.Dial,
			"replay", pc.ReplayEndpoint, "topic", pc.Topic, "encoding", o.kvEncoding)
	} else if o.kvReplay != "" || o.kvTopic != "" {
		return errors.New("engine: --kv-replay and --kv-topic need --kv-events")
	}
	eng, err := engine.New(cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("engine: listen: %w", err)
	}
	st := eng.Stats()
	c := eng.Config()
	log.Info("engine serving", "addr", ln.Addr().String(), "model", c.Model, "profile", prof.Name(),
		"time_scale", c.TimeScale, "kv_blocks", st.TotalBlocks, "block_size", c.Replica.BlockSize,
		"local", c.Replica.Local, "max_model_len", c.MaxModelLen, "tokenizer", cmp.Or(o.tokenizer, "words"))

	engCtx, stopEngine := context.WithCancel(context.Background())
	defer stopEngine()
	engDone := make(chan error, 1)
	go func() { engDone <- eng.Run(engCtx) }()

	srv := &http.Server{Handler: eng.Handler(), ReadHeaderTimeout: 10 * time.Second}
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Serve(ln) }()

	var serveErr, runErr error
	ranOut := false
	select {
	case <-ctx.Done():
		log.Info("engine shutting down", "timeout", o.shutdownTimeout)
	case serveErr = <-srvDone:
		serveErr = fmt.Errorf("engine: serve: %w", serveErr)
	case runErr = <-engDone: // the KV-event sockets could not be bound
		ranOut = true
	}
	// Let requests in flight finish while the model still runs; past the
	// timeout, stop the model, give their handlers a moment to end their
	// streams with an error event, and close what is left.
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	err = srv.Shutdown(sctx)
	stopEngine()
	if !ranOut {
		runErr = <-engDone
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("engine: shutdown timed out; requests in flight were stopped", "err", err)
		fctx, fcancel := context.WithTimeout(context.Background(), time.Second)
		_ = srv.Shutdown(fctx)
		fcancel()
	}
	_ = srv.Close()
	if runErr != nil {
		return runErr
	}
	if serveErr == nil {
		if err := <-srvDone; err != nil && !errors.Is(err, http.ErrServerClosed) {
			serveErr = fmt.Errorf("engine: serve: %w", err)
		}
	}
	return serveErr
}
