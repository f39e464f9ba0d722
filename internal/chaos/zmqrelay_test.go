package chaos

import (
	"context"
	binenc "encoding/binary" // "binary" is the prefixlb binary's path
	"errors"
	"io"
	"log"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// zmqRelay is a ZeroMQ hop in front of an engine's KV-event PUB socket: a
// SUB dialled to the engine, subscribed to every topic, and a PUB of its own
// on loopback that sends each message on unchanged. In gap mode it drops
// messages on a connection that stays up, so that a subscriber sees the
// sequence numbers jump on a live stream (a tcpProxy can only cut or delay
// bytes: it cannot drop whole ZMTP messages). The test that creates it owns
// it; its goroutine stops at Close (a cleanup).
type zmqRelay struct {
	sub, pub zmq4.Socket
	endpoint string // the PUB socket, "tcp://127.0.0.1:PORT"
	cancel   context.CancelFunc
	done     chan struct{} // closed when the relay goroutine has returned

	// gapEvery is the gap mode in nanoseconds: while > 0, every message is
	// dropped but the first after each gapEvery since the last one sent.
	gapEvery atomic.Int64

	mu          sync.Mutex // guards the fields below
	lastSent    time.Time
	lastSeq     int64 // the last seq seen from the engine, −1 before any
	lastDropped int64 // the last seq dropped, −1 before any
	sent        int
	dropped     int
	gaps        int // messages sent after at least one was dropped
	pendingGap  bool
	err         error // why the relay stopped before Close
}

// quietZMQ silences go-zeromq's own logging.
var quietZMQ = log.New(io.Discard, "", 0)

// newZMQRelay starts a relay of the PUB socket at upstream ("tcp://...").
func newZMQRelay(t testing.TB, upstream string) *zmqRelay {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &zmqRelay{
		sub:         zmq4.NewSub(ctx, zmq4.WithLogger(quietZMQ)),
		pub:         zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQ)),
		cancel:      cancel,
		done:        make(chan struct{}),
		lastSeq:     -1,
		lastDropped: -1,
	}
	fail := func(format string, err error) {
		cancel()
		r.sub.Close()
		r.pub.Close()
		t.Fatalf(format, err)
	}
	if err := r.pub.Listen("tcp://127.0.0.1:0"); err != nil {
		fail("chaos: zmq relay listen: %v", err)
	}
	r.endpoint = "tcp://" + r.pub.Addr().String()
	if err := r.sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		fail("chaos: zmq relay subscribe: %v", err)
	}
	if err := r.sub.Dial(upstream); err != nil {
		fail("chaos: zmq relay dial: %v", err)
	}
	go r.run(ctx)
	t.Cleanup(r.Close)
	return r
}

// addr is the relay's PUB socket as host:port.
func (r *zmqRelay) addr() string { return strings.TrimPrefix(r.endpoint, "tcp://") }

// setGap starts gap mode (every > 0: drop all but one message per every) or
// ends it (0).
func (r *zmqRelay) setGap(every time.Duration) { r.gapEvery.Store(int64(every)) }

// zmqRelayStats is what a relay did.
type zmqRelayStats struct {
	Sent, Dropped, Gaps  int
	LastSeq, LastDropped int64
	Err                  error
}

// stats returns a snapshot.
func (r *zmqRelay) stats() zmqRelayStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return zmqRelayStats{Sent: r.sent, Dropped: r.dropped, Gaps: r.gaps,
		LastSeq: r.lastSeq, LastDropped: r.lastDropped, Err: r.err}
}

// Close stops the relay and waits for its goroutine.
func (r *zmqRelay) Close() {
	r.cancel()
	r.sub.Close()
	r.pub.Close()
	<-r.done
}

// run relays until the SUB socket fails or the relay is closed.
func (r *zmqRelay) run(ctx context.Context) {
	defer close(r.done)
	for {
		m, err := r.sub.Recv()
		if err != nil {
			if ctx.Err() == nil {
				r.mu.Lock()
				r.err = err
				r.mu.Unlock()
			}
			return
		}
		if !r.pass(m) {
			continue
		}
		if err := r.pub.Send(m); err != nil && !errors.Is(err, context.Canceled) {
			r.mu.Lock()
			r.err = err
			r.mu.Unlock()
			return
		}
	}
}

// pass decides whether m goes on, and counts it.
func (r *zmqRelay) pass(m zmq4.Msg) bool {
	seq := int64(-1)
	if len(m.Frames) == 3 && len(m.Frames[1]) == 8 {
		seq = int64(binenc.BigEndian.Uint64(m.Frames[1]))
	}
	now := time.Now()
	every := time.Duration(r.gapEvery.Load())
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lastSeq = seq
	if every > 0 && now.Sub(r.lastSent) < every {
		r.dropped++
		r.lastDropped = seq
		r.pendingGap = true
		return false
	}
	r.sent++
	r.lastSent = now
	if r.pendingGap {
		r.gaps++
		r.pendingGap = false
	}
	return true
}
