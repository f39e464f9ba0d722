package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/prefixlb/prefixlb/internal/zmtpguard"
)

// endSeq is the replay terminator: seq −1, all bits set (vLLM's END_SEQ).
const endSeq = math.MaxUint64

// SubscriberConfig configures one replica's Subscriber. Zero durations take
// the defaults documented on each field.
type SubscriberConfig struct {
	// Replica names the replica in Sink calls, Stats and metrics. Required.
	Replica string
	// Endpoint is the replica's PUB socket, dialled: "tcp://host:5557".
	// Required.
	Endpoint string
	// ReplayEndpoint is the replica's ROUTER socket: "tcp://host:5558". Empty:
	// no replay; a gap is counted as lost batches.
	ReplayEndpoint string
	// Topic is the subscription prefix ("" receives every topic). vLLM's topic
	// is "kv@<host:port>@<model>" when configured.
	Topic string
	// Index receives the events. Required.
	Index *Index
	// Sink is told what changed; nil discards.
	Sink Sink
	// Metrics, nil for none.
	Metrics *Metrics
	// Logger, nil for none.
	Logger *slog.Logger
	// ReplayTimeout bounds the wait for each replay reply; default 5s.
	ReplayTimeout time.Duration
	// PollInterval: after this long without a live message, ask the replay
	// socket for anything newer. It covers a subscription that reached the
	// publisher after its last message (ZeroMQ's slow joiner) and a restarted
	// publisher that has published nothing yet. Default 5s; negative disables.
	PollInterval time.Duration
	// MinBackoff and MaxBackoff bound the wait before re-dialling after a
	// socket error or EOF; defaults 50ms and 2s, doubling between.
	MinBackoff, MaxBackoff time.Duration
	// HandshakeTimeout bounds the ZMTP handshake of the SUB and the replay
	// DEALER, from TCP connect to the publisher's READY; a publisher that
	// accepts and never greets is dropped and re-dialled. Default 5s
	// (zmtpguard.DefaultHandshakeTimeout). After the handshake there is no
	// read deadline: an idle engine publishes nothing.
	HandshakeTimeout time.Duration
	// MaxFrameBytes and MaxMessageBytes bound one frame and one message
	// (its frames together) read from the publisher; a larger one closes
	// the connection (counted in Stats.Refused) before anything is
	// allocated for it. Default 16 MiB each (zmtpguard.DefaultMaxFrameBytes
	// says why).
	MaxFrameBytes, MaxMessageBytes int64
	// Now is the clock for lag; nil is time.Now.
	Now func() time.Time
}

// Validate reports the first missing or invalid field.
func (c SubscriberConfig) Validate() error {
	switch {
	case c.Replica == "":
		return errors.New("kvevents: subscriber config: Replica is required")
	case c.Endpoint == "":
		return fmt.Errorf("kvevents: subscriber config for %s: Endpoint is required", c.Replica)
	case !strings.Contains(c.Endpoint, "://"):
		return fmt.Errorf("kvevents: subscriber config for %s: Endpoint %q is not transport://address", c.Replica, c.Endpoint)
	case c.ReplayEndpoint != "" && !strings.Contains(c.ReplayEndpoint, "://"):
		return fmt.Errorf("kvevents: subscriber config for %s: ReplayEndpoint %q is not transport://address", c.Replica, c.ReplayEndpoint)
	case c.Index == nil:
		return fmt.Errorf("kvevents: subscriber config for %s: Index is required", c.Replica)
	case c.MinBackoff < 0 || c.MaxBackoff < 0 || c.ReplayTimeout < 0 || c.HandshakeTimeout < 0:
		return fmt.Errorf("kvevents: subscriber config for %s: negative duration", c.Replica)
	case c.MaxFrameBytes < 0 || c.MaxMessageBytes < 0:
		return fmt.Errorf("kvevents: subscriber config for %s: negative MaxFrameBytes or MaxMessageBytes", c.Replica)
	}
	return nil
}

func (c SubscriberConfig) withDefaults() SubscriberConfig {
	if c.Sink == nil {
		c.Sink = NopSink{}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.ReplayTimeout == 0 {
		c.ReplayTimeout = 5 * time.Second
	}
	if c.PollInterval == 0 {
		c.PollInterval = 5 * time.Second
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = 50 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 2 * time.Second
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = c.MinBackoff
	}
	if c.Now == nil {
		c.Now = time.Now
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
	return c
}

// The states of a Subscriber's connection (Stats.State).
const (
	StateStopped     = "stopped"     // Run is not running
	StateDialing     = "dialing"     // connecting TCP to Endpoint
	StateHandshaking = "handshaking" // TCP is up, waiting for the publisher's ZMTP READY
	StateConnected   = "connected"   // subscribed, reading
	StateBackoff     = "backoff"     // waiting to re-dial after an error (LastError)
)

var states = []string{StateStopped, StateDialing, StateHandshaking, StateConnected, StateBackoff}

// Stats is a snapshot of one subscriber, as GET /debug/cache shows it.
type Stats struct {
	Replica string `json:"replica"`
	// Connected is State == StateConnected.
	Connected bool `json:"connected"`
	// State is one of the State constants.
	State string `json:"state"`
	// LastError is the error that ended the last connection, "" before
	// the first.
	LastError string `json:"last_error,omitempty"`
	// Refused counts connections to the publisher (SUB or replay DEALER)
	// that the ZMTP guard closed, by zmtpguard reason: handshake_timeout,
	// frame_too_large, message_too_large, too_many_frames, bad_greeting,
	// bad_handshake, bad_framing, write_timeout.
	Refused map[string]uint64 `json:"refused"`
	// LastSeq is the seq of the last applied batch, −1 before the first.
	LastSeq int64 `json:"last_seq"`
	// Blocks is the engine blocks held, by medium.
	Blocks map[string]int `json:"blocks"`
	// Applied counts events applied, by type.
	Applied map[string]uint64 `json:"applied"`
	// Dropped counts what was not applied, by reason: unknown_type,
	// unknown_parent, malformed_event, unknown_block (a removed hash not
	// held), decode_error (a whole batch), bad_frame (a message that is not
	// [topic, seq, payload]), panic (a batch whose handling panicked: a
	// bug, logged with its stack).
	Dropped      map[string]uint64 `json:"dropped"`
	Batches      uint64            `json:"batches"`
	Replays      uint64            `json:"replays"`
	ReplayErrors uint64            `json:"replay_errors"`
	Gaps         uint64            `json:"gaps"`
	LostBatches  uint64            `json:"lost_batches"`
	Restarts     uint64            `json:"restarts"`
	Redials      uint64            `json:"redials"`
	// LagSeconds is the time of applying minus the batch's ts, last batch.
	LagSeconds float64 `json:"lag_seconds"`
}

// Subscriber follows one replica's KV-event stream (vLLM's ZmqEventPublisher)
// and applies it, in seq order, to an Index:
//
//   - it dials a SUB to Endpoint, subscribed to Topic, and reads
//     [topic, seq, payload] messages;
//   - on connecting, and after PollInterval without traffic, it replays from
//     its last applied seq to catch up;
//   - a gap (seq > last+1) is replayed from last+1 over a DEALER to
//     ReplayEndpoint: ["", start] out, ["", seq, payload] or
//     ["", topic, seq, payload] back until seq −1;
//   - a seq at or below the last live seq, or a replay that no longer has
//     the last applied seq nor anything newer, means the publisher restarted:
//     the replica is cleared and replayed from 0;
//   - a BlockStored with an unknown parent clears the replica and replays
//     from 0 once; after that (or if history was lost again) it is dropped;
//   - a socket error or EOF closes the SUB, which go-zeromq/zmq4 does not
//     recover by itself, and dials a new one with backoff.
type Subscriber struct {
	cfg SubscriberConfig

	// Stream state, owned by the Run goroutine.
	next      uint64 // next seq to apply
	lastLive  uint64 // last seq seen live
	haveLive  bool
	resyncOK  bool // an unknown parent may still trigger a full resync
	resyncing bool // inside a resync's replay from 0
	wantSync  bool // an unknown parent asked for a resync
	media     map[string]bool

	mu    sync.Mutex // guards stats
	stats Stats

	// changed, when set (by tests), is called after every change to the
	// stats or the index: on the Run goroutine, or for a refused
	// connection on the goroutine that saw it.
	changed func()
	// applyHook, when set (by tests), is called before each batch is
	// decoded.
	applyHook func(seq uint64, payload []byte)

	// Metric children, resolved once.
	mReplays, mGaps, mLost, mRestarts, mRedials counter
}

// The SUB and the replay DEALER go through the ZMTP guard
// (internal/zmtpguard), which refuses what would crash or exhaust zmq4's
// own reader goroutines: nothing of ours can recover a panic there. Our own
// handling of each batch has a recover boundary (apply).

// NewSubscriber returns a subscriber with cfg's zero fields defaulted; it
// starts nothing until Run, which validates cfg.
func NewSubscriber(cfg SubscriberConfig) *Subscriber {
	return &Subscriber{
		cfg:      cfg.withDefaults(),
		resyncOK: true,
		media:    make(map[string]bool),
		stats: Stats{
			Replica: cfg.Replica,
			State:   StateStopped,
			LastSeq: -1,
			Applied: make(map[string]uint64),
			Dropped: make(map[string]uint64),
			Refused: make(map[string]uint64),
		},
	}
}

// Stats returns a snapshot.
func (s *Subscriber) Stats() Stats {
	s.mu.Lock()
	st := s.stats
	st.Applied = cloneMap(s.stats.Applied)
	st.Dropped = cloneMap(s.stats.Dropped)
	st.Refused = cloneMap(s.stats.Refused)
	s.mu.Unlock()
	if s.cfg.Index != nil {
		st.Blocks = s.cfg.Index.Held(s.cfg.Replica)
	}
	return st
}

func cloneMap[V any](m map[string]V) map[string]V {
	out := make(map[string]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// errNoReplay: a gap cannot be replayed without a ReplayEndpoint.
var errNoReplay = errors.New("no replay endpoint configured")

// Run follows the stream until ctx is done, re-dialling after errors. It
// returns nil when ctx ends and an error only for an invalid config.
func (s *Subscriber) Run(ctx context.Context) error {
	if err := s.cfg.Validate(); err != nil {
		return err
	}
	s.initMetrics()
	defer s.setState(StateStopped, nil)
	backoff := s.cfg.MinBackoff
	for {
		start := s.cfg.Now()
		s.setState(StateDialing, nil)
		err := s.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		s.setState(StateBackoff, err)
		if s.cfg.Now().Sub(start) > s.cfg.MaxBackoff {
			backoff = s.cfg.MinBackoff // it ran for a while: start over
		}
		msg := "kvevents: stream interrupted, re-dialling"
		switch zmtpguard.Reason(err) {
		case "":
		case zmtpguard.ReasonHandshakeTimeout:
			msg = "kvevents: publisher accepted TCP but completed no ZMTP handshake in time, re-dialling"
		default:
			msg = "kvevents: publisher sent what the ZMTP guard refuses, re-dialling"
		}
		s.cfg.Logger.Warn(msg, "replica", s.cfg.Replica, "endpoint", s.cfg.Endpoint, "err", err, "backoff", backoff)
		s.count(func(st *Stats) { st.Redials++ }, s.mRedials)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, s.cfg.MaxBackoff)
	}
}

// guardConfig is the ZMTP guard's configuration for the SUB (onConnect
// set) or the replay DEALER.
func (s *Subscriber) guardConfig(onConnect func()) zmtpguard.Config {
	c := zmtpguard.DefaultConfig()
	c.MaxFrameBytes, c.MaxMessageBytes = s.cfg.MaxFrameBytes, s.cfg.MaxMessageBytes
	c.HandshakeTimeout = s.cfg.HandshakeTimeout
	c.OnConnect = onConnect
	c.OnRefuse = s.refused
	return c
}

// refused counts a connection the guard closed; it runs on a zmq4 or the
// dialling goroutine.
func (s *Subscriber) refused(e *zmtpguard.Error) {
	s.mu.Lock()
	s.stats.Refused[e.Reason]++
	s.mu.Unlock()
	if m := s.cfg.Metrics; m != nil {
		m.refused.WithLabelValues(s.cfg.Replica, e.Reason).Inc()
	}
	s.notify()
}

// quietLogger silences go-zeromq's own logging; errors come back to us.
var quietLogger = log.New(io.Discard, "", 0)

// session runs one SUB socket from dial to its first error.
func (s *Subscriber) session(ctx context.Context) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The guard closes the connection when sctx ends, so a publisher that
	// never completes the handshake cannot hold Dial past ctx.
	gctx, err := zmtpguard.WithConfig(sctx, s.guardConfig(func() { s.setState(StateHandshaking, nil) }))
	if err != nil {
		return fmt.Errorf("kvevents: subscriber %s: %w", s.cfg.Replica, err)
	}
	sub := zmq4.NewSub(gctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietLogger),
		zmq4.WithDialerTimeout(s.cfg.MaxBackoff+time.Second))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return fmt.Errorf("kvevents: subscribe %s: %w", s.cfg.Replica, err)
	}
	if err := sub.Dial(zmtpguard.Endpoint(s.cfg.Endpoint)); err != nil {
		return fmt.Errorf("kvevents: dial %s at %s: %w", s.cfg.Replica, s.cfg.Endpoint, err)
	}
	s.setState(StateConnected, nil)

	// The reader goroutine is owned by this session: closing sub ends Recv,
	// and stop ends a pending hand-off; the deferred wait joins it. It
	// queues at most MaxMessageBytes of messages not yet handled (one
	// message always), so a publisher faster than we apply cannot grow
	// memory beyond that (zmq4 queues up to 10 more itself).
	msgs := make(chan zmq4.Msg, 64)
	errc := make(chan error, 1)
	stop := make(chan struct{})
	var queued atomic.Int64         // bytes in msgs
	space := make(chan struct{}, 1) // signalled when msgs shrinks
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			m, err := sub.Recv()
			if err != nil {
				errc <- err
				return
			}
			n := msgBytes(m)
			for q := queued.Load(); q > 0 && q+n > s.cfg.MaxMessageBytes; q = queued.Load() {
				select {
				case <-space:
				case <-stop:
					return
				}
			}
			queued.Add(n)
			select {
			case msgs <- m:
			case <-stop:
				return
			}
		}
	}()
	defer func() {
		close(stop)
		cancel()
		_ = sub.Close()
		wg.Wait()
	}()

	s.catchUp(ctx)
	var poll <-chan time.Time
	var pollTimer *time.Timer
	if s.cfg.PollInterval > 0 {
		pollTimer = time.NewTimer(s.cfg.PollInterval)
		defer pollTimer.Stop()
		poll = pollTimer.C
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-errc:
			return fmt.Errorf("kvevents: receive from %s: %w", s.cfg.Replica, err)
		case m := <-msgs:
			queued.Add(-msgBytes(m))
			select {
			case space <- struct{}{}:
			default:
			}
			s.live(ctx, m)
		case <-poll:
			s.catchUp(ctx)
		}
		if pollTimer != nil {
			pollTimer.Reset(s.cfg.PollInterval)
		}
	}
}

// msgBytes is the size of m's frames together.
func msgBytes(m zmq4.Msg) int64 {
	var n int64
	for _, f := range m.Frames {
		n += int64(len(f))
	}
	return n
}

// live handles one message from the SUB socket.
func (s *Subscriber) live(ctx context.Context, m zmq4.Msg) {
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 {
		s.drop("bad_frame", 1)
		return
	}
	if !strings.HasPrefix(string(m.Frames[0]), s.cfg.Topic) {
		return // another replica's topic on a shared publisher
	}
	seq := binary.BigEndian.Uint64(m.Frames[1])
	if s.haveLive && seq <= s.lastLive {
		s.cfg.Logger.Info("kvevents: publisher restarted", "replica", s.cfg.Replica,
			"seq", seq, "last_seq", s.lastLive)
		s.lastLive = seq
		s.restart(ctx)
	}
	s.lastLive, s.haveLive = seq, true
	s.deliver(ctx, seq, m.Frames[2], true)
	s.resyncIfWanted(ctx)
}

// catchUp asks for anything newer than what was applied.
func (s *Subscriber) catchUp(ctx context.Context) {
	if s.cfg.ReplayEndpoint == "" {
		return
	}
	_ = s.replay(ctx)
	s.resyncIfWanted(ctx)
}

// restart forgets the replica's state and replays from 0: a new publisher.
func (s *Subscriber) restart(ctx context.Context) {
	s.count(func(st *Stats) { st.Restarts++ }, s.mRestarts)
	s.reset()
	s.resyncOK = true
	s.resyncing = true
	_ = s.replay(ctx)
	s.resyncing = false
}

func (s *Subscriber) reset() {
	s.cfg.Index.Clear(s.cfg.Replica, s.cfg.Sink)
	s.next = 0
	s.wantSync = false
	s.mu.Lock()
	s.stats.LastSeq = -1
	s.mu.Unlock()
	s.updateBlocks()
	s.notify()
}

// resyncIfWanted performs the full resync an unknown parent asked for.
func (s *Subscriber) resyncIfWanted(ctx context.Context) {
	if !s.wantSync {
		return
	}
	s.wantSync = false
	s.cfg.Logger.Info("kvevents: unknown parent block, resyncing from seq 0", "replica", s.cfg.Replica)
	s.reset()
	s.resyncing = true
	_ = s.replay(ctx)
	s.resyncing = false
	s.wantSync = false // a second unknown parent in the resync is dropped
}

// deliver applies a batch if it is the next one. A gap is replayed when
// allowed; otherwise (or if the replay could not fill it) it is lost.
func (s *Subscriber) deliver(ctx context.Context, seq uint64, payload []byte, allowReplay bool) {
	if seq < s.next {
		return // already applied (a replay overlapping the live stream)
	}
	if seq > s.next && allowReplay {
		s.count(func(st *Stats) { st.Gaps++ }, s.mGaps)
		_ = s.replay(ctx)
		if seq < s.next {
			return
		}
	}
	if seq > s.next {
		lost := seq - s.next
		if s.next == 0 && s.resyncing {
			// A resync from 0 whose buffer no longer starts at 0: expected.
		} else {
			s.resyncOK = true // history has a hole: unknown parents are expected
		}
		s.mu.Lock()
		s.stats.LostBatches += lost
		s.mu.Unlock()
		if s.mLost != nil {
			s.mLost.Add(float64(lost))
		}
		s.next = seq
	}
	s.apply(seq, payload)
}

// apply decodes and applies the batch with seq s.next. A panic in doing so
// (a bug: the decoder is fuzzed) skips the batch, counted as dropped
// "panic" and logged with its stack; the stream goes on.
func (s *Subscriber) apply(seq uint64, payload []byte) {
	s.next = seq + 1
	defer func() {
		if r := recover(); r != nil {
			s.cfg.Logger.Error("kvevents: panic applying a batch; batch skipped", "replica", s.cfg.Replica,
				"seq", seq, "bytes", len(payload), "panic", r, "stack", string(debug.Stack()))
			s.setLastSeq(seq, 0, false)
			s.drop("panic", 1)
		}
	}()
	if s.applyHook != nil {
		s.applyHook(seq, payload)
	}
	b, err := DecodeBatch(payload)
	if err != nil {
		s.cfg.Logger.Warn("kvevents: undecodable batch", "replica", s.cfg.Replica, "seq", seq, "err", err)
		s.setLastSeq(seq, 0, false)
		s.drop("decode_error", 1)
		return
	}
	st, err := s.cfg.Index.Apply(s.cfg.Replica, b.Events, s.cfg.Sink)
	if errors.Is(err, ErrUnknownParent) && s.resyncOK && !s.resyncing && s.cfg.ReplayEndpoint != "" {
		s.resyncOK = false
		s.wantSync = true
	}
	s.mu.Lock()
	s.stats.Batches++
	s.stats.Applied[TypeBlockStored] += uint64(st.Stored)
	s.stats.Applied[TypeBlockRemoved] += uint64(st.Removed)
	s.stats.Applied[TypeAllBlocksCleared] += uint64(st.Cleared)
	for _, d := range []struct {
		reason string
		n      int
	}{{"unknown_type", b.Unknown}, {"unknown_parent", st.UnknownParent},
		{"malformed_event", st.Malformed}, {"unknown_block", st.UnknownRemoved}} {
		if d.n > 0 {
			s.stats.Dropped[d.reason] += uint64(d.n)
		}
	}
	s.mu.Unlock()
	if m := s.cfg.Metrics; m != nil {
		r := s.cfg.Replica
		addIf(m.applied.WithLabelValues(r, TypeBlockStored), st.Stored)
		addIf(m.applied.WithLabelValues(r, TypeBlockRemoved), st.Removed)
		addIf(m.applied.WithLabelValues(r, TypeAllBlocksCleared), st.Cleared)
		if b.Unknown > 0 {
			m.dropped.WithLabelValues(r, "unknown_type").Add(float64(b.Unknown))
		}
		if st.UnknownParent > 0 {
			m.dropped.WithLabelValues(r, "unknown_parent").Add(float64(st.UnknownParent))
		}
		if st.Malformed > 0 {
			m.dropped.WithLabelValues(r, "malformed_event").Add(float64(st.Malformed))
		}
		if st.UnknownRemoved > 0 {
			m.dropped.WithLabelValues(r, "unknown_block").Add(float64(st.UnknownRemoved))
		}
	}
	s.setLastSeq(seq, b.TS, true)
	s.updateBlocks()
	s.notify()
}

func addIf(c interface{ Add(float64) }, n int) {
	if n > 0 {
		c.Add(float64(n))
	}
}

func (s *Subscriber) setLastSeq(seq uint64, ts float64, haveTS bool) {
	var lag float64
	if haveTS && ts > 0 {
		now := s.cfg.Now()
		lag = float64(now.UnixNano())/1e9 - ts
	}
	s.mu.Lock()
	s.stats.LastSeq = int64(seq)
	if haveTS {
		s.stats.LagSeconds = lag
	}
	s.mu.Unlock()
	if m := s.cfg.Metrics; m != nil {
		m.lastSeq.WithLabelValues(s.cfg.Replica).Set(float64(seq))
		if haveTS {
			m.lag.WithLabelValues(s.cfg.Replica).Set(lag)
		}
	}
}

func (s *Subscriber) updateBlocks() {
	m := s.cfg.Metrics
	if m == nil {
		return
	}
	held := s.cfg.Index.Held(s.cfg.Replica)
	for medium := range held {
		s.media[medium] = true
	}
	for medium := range s.media {
		m.blocks.WithLabelValues(s.cfg.Replica, medium).Set(float64(held[medium]))
	}
}

// replay asks the ROUTER for every buffered batch from the last applied one
// (a probe: its presence shows the publisher is the same) or from 0, and
// delivers them in order without nested replays.
func (s *Subscriber) replay(ctx context.Context) error {
	if s.cfg.ReplayEndpoint == "" {
		return errNoReplay
	}
	start, probe := uint64(0), false
	if s.next > 0 {
		start, probe = s.next-1, true
	}
	s.count(func(st *Stats) { st.Replays++ }, s.mReplays)
	got, err := s.replayFrom(ctx, start)
	if err != nil {
		s.count(func(st *Stats) { st.ReplayErrors++ }, nil)
		s.cfg.Logger.Warn("kvevents: replay failed", "replica", s.cfg.Replica, "from", start, "err", err)
		return err
	}
	if probe && got == 0 && !s.resyncing {
		// The publisher holds neither our last batch nor anything newer:
		// it is a new publisher that has published less than we applied.
		s.cfg.Logger.Info("kvevents: publisher restarted (replay probe)", "replica", s.cfg.Replica, "last_seq", start)
		s.count(func(st *Stats) { st.Restarts++ }, s.mRestarts)
		s.reset()
		s.haveLive = false
		s.resyncOK = true
		s.resyncing = true
		defer func() { s.resyncing = false }()
		s.count(func(st *Stats) { st.Replays++ }, s.mReplays)
		if _, err := s.replayFrom(ctx, 0); err != nil {
			s.count(func(st *Stats) { st.ReplayErrors++ }, nil)
			return err
		}
	}
	return nil
}

// replayFrom runs one replay exchange and returns how many batches came back.
func (s *Subscriber) replayFrom(ctx context.Context, start uint64) (int, error) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	gctx, err := zmtpguard.WithConfig(rctx, s.guardConfig(nil))
	if err != nil {
		return 0, err
	}
	d := zmq4.NewDealer(gctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietLogger),
		zmq4.WithDialerTimeout(s.cfg.ReplayTimeout), zmq4.WithTimeout(s.cfg.ReplayTimeout))
	defer d.Close()
	if err := d.Dial(zmtpguard.Endpoint(s.cfg.ReplayEndpoint)); err != nil {
		return 0, fmt.Errorf("dial %s: %w", s.cfg.ReplayEndpoint, err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		return 0, fmt.Errorf("send request: %w", err)
	}
	// Closing the socket's context is the only way to end a blocked Recv:
	// an idle timer does it when the publisher stops answering.
	idle := time.AfterFunc(s.cfg.ReplayTimeout, cancel)
	defer idle.Stop()
	got := 0
	for {
		m, err := d.Recv()
		if err != nil {
			if rctx.Err() != nil && ctx.Err() == nil {
				return got, fmt.Errorf("no reply within %v", s.cfg.ReplayTimeout)
			}
			return got, err
		}
		idle.Reset(s.cfg.ReplayTimeout)
		f := m.Frames
		if len(f) > 0 && len(f[0]) == 0 {
			f = f[1:] // the empty delimiter frame
		}
		var seqb, payload []byte
		switch len(f) {
		case 2: // vLLM ≤ 0.25: [seq, payload]
			seqb, payload = f[0], f[1]
		case 3: // vLLM 0.26: [topic, seq, payload]
			seqb, payload = f[1], f[2]
		default:
			s.drop("bad_frame", 1)
			continue
		}
		if len(seqb) != 8 {
			s.drop("bad_frame", 1)
			continue
		}
		seq := binary.BigEndian.Uint64(seqb)
		if seq == endSeq {
			return got, nil
		}
		got++
		s.deliver(ctx, seq, payload, false)
	}
}

// counter is the part of a prometheus.Counter the subscriber uses.
type counter interface{ Add(float64) }

func (s *Subscriber) initMetrics() {
	m := s.cfg.Metrics
	if m == nil {
		return
	}
	r := s.cfg.Replica
	s.mReplays = m.replays.WithLabelValues(r)
	s.mGaps = m.gaps.WithLabelValues(r)
	s.mLost = m.lost.WithLabelValues(r)
	s.mRestarts = m.restarts.WithLabelValues(r)
	s.mRedials = m.redials.WithLabelValues(r)
}

func (s *Subscriber) count(f func(*Stats), c counter) {
	s.mu.Lock()
	f(&s.stats)
	s.mu.Unlock()
	if c != nil {
		c.Add(1)
	}
	s.notify()
}

func (s *Subscriber) notify() {
	if s.changed != nil {
		s.changed()
	}
}

func (s *Subscriber) drop(reason string, n int) {
	s.mu.Lock()
	s.stats.Dropped[reason] += uint64(n)
	s.mu.Unlock()
	if m := s.cfg.Metrics; m != nil {
		m.dropped.WithLabelValues(s.cfg.Replica, reason).Add(float64(n))
	}
	s.notify()
}

// setState records the connection's state and, with a non-nil err, the
// error that ended the last connection.
func (s *Subscriber) setState(state string, err error) {
	s.mu.Lock()
	s.stats.State = state
	s.stats.Connected = state == StateConnected
	if err != nil {
		s.stats.LastError = err.Error()
	}
	s.mu.Unlock()
	// Stopped is not exported: Run ends when the replica leaves the pool,
	// after its series were deleted (Metrics.Forget).
	if m := s.cfg.Metrics; m != nil && state != StateStopped {
		for _, st := range states {
			v := 0.0
			if st == state {
				v = 1
			}
			m.state.WithLabelValues(s.cfg.Replica, st).Set(v)
		}
	}
	s.notify()
}
