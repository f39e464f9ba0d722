package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// SetTokenizer makes the engine tokenize prompts and chats with tok
// through a prefix cache of its own.
func (c *Config) SetTokenizer(tok *tokenize.Tokenizer) {
	pc := tokenize.NewPrefixCache(tok, 0)
	c.Tokenizer = pc
	c.ChatEncoder = pc
}

// KVOptions are the --kv-* flags of `prefixlb engine`: where and how the
// engine publishes its KV events, as vLLM's --kv-events-config does.
type KVOptions struct {
	// Endpoint publishes the events (ZeroMQ PUB): with '*' it is bound,
	// else dialled (unless Bind); "": no events.
	Endpoint string
	// Replay is the replay ROUTER socket's endpoint, always bound ("":
	// Endpoint's port + 1).
	Replay string
	// Encoding is "array" (vLLM <= 0.23) or "map" (vLLM >= 0.26).
	Encoding string
	// Bind binds Endpoint even without '*'.
	Bind bool
	// Topic is the events' topic ("": kv@<listen>@<model>, as vLLM).
	Topic string
}

// PublisherConfig turns the options into a publisher config, with vLLM's
// defaults and its bind-or-dial rule; listen and model make the default
// topic.
func (o KVOptions) PublisherConfig(listen, model string, log *slog.Logger) (kvevents.PublisherConfig, error) {
	pc := kvevents.PublisherConfig{
		Endpoint:       o.Endpoint,
		Dial:           !strings.Contains(o.Endpoint, "*") && !o.Bind,
		ReplayEndpoint: o.Replay,
		Topic:          o.Topic,
		Logger:         log,
	}
	switch o.Encoding {
	case "array":
		pc.Encoding = kvevents.EncodingArray
	case "map":
		pc.Encoding = kvevents.EncodingMap
		pc.ReplayTopicFrame = true // vLLM 0.26 sends both
	default:
		return pc, fmt.Errorf("engine: --kv-encoding must be array or map, got %q", o.Encoding)
	}
	if pc.ReplayEndpoint == "" {
		ep, err := DefaultReplayEndpoint(o.Endpoint)
		if err != nil {
			return pc, fmt.Errorf("engine: --kv-events: %w", err)
		}
		pc.ReplayEndpoint = ep
	}
	if pc.Topic == "" {
		pc.Topic = DefaultKVTopic(listen, model)
	}
	if err := pc.Validate(); err != nil {
		return pc, fmt.Errorf("engine: %w", err)
	}
	return pc, nil
}

// ServeConfig is one engine served over HTTP: `prefixlb engine`.
type ServeConfig struct {
	// Engine configures the engine; its Replica.Profile, Logger, tokenizer
	// and KVPublisher are set from the fields below.
	Engine Config
	// Listen is the address to serve HTTP on.
	Listen string
	// Profile is the cost profile (costmodel.Resolve's spec).
	Profile string
	// Tokenizer is a real tokenizer (keying.LoadTokenizer's spec); "" or
	// "none": one token per word.
	Tokenizer string
	// KV publishes the KV events.
	KV KVOptions
	// ShutdownTimeout is how long requests in flight may finish once ctx
	// ends.
	ShutdownTimeout time.Duration
}

// The reasons Serve stops other than its context ending.
var (
	errEngineStopped = errors.New("engine stopped")
	errServerStopped = errors.New("server stopped")
)

// Serve builds the engine sc describes, serves it on sc.Listen until ctx is
// done (or the engine or the server fails), then shuts down gracefully: the
// requests in flight get sc.ShutdownTimeout to finish while the model still
// runs.
func Serve(ctx context.Context, sc ServeConfig, log *slog.Logger) error {
	cfg := sc.Engine
	if cfg.TimeScale <= 0 {
		return fmt.Errorf("engine: --time-scale must be positive, got %v", cfg.TimeScale)
	}
	prof, err := costmodel.Resolve(sc.Profile)
	if err != nil {
		return fmt.Errorf("engine: --profile: %w", err)
	}
	cfg.Replica.Profile = prof
	cfg.Logger = log
	if sc.Tokenizer != "" && sc.Tokenizer != "none" {
		tok, err := keying.LoadTokenizer(sc.Tokenizer)
		if err != nil {
			return fmt.Errorf("engine: --tokenizer: %w", err)
		}
		cfg.SetTokenizer(tok)
	}
	var pub *kvevents.Publisher
	if sc.KV.Endpoint != "" {
		pc, err := sc.KV.PublisherConfig(sc.Listen, cfg.Model, log)
		if err != nil {
			return err
		}
		pub = kvevents.NewPublisher(pc)
		cfg.KVPublisher = pub
		log.Info("publishing KV events", "endpoint", pc.Endpoint, "bind", !pc.Dial,
			"replay", pc.ReplayEndpoint, "topic", pc.Topic, "encoding", sc.KV.Encoding)
	} else if sc.KV.Replay != "" || sc.KV.Topic != "" {
		return errors.New("engine: --kv-replay and --kv-topic need --kv-events")
	}
	eng, err := New(cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", sc.Listen)
	if err != nil {
		return fmt.Errorf("engine: listen: %w", err)
	}
	st := eng.Stats()
	c := eng.Config()
	log.Info("engine serving", "addr", ln.Addr().String(), "model", c.Model, "profile", prof.Name(),
		"time_scale", c.TimeScale, "kv_blocks", st.TotalBlocks, "block_size", c.Replica.BlockSize,
		"local", c.Replica.Local, "max_model_len", c.MaxModelLen, "tokenizer", cmp.Or(sc.Tokenizer, "words"),
		"role", cmp.Or(c.Replica.Role, "both"), "engine_id", c.EngineID)
	return serve(ctx, eng, ln, sc.ShutdownTimeout, log)
}

// serve runs eng and serves its handler on ln until ctx is done or either
// stops, then shuts down: requests in flight get timeout to finish while
// the model still runs; past it, the model stops, their handlers get a
// moment to end their streams with an error event, and what is left is
// closed. The engine's error comes first, then the server's.
func serve(ctx context.Context, eng *Engine, ln net.Listener, timeout time.Duration, log *slog.Logger) error {
	engCtx, stopEngine := context.WithCancel(context.Background())
	defer stopEngine()
	// stop ends with ctx or as soon as the engine or the server stops; its
	// cause says which came first.
	stop, halt := context.WithCancelCause(ctx)
	defer halt(nil)

	srv := &http.Server{Handler: eng.Handler(), ReadHeaderTimeout: 10 * time.Second}
	var g errgroup.Group
	var runErr, serveErr error // each written by its goroutine before it ends
	engDone := make(chan struct{})
	g.Go(func() error {
		defer close(engDone)
		runErr = eng.Run(engCtx) // fails early if the KV-event sockets cannot be bound
		halt(errEngineStopped)
		return nil
	})
	g.Go(func() error {
		serveErr = srv.Serve(ln)
		halt(errServerStopped)
		return nil
	})

	<-stop.Done()
	serveFailed := false
	switch context.Cause(stop) {
	case errServerStopped:
		serveFailed = true
	case errEngineStopped:
	default:
		log.Info("engine shutting down", "timeout", timeout)
	}
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := srv.Shutdown(sctx)
	stopEngine()
	<-engDone
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("engine: shutdown timed out; requests in flight were stopped", "err", err)
		fctx, fcancel := context.WithTimeout(context.Background(), time.Second)
		_ = srv.Shutdown(fctx)
		fcancel()
	}
	_ = srv.Close()
	_ = g.Wait()
	if runErr != nil {
		return runErr
	}
	if serveErr != nil && (serveFailed || !errors.Is(serveErr, http.ErrServerClosed)) {
		return fmt.Errorf("engine: serve: %w", serveErr)
	}
	return nil
}
