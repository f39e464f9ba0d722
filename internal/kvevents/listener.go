package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/prefixlb/prefixlb/internal/zmtpguard"
)

// StateListening is the State of a replica's stream fed by a Listener: its
// engine dials the router's SUB socket, so there is no connection of ours
// to describe.
const StateListening = "listening"

// ListenerConfig configures a Listener. Zero durations and limits take the
// defaults documented on each field.
type ListenerConfig struct {
	// Endpoint is where the SUB socket binds: "tcp://0.0.0.0:5557",
	// "tcp://*:5557" (every interface, vLLM's spelling),
	// "tcp://127.0.0.1:0" (a free port; see Endpoint) or "ipc://PATH".
	// Required.
	Endpoint string
	// Topic is the subscription prefix ("" receives every topic).
	Topic string
	// Resolve names the replica a message's topic belongs to; ok false
	// drops the message (counted as unknown_topic). It is called on the
	// Run goroutine, with no lock of the Listener held. Required.
	Resolve func(topic string) (replica string, ok bool)
	// OnFirstBatch, when set, is called on the Run goroutine before the
	// first message of a replica's stream (after New or Forget) is
	// applied: serve and epp switch the replica from mirrored to
	// event-fed there.
	OnFirstBatch func(replica string)
	// Index receives the events. Required.
	Index *Index
	// Sink is told what changed; nil discards.
	Sink Sink
	// Metrics, nil for none.
	Metrics *Metrics
	// Logger, nil for none.
	Logger *slog.Logger
	// LogInterval bounds the logging of dropped messages: at most one
	// line per reason per interval, naming the last topic and how many
	// were dropped since. Default 10s.
	LogInterval time.Duration
	// HandshakeTimeout bounds each engine's ZMTP handshake, from TCP
	// accept to its READY. Default zmtpguard.DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// MaxFrameBytes and MaxMessageBytes bound one frame and one message
	// read from an engine; a larger one closes that engine's connection
	// (counted in Refused). Default 16 MiB each, as the Subscriber's.
	MaxFrameBytes, MaxMessageBytes int64
	// Now is the clock for lag and log rate limiting; nil is time.Now.
	Now func() time.Time
}

// Validate reports the first missing or invalid field.
func (c ListenerConfig) Validate() error {
	if err := CheckListenEndpoint(c.Endpoint); err != nil {
		return fmt.Errorf("kvevents: listener config: Endpoint: %w", err)
	}
	switch {
	case c.Resolve == nil:
		return errors.New("kvevents: listener config: Resolve is required")
	case c.Index == nil:
		return errors.New("kvevents: listener config: Index is required")
	case c.LogInterval < 0 || c.HandshakeTimeout < 0:
		return errors.New("kvevents: listener config: negative duration")
	case c.MaxFrameBytes < 0 || c.MaxMessageBytes < 0:
		return errors.New("kvevents: listener config: negative MaxFrameBytes or MaxMessageBytes")
	}
	return nil
}

func (c ListenerConfig) withDefaults() ListenerConfig {
	if c.Sink == nil {
		c.Sink = NopSink{}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.LogInterval == 0 {
		c.LogInterval = 10 * time.Second
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = zmtpguard.DefaultHandshakeTimeout
	}
	if c.MaxFrameBytes == 0 {
		c.MaxFrameBytes = zmtpguard.DefaultMaxFrameBytes
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = zmtpguard.DefaultMaxMessageBytes
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// CheckListenEndpoint reports whether ep is an endpoint a Listener can bind
// and an engine in another process dial: "tcp://HOST:PORT" (HOST "*" or
// 0.0.0.0 for every interface, PORT 0 for a free one) or "ipc://PATH".
func CheckListenEndpoint(ep string) error {
	tr, addr, ok := strings.Cut(ep, "://")
	if !ok || addr == "" {
		return fmt.Errorf("%q is not a ZeroMQ endpoint transport://address", ep)
	}
	switch tr {
	case "ipc":
		return nil
	case "tcp":
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			return fmt.Errorf("%q: want tcp://HOST:PORT: %w", ep, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			return fmt.Errorf("%q: port %q is not a number from 0 to 65535", ep, port)
		}
		return nil
	}
	return fmt.Errorf("%q: transport %q cannot be dialled by an engine in another process (want tcp or ipc)", ep, tr)
}

// ListenerStats is a snapshot of a Listener's own counts (the replicas'
// streams have their Stats).
type ListenerStats struct {
	// Endpoint is the bound address ("" before Run has bound it).
	Endpoint string `json:"endpoint"`
	// Messages counts the messages received, every topic.
	Messages uint64 `json:"messages"`
	// Dropped counts the messages that reached no replica's stream, by
	// reason: unknown_topic (the topic names no replica), bad_frame (not
	// three frames, or a seq frame not 8 bytes before the replica's first
	// batch; later, the replica's stream counts it), panic (a bug, logged with its stack).
	Dropped map[string]uint64 `json:"dropped"`
	// Refused counts engine connections the ZMTP guard closed, by reason.
	Refused map[string]uint64 `json:"refused"`
	// Replicas is the replicas that have a stream (a message arrived).
	Replicas int `json:"replicas"`
}

// Listener receives the KV events of engines that dial the router: it
// binds one SUB socket, which every engine's PUB connects to (vLLM's
// ZmqEventPublisher connects when its endpoint is not a wildcard bind;
// llm-d's deployments and llm-d-inference-sim's --zmq-endpoint
// tcp://router:5557 do this), and reads [topic, seq, payload] messages,
// the framing Subscriber reads. The topic says whose batch it is:
// Resolve maps it to a replica (llm-d's topic is "kv@<pod>@<model>",
// TopicPod).
//
// Each replica's batches are applied by its own stream, the code a
// Subscriber runs for a live message (seq order, duplicates skipped,
// restarts cleared, undecodable batches counted): what a Subscriber does
// for its replica without a replay socket. There is none here — the
// publisher dials us, and its replay ROUTER, when it has one, is not
// known — so a gap is counted (gaps, lost_batches) and not replayed, and
// an unknown parent is dropped without a resync.
//
// Every engine connection goes through the ZMTP guard
// (internal/zmtpguard): its listener runs each handshake concurrently
// under HandshakeTimeout and accepts only PUB and XPUB peers; a frame or
// message over the limits closes that engine's connection, counted in
// Refused (per listener, not per replica: the guard refuses before any
// topic is read). zmq4 reports a dropped engine connection as an error
// from Recv; the socket goes on receiving from the others.
type Listener struct {
	cfg   ListenerConfig
	ready chan struct{}

	mu       sync.Mutex // guards everything below
	streams  map[string]*Subscriber
	endpoint string
	stats    ListenerStats
	logged   map[string]time.Time // last log line per drop reason
	quiet    map[string]uint64    // drops per reason since that line

	// changed, when set (by tests), is called after each message is
	// handled and each refusal.
	changed func()
}

// NewListener returns a listener with cfg's zero fields defaulted; it binds
// nothing until Run, which validates cfg.
func NewListener(cfg ListenerConfig) *Listener {
	return &Listener{cfg: cfg.withDefaults(), ready: make(chan struct{}),
		streams: make(map[string]*Subscriber), logged: make(map[string]time.Time), quiet: make(map[string]uint64),
		stats: ListenerStats{Dropped: make(map[string]uint64), Refused: make(map[string]uint64)}}
}

// Ready is closed once Run has bound its socket (or failed to: then Run
// returns the error).
func (l *Listener) Ready() <-chan struct{} { return l.ready }

// Endpoint is the bound address engines dial, "tcp://127.0.0.1:port" with
// the real port for a wildcard or port-0 bind, once Ready.
func (l *Listener) Endpoint() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.endpoint
}

// Stats returns the listener's own counts.
func (l *Listener) Stats() ListenerStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.stats
	st.Endpoint = l.endpoint
	st.Dropped = maps.Clone(l.stats.Dropped)
	st.Refused = maps.Clone(l.stats.Refused)
	st.Replicas = len(l.streams)
	return st
}

// ReplicaStats returns replica's stream as Subscriber.Stats shows one
// (State StateListening); ok is false before its first message.
func (l *Listener) ReplicaStats(replica string) (Stats, bool) {
	l.mu.Lock()
	s, ok := l.streams[replica]
	l.mu.Unlock()
	if !ok {
		return Stats{}, false
	}
	return s.Stats(), true
}

// Forget drops replica's stream (it left the pool): a replica of that name
// starts a new stream, with OnFirstBatch, from its next message. Safe for
// concurrent use.
func (l *Listener) Forget(replica string) {
	l.mu.Lock()
	delete(l.streams, replica)
	l.mu.Unlock()
}

// Run binds the socket and applies what arrives until ctx ends. It returns
// nil when ctx ends, or an error for an invalid config or a failed bind.
func (l *Listener) Run(ctx context.Context) error {
	if err := l.cfg.Validate(); err != nil {
		close(l.ready)
		return err
	}
	c := zmtpguard.DefaultConfig()
	c.MaxFrameBytes, c.MaxMessageBytes = l.cfg.MaxFrameBytes, l.cfg.MaxMessageBytes
	c.HandshakeTimeout = l.cfg.HandshakeTimeout
	c.PeerTypes = []string{string(zmq4.Pub), string(zmq4.XPub)}
	c.OnRefuse = l.refused
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	gctx, err := zmtpguard.WithConfig(sctx, c)
	if err != nil {
		close(l.ready)
		return fmt.Errorf("kvevents: listener: %w", err)
	}
	sub := zmq4.NewSub(gctx, zmq4.WithLogger(quietLogger))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, l.cfg.Topic); err != nil {
		close(l.ready)
		return fmt.Errorf("kvevents: listener: subscribe: %w", err)
	}
	if err := sub.Listen(zmtpguard.Endpoint(l.cfg.Endpoint)); err != nil {
		close(l.ready)
		return fmt.Errorf("kvevents: listener: bind %s: %w", l.cfg.Endpoint, err)
	}
	ep := l.cfg.Endpoint
	if strings.HasPrefix(ep, "tcp://") {
		ep = boundEndpoint(ep, sub.Addr())
	}
	l.mu.Lock()
	l.endpoint = ep
	l.mu.Unlock()
	close(l.ready)
	l.cfg.Logger.Info("kvevents: listening for engines' KV events", "endpoint", l.cfg.Endpoint, "bound", ep, "topic", l.cfg.Topic)
	for {
		m, err := sub.Recv()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			// One engine's connection ended (EOF, or the guard closed
			// it): zmq4 drops it and reads on from the others.
			l.cfg.Logger.Debug("kvevents: listener: an engine connection ended", "err", err)
			continue
		}
		l.handle(ctx, m)
	}
}

// handle routes one message to its replica's stream. A panic in doing so
// (a bug: the resolver is the caller's, the decoder is fuzzed) drops the
// message, counted as panic and logged with its stack.
func (l *Listener) handle(ctx context.Context, m zmq4.Msg) {
	defer l.notify()
	topic := ""
	defer func() {
		if r := recover(); r != nil {
			l.cfg.Logger.Error("kvevents: listener: panic handling a message; message dropped", "topic", topic,
				"panic", r, "stack", string(debug.Stack()))
			l.drop("panic", topic)
		}
	}()
	l.mu.Lock()
	l.stats.Messages++
	l.mu.Unlock()
	if len(m.Frames) != 3 {
		l.drop("bad_frame", topic)
		return
	}
	topic = string(m.Frames[0])
	replica, ok := l.cfg.Resolve(topic)
	if !ok {
		l.drop("unknown_topic", topic)
		return
	}
	l.mu.Lock()
	s, ok := l.streams[replica]
	// A replica's stream starts with a well-formed message: garbage under
	// its topic must not switch it to events.
	fresh := !ok && len(m.Frames[1]) == 8
	if fresh {
		s = l.newStream(replica)
		l.streams[replica] = s
	}
	l.mu.Unlock()
	if !ok && !fresh {
		l.drop("bad_frame", topic)
		return
	}
	if fresh {
		// A new stream knows nothing of the replica: whatever the index
		// holds under its name is a forgotten predecessor's.
		l.cfg.Index.Forget(replica)
		if l.cfg.OnFirstBatch != nil {
			l.cfg.OnFirstBatch(replica)
		}
		l.cfg.Logger.Info("kvevents: listener: first message of a replica", "replica", replica, "topic", topic)
	}
	s.live(ctx, m)
}

// newStream is a Subscriber that is never Run: the listener hands it each
// of its replica's messages (Subscriber.live), with no replay socket.
func (l *Listener) newStream(replica string) *Subscriber {
	s := NewSubscriber(SubscriberConfig{Replica: replica, Endpoint: "listen:" + l.cfg.Endpoint,
		Index: l.cfg.Index, Sink: l.cfg.Sink, Metrics: l.cfg.Metrics, Logger: l.cfg.Logger, Now: l.cfg.Now,
		MaxFrameBytes: l.cfg.MaxFrameBytes, MaxMessageBytes: l.cfg.MaxMessageBytes})
	s.initMetrics()
	s.stats.State = StateListening
	return s
}

// drop counts a message that reached no stream and logs it, at most once
// per LogInterval per reason.
func (l *Listener) drop(reason, topic string) {
	now := l.cfg.Now()
	l.mu.Lock()
	l.stats.Dropped[reason]++
	l.quiet[reason]++
	n := l.quiet[reason]
	log := now.Sub(l.logged[reason]) >= l.cfg.LogInterval
	if log {
		l.logged[reason] = now
		l.quiet[reason] = 0
	}
	l.mu.Unlock()
	if m := l.cfg.Metrics; m != nil {
		m.listenDropped.WithLabelValues(reason).Inc()
	}
	if log {
		l.cfg.Logger.Warn("kvevents: listener dropped a message", "reason", reason, "topic", topic,
			"dropped_since_last_line", n)
	}
}

// refused counts an engine connection the guard closed; it runs on a zmq4
// or guard goroutine.
func (l *Listener) refused(e *zmtpguard.Error) {
	l.mu.Lock()
	l.stats.Refused[e.Reason]++
	l.mu.Unlock()
	if m := l.cfg.Metrics; m != nil {
		m.listenRefused.WithLabelValues(e.Reason).Inc()
	}
	l.notify()
}

func (l *Listener) notify() {
	if l.changed != nil {
		l.changed()
	}
}

// TopicPod returns the pod part of an llm-d topic "kv@<pod>@<model>" (the
// pod identifier is the engine's host:port in llm-d's deployments), or ""
// for a topic of another form. llm-d-kv-cache parses it the same way:
// pkg/kvevents/engineadapter/common.go, parseTopic, at commit
// 4c8e9ef9d8f00fd4690965b7d790f7b0c882d7f0 (strings.Split on "@", three
// parts). The model may itself hold "@": only the first two separate.
func TopicPod(topic string) string {
	parts := strings.SplitN(topic, "@", 3)
	if len(parts) != 3 || parts[1] == "" {
		return ""
	}
	return parts[1]
}
