package kvevents

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/prefixlb/prefixlb/internal/zmtpguard"
)

// Hostile peers on loopback (issue 26, D1 and D3): they speak just enough
// ZMTP 3.0 to reach go-zeromq/zmq4's reader, then misbehave.

// zmtpGreeting is a ZMTP 3.0 NULL greeting (RFC 23).
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xFF, 0x7F, 3
	copy(g[12:], "NULL")
	return g
}

// zmtpHeader is a frame header with flags f declaring size (LONG if > 255).
func zmtpHeader(f byte, size uint64) []byte {
	if size <= 255 {
		return []byte{f, byte(size)}
	}
	h := make([]byte, 9)
	h[0] = f | 0x02
	binary.BigEndian.PutUint64(h[1:], size)
	return h
}

// zmtpReady is a READY command frame for socket type typ.
func zmtpReady(typ string) []byte {
	body := []byte("\x05READY\x0bSocket-Type")
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	body = append(body, typ...)
	return append(zmtpHeader(0x04, uint64(len(body))), body...)
}

// zmtpHandshake does a peer's side of the handshake on c as typ.
func zmtpHandshake(c net.Conn, typ string) error {
	go c.Write(append(zmtpGreeting(), zmtpReady(typ)...)) //nolint:errcheck // failures show in the reads
	var g [64]byte
	if _, err := io.ReadFull(c, g[:]); err != nil {
		return err
	}
	var h [2]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return err
	}
	_, err := io.ReadFull(c, make([]byte, h[1])) // READY is short
	return err
}

// switchboard listens on loopback; connection i is handed to hostile(i, c),
// or, when that returns false, relayed to target.
func switchboard(t *testing.T, target string, hostile func(i int, c net.Conn) bool) string {
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
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if hostile(i, c) {
					return
				}
				up, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer up.Close()
				go func() { io.Copy(up, c); up.Close() }() //nolint:errcheck // relay
				io.Copy(c, up)                             //nolint:errcheck // relay
			}()
		}
	}()
	return ln.Addr().String()
}

func hostPort(endpoint string) string { return strings.TrimPrefix(endpoint, "tcp://") }

// hostilePublisher handshakes as a PUB, sends evil, and waits for the
// subscriber to hang up.
func hostilePublisher(evil []byte) func(int, net.Conn) bool {
	return func(i int, c net.Conn) bool {
		if i > 0 {
			return false
		}
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if zmtpHandshake(c, "PUB") == nil {
			c.Write(evil)
			io.Copy(io.Discard, c)
		}
		return true
	}
}

// subscriberSurvives runs a subscriber whose first connection meets a
// hostile publisher sending evil, later ones the real publisher: the
// refusal is counted under reason, and the stream is then followed.
func subscriberSurvives(t *testing.T, evil []byte, reason string, edit func(*Subscriber)) {
	h := newHarness(t)
	m := newEngineModel(7)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback})
	defer stop()
	sw := switchboard(t, hostPort(p.Endpoint()), hostilePublisher(evil))
	publishSteps(t, p, m, 20)
	h.startSubscriberWith(p, "", func(s *Subscriber) {
		s.cfg.Endpoint = "tcp://" + sw
		if edit != nil {
			edit(s)
		}
	})
	h.waitFor(reason+" refused and re-dialled", func() bool {
		st := h.sub.Stats()
		return st.Refused[reason] >= 1 && st.Redials >= 1
	})
	h.waitSynced(p, m)
	publishSteps(t, p, m, 100)
	h.waitSynced(p, m)
	st := h.sub.Stats()
	if !strings.Contains(st.LastError, reason) {
		t.Errorf("last_error %q does not name %s", st.LastError, reason)
	}
	if got := testutil.ToFloat64(h.sub.cfg.Metrics.refused.WithLabelValues("r1", reason)); got < 1 {
		t.Errorf("refused_total{reason=%q} = %v, want ≥ 1", reason, got)
	}
}

func TestSubscriberSurvivesHugeFrameHeader(t *testing.T) {
	// D1: ten bytes declaring a 2^62-byte frame; zmq4 alone panics in
	// makeslice in its reader goroutine and takes the process down.
	subscriberSurvives(t, zmtpHeader(0, 1<<62), zmtpguard.ReasonFrameTooLarge, nil)
}

func TestSubscriberSurvivesFrameChain(t *testing.T) {
	// 20 frames of 64 KiB chained with MORE: one 1.25 MiB message, over a
	// 1 MiB limit; each frame alone is within it.
	var evil []byte
	for range 20 {
		evil = append(evil, zmtpHeader(0x01, 64<<10)...)
		evil = append(evil, make([]byte, 64<<10)...)
	}
	subscriberSurvives(t, evil, zmtpguard.ReasonMessageTooLarge, func(s *Subscriber) {
		s.cfg.MaxMessageBytes = 1 << 20
	})
}

func TestSubscriberSurvivesHostileReplay(t *testing.T) {
	// The replay ROUTER answers a request with a 2^62-byte frame: the
	// replay fails and is counted, the live stream goes on.
	h := newHarness(t)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback})
	defer stop()
	evil := switchboard(t, "", func(_ int, c net.Conn) bool {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if zmtpHandshake(c, "ROUTER") == nil {
			c.Write(zmtpHeader(0, 1<<62))
			io.Copy(io.Discard, c)
		}
		return true
	})
	h.startSubscriberWith(p, "", func(s *Subscriber) { s.cfg.ReplayEndpoint = "tcp://" + evil })
	h.waitFor("replay refused", func() bool {
		st := h.sub.Stats()
		return st.Refused[zmtpguard.ReasonFrameTooLarge] >= 1 && st.ReplayErrors >= 1 && st.Connected
	})
	// Live batches still arrive: publish every 20ms until one is applied
	// (the subscription may reach the PUB after the first: slow joiner).
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for h.sub.Stats().Batches == 0 {
		select {
		case <-tick.C:
			if _, err := p.Publish([]Event{BlockStored{BlockHashes: []uint64{p.NextSeq() + 1}, TokenIDs: toks(0, 4), BlockSize: 4}}, 0); err != nil {
				t.Fatal(err)
			}
		case <-h.changed:
		case <-deadline:
			t.Fatalf("no live batch applied; stats %+v", h.sub.Stats())
		}
	}
}

// runSubscriber runs s until the returned stop, which fails the test if
// Run does not return within bound after ctx ends.
func runSubscriber(t *testing.T, s *Subscriber, bound time.Duration) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			start := time.Now()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
				if d := time.Since(start); d > bound {
					t.Errorf("Run returned %v after ctx ended, want < %v", d, bound)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run still running 30s after ctx ended")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// silentPeer accepts TCP and never says a word.
func silentPeer(t *testing.T) string {
	return switchboard(t, "", func(_ int, c net.Conn) bool {
		_ = c.SetDeadline(time.Now().Add(60 * time.Second))
		io.Copy(io.Discard, c)
		return true
	})
}

// stateLog records every state a subscriber passes through.
type stateLog struct {
	mu   sync.Mutex
	seen map[string]bool
	ch   chan struct{}
}

func watchStates(s *Subscriber) *stateLog {
	l := &stateLog{seen: map[string]bool{}, ch: make(chan struct{}, 1)}
	s.changed = func() {
		st := s.Stats().State
		l.mu.Lock()
		l.seen[st] = true
		l.mu.Unlock()
		select {
		case l.ch <- struct{}{}:
		default:
		}
	}
	return l
}

func (l *stateLog) waitFor(t *testing.T, s *Subscriber, what string, cond func(Stats) bool) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for !cond(s.Stats()) {
		select {
		case <-l.ch:
		case <-deadline:
			t.Fatalf("timed out waiting for %s; stats %+v", what, s.Stats())
		}
	}
}

func TestSubscriberSilentPublisher(t *testing.T) {
	// D3: a publisher that accepts TCP and never greets. The handshake
	// times out, the state shows it, and the subscriber re-dials.
	metrics := NewMetrics()
	s := NewSubscriber(SubscriberConfig{Replica: "r1", Endpoint: "tcp://" + silentPeer(t), Index: NewIndex(),
		Metrics: metrics, HandshakeTimeout: 200 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	states := watchStates(s)
	stop := runSubscriber(t, s, time.Second)
	states.waitFor(t, s, "two handshake timeouts", func(st Stats) bool {
		return st.Refused[zmtpguard.ReasonHandshakeTimeout] >= 2 && st.Redials >= 2
	})
	st := s.Stats()
	if st.Connected || !strings.Contains(st.LastError, zmtpguard.ReasonHandshakeTimeout) {
		t.Errorf("connected=%v last_error=%q, want not connected and a handshake timeout", st.Connected, st.LastError)
	}
	states.mu.Lock()
	for _, want := range []string{StateDialing, StateHandshaking, StateBackoff} {
		if !states.seen[want] {
			t.Errorf("state %s never seen (saw %v)", want, states.seen)
		}
	}
	if states.seen[StateConnected] {
		t.Error("state connected seen against a silent peer")
	}
	states.mu.Unlock()
	if got := testutil.ToFloat64(metrics.refused.WithLabelValues("r1", zmtpguard.ReasonHandshakeTimeout)); got < 2 {
		t.Errorf("refused_total{reason=handshake_timeout} = %v, want ≥ 2", got)
	}
	if got := testutil.ToFloat64(metrics.state.WithLabelValues("r1", StateConnected)); got != 0 {
		t.Errorf("state{state=connected} = %v, want 0", got)
	}
	stop()
	if got := s.Stats().State; got != StateStopped {
		t.Errorf("state after Run = %q, want stopped", got)
	}
}

func TestSubscriberStopsDuringHandshake(t *testing.T) {
	// SIGTERM while a silent publisher holds the handshake: Run returns at
	// once, long before the handshake timeout.
	s := NewSubscriber(SubscriberConfig{Replica: "r1", Endpoint: "tcp://" + silentPeer(t), Index: NewIndex(),
		HandshakeTimeout: time.Minute})
	states := watchStates(s)
	stop := runSubscriber(t, s, time.Second)
	states.waitFor(t, s, "handshaking", func(st Stats) bool { return st.State == StateHandshaking })
	stop()
}

func TestSubscriberRecoversFromPanic(t *testing.T) {
	// A bug that panics while handling one batch skips that batch, is
	// counted, and the stream goes on.
	h := newHarness(t)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback})
	defer stop()
	for i := range 6 {
		if _, err := p.Publish([]Event{BlockStored{BlockHashes: []uint64{uint64(i + 1)}, TokenIDs: toks(4*i, 4), BlockSize: 4}}, 0); err != nil {
			t.Fatal(err)
		}
	}
	h.startSubscriberWith(p, "", func(s *Subscriber) {
		s.applyHook = func(seq uint64, _ []byte) {
			if seq == 3 {
				panic("test: a decoder bug")
			}
		}
	})
	h.waitFor("seq 5", func() bool { return h.sub.Stats().LastSeq == 5 })
	st := h.sub.Stats()
	if st.Dropped["panic"] != 1 || st.Batches != 5 {
		t.Errorf("dropped %v, batches %d; want one panic and 5 batches applied", st.Dropped, st.Batches)
	}
}

// publisherRefusals waits on p's refusals.
func publisherRefusals(p *Publisher) chan struct{} {
	ch := make(chan struct{}, 1)
	f := func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	p.changed.Store(&f)
	return ch
}

func TestPublisherIgnoresIdlePeers(t *testing.T) {
	// D3, engine side: 20 idle TCP connections to each of the PUB and the
	// replay ROUTER. zmq4's accept loop alone would run the first one's
	// handshake for ever and never serve the real subscriber.
	h := newHarness(t)
	m := newEngineModel(8)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback, HandshakeTimeout: time.Minute})
	defer stop()
	for _, ep := range []string{p.Endpoint(), p.ReplayEndpoint()} {
		for range 20 {
			c, err := net.Dial("tcp", hostPort(ep))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
		}
	}
	publishSteps(t, p, m, 30)
	h.startSubscriber(p, "")
	h.waitSynced(p, m) // replayed over the ROUTER
	publishSteps(t, p, m, 100)
	h.waitSynced(p, m)
}

func TestPublisherDropsHostilePeers(t *testing.T) {
	// D1, engine side: a subscriber and a replay client that declare 2^62
	// bytes, and a PUB that connects to the PUB, are dropped and counted;
	// the engine keeps serving.
	h := newHarness(t)
	m := newEngineModel(9)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback})
	defer stop()
	refused := publisherRefusals(p)
	for _, peer := range []struct{ ep, typ string }{{p.Endpoint(), "SUB"}, {p.ReplayEndpoint(), "DEALER"}, {p.Endpoint(), "PUB"}} {
		c, err := net.Dial("tcp", hostPort(peer.ep))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if err := zmtpHandshake(c, peer.typ); err == nil {
			c.Write(zmtpHeader(0, 1<<62))
		}
	}
	deadline := time.After(20 * time.Second)
	for {
		r := p.Refused()
		if r[zmtpguard.ReasonFrameTooLarge] == 2 && r[zmtpguard.ReasonIncompatiblePeer] == 1 {
			break
		}
		select {
		case <-refused:
		case <-deadline:
			t.Fatalf("refused %v, want 2 frame_too_large and 1 incompatible_peer", r)
		}
	}
	publishSteps(t, p, m, 30)
	h.startSubscriber(p, "")
	h.waitSynced(p, m)
}

func TestGuardConfigValidate(t *testing.T) {
	ix := NewIndex()
	for name, c := range map[string]SubscriberConfig{
		"handshake": {Replica: "r", Endpoint: "tcp://h:1", Index: ix, HandshakeTimeout: -1},
		"frame":     {Replica: "r", Endpoint: "tcp://h:1", Index: ix, MaxFrameBytes: -1},
		"message":   {Replica: "r", Endpoint: "tcp://h:1", Index: ix, MaxMessageBytes: -1},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		}
	}
	for name, c := range map[string]PublisherConfig{
		"handshake": {Endpoint: loopback, HandshakeTimeout: -1},
		"message":   {Endpoint: loopback, MaxPeerMessageBytes: -1},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		}
	}
}
