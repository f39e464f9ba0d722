package zmtpguard

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

var quiet = log.New(io.Discard, "", 0)

// refusals collects OnRefuse calls.
type refusals struct {
	mu  sync.Mutex
	got map[string]int
	ch  chan string
}

func newRefusals() *refusals { return &refusals{got: map[string]int{}, ch: make(chan string, 1024)} }

func (r *refusals) hook(e *Error) {
	r.mu.Lock()
	r.got[e.Reason]++
	r.mu.Unlock()
	select {
	case r.ch <- e.Reason:
	default:
	}
}

// wait waits for a refusal with reason.
func (r *refusals) wait(t *testing.T, reason string, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		r.mu.Lock()
		n := r.got[reason]
		r.mu.Unlock()
		if n > 0 {
			return
		}
		select {
		case <-r.ch:
		case <-deadline:
			r.mu.Lock()
			defer r.mu.Unlock()
			t.Fatalf("no %s refusal within %v; refusals %v", reason, within, r.got)
		}
	}
}

func guardCtx(t *testing.T, cfg Config) (context.Context, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	gctx, err := WithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return gctx, cancel
}

// fakePeer listens on loopback and runs serve for each connection.
func fakePeer(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return ln.Addr().String()
}

// handshakeAs does a peer's handshake on c as a socket of type typ: it
// sends greeting and READY, reads the other side's, and reports whether
// that worked.
func handshakeAs(c net.Conn, typ string) error {
	go c.Write(new(wire).greeting().ready(typ).Bytes()) //nolint:errcheck // a failed write shows in the reads
	var g [greetingLen]byte
	if _, err := io.ReadFull(c, g[:]); err != nil {
		return err
	}
	_, err := readFrame(c)
	return err
}

// readFrame reads one raw frame's body.
func readFrame(r io.Reader) ([]byte, error) {
	var h [2]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	size := uint64(h[1])
	if h[0]&flagLong != 0 {
		var l [8]byte
		l[0] = h[1]
		if _, err := io.ReadFull(r, l[1:]); err != nil {
			return nil, err
		}
		size = binary.BigEndian.Uint64(l[:])
	}
	b := make([]byte, size)
	_, err := io.ReadFull(r, b)
	return b, err
}

func TestZMQ4GreetingPinned(t *testing.T) {
	// The listener sends zmq4Greeting for zmq4 and drops zmq4's own: a zmq4
	// release that greets differently would fail every accepted connection.
	for _, server := range []bool{true, false} {
		a, b := net.Pipe()
		got := make(chan []byte, 1)
		go func() {
			var g [greetingLen]byte
			_, _ = io.ReadFull(b, g[:])
			got <- g[:]
			b.Close()
		}()
		_, _ = zmq4.Open(a, null.Security(), zmq4.Pub, nil, server, nil)
		a.Close()
		if g := <-got; string(g) != string(zmq4Greeting[:]) {
			t.Errorf("server=%v: zmq4 greets with\n% x\nthe guard assumes\n% x", server, g, zmq4Greeting)
		}
	}
}

func TestEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://127.0.0.1:5557": "zmtpguard-tcp://127.0.0.1:5557",
		"tcp://*:5557":         "zmtpguard-tcp://*:5557",
		"ipc:///tmp/kv":        "zmtpguard-ipc:///tmp/kv",
		"inproc://x":           "inproc://x",
	} {
		if got := Endpoint(in); got != want {
			t.Errorf("Endpoint(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]Config{
		"frame":     {Limits: Limits{MaxFrameBytes: -1}},
		"message":   {Limits: Limits{MaxMessageBytes: -1}},
		"frames":    {Limits: Limits{MaxFrames: -1}},
		"handshake": {HandshakeTimeout: -time.Second},
		"pending":   {MaxHandshakes: -1},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		}
	}
}

func TestDialRefusesHugeFrame(t *testing.T) {
	addr := fakePeer(t, func(c net.Conn) {
		if handshakeAs(c, "PUB") != nil {
			return
		}
		// One header declaring 2^62 bytes: zmq4 alone panics in makeslice.
		c.Write(new(wire).header(0, 1<<62).Bytes())
		io.Copy(io.Discard, c)
	})
	ref := newRefusals()
	ctx, _ := guardCtx(t, Config{OnRefuse: ref.hook})
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(Endpoint("tcp://" + addr)); err != nil {
		t.Fatal(err)
	}
	_, err := sub.Recv()
	if Reason(err) != ReasonFrameTooLarge {
		t.Fatalf("Recv: %v, want a %s refusal", err, ReasonFrameTooLarge)
	}
	ref.wait(t, ReasonFrameTooLarge, time.Second)
}

func TestDialSilentPeerTimesOut(t *testing.T) {
	addr := fakePeer(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	ref := newRefusals()
	ctx, _ := guardCtx(t, Config{HandshakeTimeout: 200 * time.Millisecond, OnRefuse: ref.hook})
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	start := time.Now()
	err := sub.Dial(Endpoint("tcp://" + addr))
	if Reason(err) != ReasonHandshakeTimeout {
		t.Fatalf("Dial: %v, want a %s refusal", err, ReasonHandshakeTimeout)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Dial took %v with a 200ms handshake timeout", d)
	}
	ref.wait(t, ReasonHandshakeTimeout, time.Second)
}

func TestDialEndsWithSocketContext(t *testing.T) {
	addr := fakePeer(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	connected := make(chan struct{})
	ctx, cancel := guardCtx(t, Config{HandshakeTimeout: time.Minute, OnConnect: func() { close(connected) }})
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	errc := make(chan error, 1)
	go func() { errc <- sub.Dial(Endpoint("tcp://" + addr)) }()
	<-connected
	cancel()
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("Dial succeeded against a silent peer")
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Dial still blocked 2s after its socket's context ended")
	}
}

// listenPub runs a guarded PUB on loopback.
func listenPub(t *testing.T, cfg Config) (zmq4.Socket, string) {
	t.Helper()
	ctx, _ := guardCtx(t, cfg)
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quiet))
	t.Cleanup(func() { pub.Close() })
	if err := pub.Listen(Endpoint("tcp://127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	return pub, pub.Addr().String()
}

// subscribe dials a SUB (guarded or not) to addr, subscribed to everything.
func subscribe(t *testing.T, ep string) zmq4.Socket {
	t.Helper()
	ctx, _ := guardCtx(t, Config{})
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(0))
	t.Cleanup(func() { sub.Close() })
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(ep); err != nil {
		t.Fatal(err)
	}
	return sub
}

// receiveWhilePublishing publishes msg until sub receives it (a new
// subscription reaches the PUB after its first messages: ZeroMQ's slow
// joiner), within d.
func receiveWhilePublishing(t *testing.T, pub, sub zmq4.Socket, d time.Duration) {
	t.Helper()
	got := make(chan error, 1)
	go func() {
		_, err := sub.Recv()
		got <- err
	}()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(d)
	for {
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("Recv: %v", err)
			}
			return
		case <-tick.C:
			if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), []byte("hello"))); err != nil {
				t.Fatalf("Send: %v", err)
			}
		case <-deadline:
			t.Fatalf("no message within %v", d)
		}
	}
}

func TestListenerIdlePeersDoNotBlock(t *testing.T) {
	// 20 TCP connections that never greet, then a real subscriber: it is
	// served at once, long before the idle ones time out. zmq4's own accept
	// loop would run the first idle connection's handshake for ever.
	ref := newRefusals()
	pub, addr := listenPub(t, Config{HandshakeTimeout: time.Minute, OnRefuse: ref.hook, PeerTypes: []string{"SUB"}})
	for range 20 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	}
	for _, ep := range []string{Endpoint("tcp://" + addr), "tcp://" + addr} { // guarded and plain zmq4
		sub := subscribe(t, ep)
		receiveWhilePublishing(t, pub, sub, 20*time.Second)
	}
}

func TestListenerDropsSilentPeer(t *testing.T) {
	ref := newRefusals()
	_, addr := listenPub(t, Config{HandshakeTimeout: 100 * time.Millisecond, OnRefuse: ref.hook})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	// The listener greets first, then hangs up at the deadline.
	n, err := io.Copy(io.Discard, c)
	if err != nil || n != greetingLen {
		t.Fatalf("read %d bytes (%v), want the %d-byte greeting then EOF", n, err, greetingLen)
	}
	ref.wait(t, ReasonHandshakeTimeout, time.Second)
}

func TestListenerBoundsHandshakes(t *testing.T) {
	ref := newRefusals()
	_, addr := listenPub(t, Config{HandshakeTimeout: time.Minute, MaxHandshakes: 2, OnRefuse: ref.hook})
	for i := range 3 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if i < 2 { // wait for the greeting: that handshake holds a slot
			var g [greetingLen]byte
			if _, err := io.ReadFull(c, g[:]); err != nil {
				t.Fatal(err)
			}
		}
	}
	ref.wait(t, ReasonTooManyPending, 10*time.Second)
}

func TestListenerRefusesIncompatiblePeer(t *testing.T) {
	ref := newRefusals()
	_, addr := listenPub(t, Config{OnRefuse: ref.hook, PeerTypes: []string{"SUB", "XSUB"}})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	if err := handshakeAs(c, "PUB"); err == nil {
		t.Fatal("a PUB peer completed its handshake with a PUB")
	}
	ref.wait(t, ReasonIncompatiblePeer, time.Second)
}

func TestListenerHostileSubscriber(t *testing.T) {
	// A subscriber that declares a 2^62-byte frame is dropped; the PUB
	// keeps serving others.
	ref := newRefusals()
	pub, addr := listenPub(t, Config{OnRefuse: ref.hook, PeerTypes: []string{"SUB"}})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	if err := handshakeAs(c, "SUB"); err != nil {
		t.Fatal(err)
	}
	c.Write(new(wire).header(0, 1<<62).Bytes())
	ref.wait(t, ReasonFrameTooLarge, 10*time.Second)
	sub := subscribe(t, Endpoint("tcp://"+addr))
	receiveWhilePublishing(t, pub, sub, 20*time.Second)
}

func TestWriteTimeoutDropsStuckSubscriber(t *testing.T) {
	// A subscriber that subscribes and never reads fills its socket
	// buffers; zmq4's PUB then blocks writing to it, and so stalls every
	// other subscriber, until WriteTimeout drops it.
	ref := newRefusals()
	pub, addr := listenPub(t, Config{WriteTimeout: 300 * time.Millisecond, OnRefuse: ref.hook})
	stuck, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	_ = stuck.SetDeadline(time.Now().Add(20 * time.Second))
	if err := handshakeAs(stuck, "SUB"); err != nil {
		t.Fatal(err)
	}
	if _, err := stuck.Write(new(wire).frame(0, []byte{1}).Bytes()); err != nil { // subscribe to all
		t.Fatal(err)
	}
	sub := subscribe(t, Endpoint("tcp://"+addr))
	receiveWhilePublishing(t, pub, sub, 20*time.Second)
	// 64 MB: more than loopback buffers hold for the stuck one.
	const n, size = 1000, 64 << 10
	payload := make([]byte, size)
	done := make(chan error, 1)
	go func() {
		for i := range n {
			var m zmq4.Msg
			var err error
			for {
				if m, err = sub.Recv(); err != nil || len(m.Frames) == 3 {
					break
				}
			}
			if err != nil {
				done <- err
				return
			}
			if got := binary.BigEndian.Uint64(m.Frames[1]); got != uint64(i) {
				done <- errors.New("out of order")
				return
			}
		}
		done <- nil
	}()
	for i := range n {
		var seq [8]byte
		binary.BigEndian.PutUint64(seq[:], uint64(i))
		if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), seq[:], payload)); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the reading subscriber stalled behind the stuck one")
	}
	ref.wait(t, ReasonWriteTimeout, time.Second)
}
