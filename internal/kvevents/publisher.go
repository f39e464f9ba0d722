package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/prefixlb/prefixlb/internal/zmtpguard"
)

// DefaultBufferSteps is how many batches a publisher keeps for replay: vLLM's
// ZmqEventPublisher buffer_steps default.
const DefaultBufferSteps = 10_000

// defaultHWM is vLLM's PUB high-water mark (ZmqEventPublisher hwm).
const defaultHWM = 100_000

// DefaultMaxPeerMessageBytes bounds a message a publisher reads from a peer:
// subscribers send only subscriptions (a topic prefix) and replay clients
// ["", 8-byte seq], so 64 KiB is far above anything real, and a hostile
// peer cannot make the engine allocate more than that per message.
const DefaultMaxPeerMessageBytes = 64 << 10

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Endpoint is the PUB socket: "tcp://*:5557" or "tcp://127.0.0.1:0" (a
	// free port; see Endpoint()). Required.
	Endpoint string
	// Dial connects the PUB to Endpoint instead of binding it, for a router
	// that binds one SUB for all replicas. (vLLM binds when the endpoint has
	// "*" and connects otherwise; the caller decides that from its flag.)
	Dial bool
	// ReplayEndpoint is the ROUTER socket, always bound; empty: no replay.
	ReplayEndpoint string
	// Topic is the first frame of every message.
	Topic string
	// Encoding of the payload: EncodingArray (vLLM ≤ 0.23) or EncodingMap.
	Encoding Encoding
	// ReplayTopicFrame answers replays with ["", topic, seq, payload] as vLLM
	// 0.26 does; false sends the older ["", seq, payload].
	ReplayTopicFrame bool
	// BufferSteps is the number of batches kept for replay; 0 means
	// DefaultBufferSteps.
	BufferSteps int
	// DataParallelRank, when set, is written in every batch.
	DataParallelRank *int64
	// SkipLive, when set, is asked for each seq before it goes out on the PUB
	// socket; true keeps the batch for replay but does not send it live. It
	// injects message loss for tests and demos.
	SkipLive func(seq uint64) bool
	// Logger, nil for none.
	Logger *slog.Logger
	// MaxPeerMessageBytes bounds a frame or message read from a subscriber
	// or replay client; 0 means DefaultMaxPeerMessageBytes.
	MaxPeerMessageBytes int64
	// HandshakeTimeout bounds a peer's ZMTP handshake; 0 means
	// zmtpguard.DefaultHandshakeTimeout (5s). Handshakes run concurrently,
	// so a silent peer delays no other.
	HandshakeTimeout time.Duration
	// WriteTimeout drops a peer that reads nothing for that long (a
	// subscriber that stops reading would otherwise stall every other one:
	// zmq4's PUB writes to them in turn); 0 means
	// zmtpguard.DefaultWriteTimeout (10s), negative none.
	WriteTimeout time.Duration
}

// Validate reports the first invalid field.
func (c PublisherConfig) Validate() error {
	switch {
	case c.Endpoint == "" || !strings.Contains(c.Endpoint, "://"):
		return fmt.Errorf("kvevents: publisher config: Endpoint %q is not transport://address", c.Endpoint)
	case c.ReplayEndpoint != "" && !strings.Contains(c.ReplayEndpoint, "://"):
		return fmt.Errorf("kvevents: publisher config: ReplayEndpoint %q is not transport://address", c.ReplayEndpoint)
	case c.BufferSteps < 0:
		return fmt.Errorf("kvevents: publisher config: BufferSteps %d is negative", c.BufferSteps)
	case c.Encoding != EncodingArray && c.Encoding != EncodingMap:
		return fmt.Errorf("kvevents: publisher config: unknown Encoding %d", c.Encoding)
	case c.MaxPeerMessageBytes < 0:
		return fmt.Errorf("kvevents: publisher config: MaxPeerMessageBytes %d is negative", c.MaxPeerMessageBytes)
	case c.HandshakeTimeout < 0:
		return fmt.Errorf("kvevents: publisher config: HandshakeTimeout %v is negative", c.HandshakeTimeout)
	}
	return nil
}

// Publisher publishes an engine's cache changes as vLLM's ZmqEventPublisher
// does: each batch gets the next seq from 0, goes out on a PUB socket as
// [topic, seq(8 bytes BE), payload], and is kept in a ring of the last
// BufferSteps batches that a ROUTER socket replays on request.
//
// Publish may be called from any goroutine, before or during Run; batches
// published before Run has bound the PUB socket are only replayable.
//
// Both sockets go through the ZMTP guard (internal/zmtpguard): a peer that
// sends an oversized or malformed frame, never completes its handshake or
// stops reading is dropped, counted (Refused) and logged; without it one
// such peer crashes zmq4's reader goroutine (which nothing of ours can
// recover) or blocks its accept loop.
type Publisher struct {
	cfg   PublisherConfig
	ready chan struct{}

	rmu     sync.Mutex // guards refused and logged
	refused map[string]uint64
	logged  map[string]time.Time // last Warn per reason
	// changed, when set (by tests), is called after each refusal.
	changed atomic.Pointer[func()]

	mu       sync.Mutex // guards everything below
	seq      uint64
	ring     []ringEntry
	head     int // index of the oldest entry once the ring is full
	pub      zmq4.Socket
	endpoint string
	replayEP string
}

type ringEntry struct {
	seq     uint64
	payload []byte
}

// NewPublisher returns a publisher; it binds nothing until Run.
func NewPublisher(cfg PublisherConfig) *Publisher {
	if cfg.BufferSteps == 0 {
		cfg.BufferSteps = DefaultBufferSteps
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxPeerMessageBytes == 0 {
		cfg.MaxPeerMessageBytes = DefaultMaxPeerMessageBytes
	}
	return &Publisher{cfg: cfg, ready: make(chan struct{}),
		refused: make(map[string]uint64), logged: make(map[string]time.Time)}
}

// Refused counts the peer connections the ZMTP guard closed, by reason
// (zmtpguard's: handshake_timeout, frame_too_large, incompatible_peer, ...).
func (p *Publisher) Refused() map[string]uint64 {
	p.rmu.Lock()
	defer p.rmu.Unlock()
	return maps.Clone(p.refused)
}

// refuse counts a refused peer and logs it, at most once a second per
// reason so a flood of hostile connections cannot flood the log.
func (p *Publisher) refuse(e *zmtpguard.Error) {
	now := time.Now()
	p.rmu.Lock()
	p.refused[e.Reason]++
	n := p.refused[e.Reason]
	log := now.Sub(p.logged[e.Reason]) >= time.Second
	if log {
		p.logged[e.Reason] = now
	}
	p.rmu.Unlock()
	if log {
		p.cfg.Logger.Warn("kvevents: publisher dropped a peer", "reason", e.Reason, "err", e.Err, "total", n)
	}
	if f := p.changed.Load(); f != nil {
		(*f)()
	}
}

// guardContext is ctx carrying the guard's configuration for a socket
// whose peers are of peerTypes.
func (p *Publisher) guardContext(ctx context.Context, peerTypes ...string) (context.Context, error) {
	c := zmtpguard.DefaultConfig()
	c.MaxFrameBytes, c.MaxMessageBytes = p.cfg.MaxPeerMessageBytes, p.cfg.MaxPeerMessageBytes
	c.HandshakeTimeout, c.WriteTimeout = p.cfg.HandshakeTimeout, p.cfg.WriteTimeout
	c.PeerTypes = peerTypes
	c.OnRefuse = p.refuse
	return zmtpguard.WithConfig(ctx, c)
}

// Ready is closed once Run has bound its sockets (or failed to: then Run
// returns the error).
func (p *Publisher) Ready() <-chan struct{} { return p.ready }

// Endpoint is the PUB address subscribers dial, "tcp://127.0.0.1:port" with
// the real port, once Ready; the configured one when dialling.
func (p *Publisher) Endpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endpoint
}

// ReplayEndpoint is the bound ROUTER address, once Ready; "" without replay.
func (p *Publisher) ReplayEndpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.replayEP
}

// NextSeq is the seq the next Publish will get.
func (p *Publisher) NextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// Run binds the sockets, serves replay requests until ctx is done, then
// closes them. Call it once. It returns nil when ctx ends, or the bind error.
func (p *Publisher) Run(ctx context.Context) error {
	if err := p.cfg.Validate(); err != nil {
		close(p.ready)
		return err
	}
	pctx, err := p.guardContext(ctx, string(zmq4.Sub), string(zmq4.XSub))
	if err != nil {
		close(p.ready)
		return fmt.Errorf("kvevents: publisher: %w", err)
	}
	pub := zmq4.NewPub(pctx, zmq4.WithLogger(quietLogger))
	_ = pub.SetOption(zmq4.OptionHWM, defaultHWM)
	if p.cfg.Dial {
		err = pub.Dial(zmtpguard.Endpoint(p.cfg.Endpoint))
	} else {
		err = pub.Listen(zmtpguard.Endpoint(p.cfg.Endpoint))
	}
	if err != nil {
		_ = pub.Close()
		close(p.ready)
		return fmt.Errorf("kvevents: publisher on %s: %w", p.cfg.Endpoint, err)
	}
	defer pub.Close()
	var router zmq4.Socket
	if p.cfg.ReplayEndpoint != "" {
		rctx, err := p.guardContext(ctx, string(zmq4.Dealer), string(zmq4.Req), string(zmq4.Router))
		if err != nil {
			close(p.ready)
			return fmt.Errorf("kvevents: publisher replay: %w", err)
		}
		router = zmq4.NewRouter(rctx, zmq4.WithLogger(quietLogger))
		if err := router.Listen(zmtpguard.Endpoint(p.cfg.ReplayEndpoint)); err != nil {
			close(p.ready)
			return fmt.Errorf("kvevents: publisher replay on %s: %w", p.cfg.ReplayEndpoint, err)
		}
		defer router.Close()
	}
	p.mu.Lock()
	p.pub = pub
	p.endpoint = boundEndpoint(p.cfg.Endpoint, pub.Addr())
	if router != nil {
		p.replayEP = boundEndpoint(p.cfg.ReplayEndpoint, router.Addr())
	}
	p.mu.Unlock()
	close(p.ready)
	defer func() {
		p.mu.Lock()
		p.pub = nil
		p.mu.Unlock()
	}()

	if router == nil {
		<-ctx.Done()
		return nil
	}
	for {
		m, err := router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("kvevents: publisher replay receive: %w", err)
		}
		p.serveReplay(router, m)
	}
}

// boundEndpoint turns a bound listener's address into a dialable endpoint.
func boundEndpoint(configured string, addr net.Addr) string {
	if addr == nil {
		return configured
	}
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return configured
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "tcp://" + net.JoinHostPort(host, port)
}

// serveReplay answers one request [identity, "", start_seq] with every
// buffered batch whose seq ≥ start, then seq −1 with an empty payload (vLLM's
// ZmqEventPublisher._service_replay). A panic in doing so (a bug) is logged
// and the request dropped; the publisher goes on.
func (p *Publisher) serveReplay(router zmq4.Socket, m zmq4.Msg) {
	defer func() {
		if r := recover(); r != nil {
			p.cfg.Logger.Error("kvevents: panic serving a replay request; request dropped",
				"panic", r, "stack", string(debug.Stack()))
		}
	}()
	f := m.Frames
	if len(f) != 3 || len(f[2]) != 8 {
		p.cfg.Logger.Warn("kvevents: invalid replay request", "frames", len(f))
		return
	}
	id, start := f[0], binary.BigEndian.Uint64(f[2])
	p.mu.Lock()
	var out []ringEntry
	for i := range p.ring {
		e := p.ring[(p.head+i)%len(p.ring)]
		if e.seq >= start {
			out = append(out, e)
		}
	}
	p.mu.Unlock()
	send := func(seq uint64, payload []byte) error {
		var sb [8]byte
		binary.BigEndian.PutUint64(sb[:], seq)
		frames := [][]byte{id, {}}
		if p.cfg.ReplayTopicFrame {
			frames = append(frames, []byte(p.cfg.Topic))
		}
		frames = append(frames, sb[:], payload)
		return router.Send(zmq4.NewMsgFrom(frames...))
	}
	for _, e := range out {
		if err := send(e.seq, e.payload); err != nil {
			p.cfg.Logger.Warn("kvevents: replay send", "err", err)
			return
		}
	}
	if err := send(endSeq, []byte{}); err != nil {
		p.cfg.Logger.Warn("kvevents: replay end send", "err", err)
	}
}

// Publish encodes events with timestamp ts (seconds since the Unix epoch) as
// the next batch, keeps it for replay and sends it live. It returns the seq.
func (p *Publisher) Publish(events []Event, ts float64) (uint64, error) {
	payload, err := EncodeBatch(Batch{TS: ts, Events: events, DataParallelRank: p.cfg.DataParallelRank}, p.cfg.Encoding)
	if err != nil {
		return 0, err
	}
	return p.PublishPayload(payload)
}

// PublishPayload publishes an already encoded batch (a golden fixture, or a
// deliberately malformed one in tests).
func (p *Publisher) PublishPayload(payload []byte) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.seq
	p.seq++
	e := ringEntry{seq: seq, payload: payload}
	if len(p.ring) < p.cfg.BufferSteps {
		p.ring = append(p.ring, e)
	} else {
		p.ring[p.head] = e
		p.head = (p.head + 1) % len(p.ring)
	}
	if p.pub == nil || (p.cfg.SkipLive != nil && p.cfg.SkipLive(seq)) {
		return seq, nil
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	// The PUB writer only queues (up to the high-water mark), so holding the
	// lock here keeps seqs in order on the wire without blocking on peers.
	if err := p.pub.Send(zmq4.NewMsgFrom([]byte(p.cfg.Topic), sb[:], payload)); err != nil {
		return seq, fmt.Errorf("kvevents: publish seq %d: %w", seq, err)
	}
	return seq, nil
}
