package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// listenHarness runs one Listener on loopback with bounded waits.
type listenHarness struct {
	t       *testing.T
	ctx     context.Context
	l       *Listener
	index   *Index
	changed chan struct{}
	first   []string // OnFirstBatch's calls, in order; guarded by mu
	mu      sync.Mutex
}

func newListenHarness(t *testing.T, replicas map[string]string) *listenHarness {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	h := &listenHarness{t: t, ctx: ctx, index: NewIndex(), changed: make(chan struct{}, 1)}
	h.l = NewListener(ListenerConfig{
		Endpoint: "tcp://127.0.0.1:0",
		Resolve: func(topic string) (string, bool) {
			r, ok := replicas[TopicPod(topic)]
			return r, ok
		},
		OnFirstBatch: func(r string) {
			h.mu.Lock()
			h.first = append(h.first, r)
			h.mu.Unlock()
		},
		Index:   h.index,
		Sink:    newRecSink(),
		Metrics: NewMetrics(),
	})
	h.l.changed = func() {
		select {
		case h.changed <- struct{}{}:
		default:
		}
	}
	done := make(chan error, 1)
	go func() { done <- h.l.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("listener Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("listener Run did not return")
		}
	})
	select {
	case <-h.l.Ready():
	case err := <-done:
		t.Fatalf("listener Run: %v", err)
	}
	return h
}

// waitFor waits, on the listener's change notifications, until cond holds.
func (h *listenHarness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	for !cond() {
		select {
		case <-h.changed:
		case <-deadline.C:
			h.t.Fatalf("timed out waiting for %s; listener %+v", what, h.l.Stats())
		}
	}
}

func (h *listenHarness) replica(name string) Stats {
	st, ok := h.l.ReplicaStats(name)
	if !ok {
		st.LastSeq = -1 // no stream yet
	}
	return st
}

// engine is a real zmq4 PUB that dials the listener, as vLLM's
// ZmqEventPublisher does with a non-wildcard endpoint.
type engine struct {
	h     *listenHarness
	pub   zmq4.Socket
	topic string
}

// dialEngine connects a PUB to the listener and waits until its
// subscription has reached the PUB (ZeroMQ's slow joiner): it sends
// messages on a topic no replica has until the listener counts one.
func (h *listenHarness) dialEngine(topic string) *engine {
	h.t.Helper()
	pub := zmq4.NewPub(h.ctx, zmq4.WithLogger(quietLogger))
	h.t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Dial(h.l.Endpoint()); err != nil {
		h.t.Fatalf("dial listener: %v", err)
	}
	before := h.l.Stats().Dropped["unknown_topic"]
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for h.l.Stats().Dropped["unknown_topic"] == before {
		if err := pub.Send(zmq4.NewMsgFrom([]byte("warmup@nobody"), make([]byte, 8), []byte{0x90})); err != nil {
			h.t.Fatalf("warm-up send: %v", err)
		}
		select {
		case <-tick.C:
		case <-h.changed:
		case <-deadline:
			h.t.Fatal("the listener never received the warm-up message")
		}
	}
	return &engine{h: h, pub: pub, topic: topic}
}

// send publishes events as batch seq, vLLM-encoded.
func (e *engine) send(seq uint64, events ...Event) {
	e.h.t.Helper()
	payload, err := EncodeBatch(Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: events}, EncodingArray)
	if err != nil {
		e.h.t.Fatal(err)
	}
	e.raw([]byte(e.topic), seqBytes(seq), payload)
}

func (e *engine) raw(frames ...[]byte) {
	e.h.t.Helper()
	if err := e.pub.Send(zmq4.NewMsgFrom(frames...)); err != nil {
		e.h.t.Fatalf("send: %v", err)
	}
}

func seqBytes(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

func TestListenerEnginesDialIn(t *testing.T) {
	h := newListenHarness(t, map[string]string{"10.0.0.1:8000": "a", "10.0.0.2:8000": "b"})
	a := h.dialEngine("kv@10.0.0.1:8000@qwen")
	b := h.dialEngine("kv@10.0.0.2:8000@qwen")

	pa, pb := toks(100, 12), toks(500, 8)
	a.send(0, BlockStored{BlockHashes: []uint64{11, 12}, TokenIDs: pa[:8], BlockSize: 4})
	b.send(0, BlockStored{BlockHashes: []uint64{21, 22}, TokenIDs: pb, BlockSize: 4})
	a.send(1, BlockStored{BlockHashes: []uint64{13}, ParentHash: 12, HasParent: true, TokenIDs: pa[8:], BlockSize: 4})
	h.waitFor("both replicas' batches", func() bool {
		return h.replica("a").LastSeq == 1 && h.replica("b").LastSeq == 0
	})
	for _, c := range []struct {
		replica string
		want    []blocks.Key
	}{{"a", blocks.Keys(nil, pa, 4)}, {"b", blocks.Keys(nil, pb, 4)}} {
		got := h.index.Keys(c.replica, MediumGPU)
		slices.Sort(got)
		want := slices.Clone(c.want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("index keys of %s = %v, want %v", c.replica, got, want)
		}
	}
	h.mu.Lock()
	first := slices.Clone(h.first)
	h.mu.Unlock()
	slices.Sort(first)
	if !reflect.DeepEqual(first, []string{"a", "b"}) {
		t.Errorf("OnFirstBatch calls = %v, want a and b once each", first)
	}
	if st := h.replica("a"); st.State != StateListening || st.Gaps != 0 || st.LostBatches != 0 {
		t.Errorf("replica a: state %q gaps %d lost %d; want listening, no gap", st.State, st.Gaps, st.LostBatches)
	}

	// A gap: seq 2 never arrives. It is counted, not replayed.
	a.send(3, BlockRemoved{BlockHashes: []uint64{13}})
	h.waitFor("seq 3 of a", func() bool { return h.replica("a").LastSeq == 3 })
	if st := h.replica("a"); st.Gaps != 1 || st.LostBatches != 1 || st.Replays != 0 {
		t.Errorf("after the gap: gaps %d lost %d replays %d; want 1, 1, 0", st.Gaps, st.LostBatches, st.Replays)
	}
	if got := h.index.Held("a")[MediumGPU]; got != 2 {
		t.Errorf("a holds %d GPU blocks after the removal, want 2", got)
	}

	// An unknown topic is counted and dropped.
	unknown := h.l.Stats().Dropped["unknown_topic"]
	stranger := &engine{h: h, pub: a.pub, topic: "kv@10.9.9.9:8000@qwen"}
	stranger.send(0, BlockStored{BlockHashes: []uint64{99}, TokenIDs: toks(900, 4), BlockSize: 4})
	h.waitFor("the stranger's message", func() bool { return h.l.Stats().Dropped["unknown_topic"] == unknown+1 })
	if got := h.l.Stats().Replicas; got != 2 {
		t.Errorf("streams = %d, want 2 (the stranger's message made none)", got)
	}

	// Garbage: two frames, a short seq, an undecodable payload. None stops
	// the listener; the next good batch applies.
	a.raw([]byte(a.topic), seqBytes(4))
	h.waitFor("the two-frame message", func() bool { return h.l.Stats().Dropped["bad_frame"] == 1 })
	a.raw([]byte(a.topic), []byte{1, 2, 3}, []byte{0x90})
	h.waitFor("the short seq", func() bool { return h.replica("a").Dropped["bad_frame"] == 1 })
	a.raw([]byte(a.topic), seqBytes(4), []byte{0xc1, 0xff, 0x00})
	h.waitFor("the undecodable batch", func() bool { return h.replica("a").Dropped["decode_error"] == 1 })
	a.send(5, BlockStored{BlockHashes: []uint64{31}, TokenIDs: toks(700, 4), BlockSize: 4})
	h.waitFor("seq 5 of a", func() bool { return h.replica("a").LastSeq == 5 })
	if got := h.index.Held("a")[MediumGPU]; got != 3 {
		t.Errorf("a holds %d GPU blocks after the garbage and seq 5, want 3", got)
	}
	if st := h.replica("b"); st.LastSeq != 0 || st.Gaps != 0 {
		t.Errorf("replica b touched by a's traffic: %+v", st)
	}

	// A restarted engine (seq back to 0) is cleared, as a Subscriber does.
	b.send(0, BlockStored{BlockHashes: []uint64{41}, TokenIDs: toks(800, 4), BlockSize: 4})
	h.waitFor("b's restart", func() bool { return h.replica("b").Restarts == 1 })
	if got := h.index.Keys("b", MediumGPU); !slices.Equal(got, blocks.Keys(nil, toks(800, 4), 4)) {
		t.Errorf("b's keys after its restart = %v, want only the new block", got)
	}
}

// A hostile peer on the listening socket (a frame header declaring 2^62
// bytes) is refused by the ZMTP guard; the engines' traffic goes on.
func TestListenerSurvivesHostilePeer(t *testing.T) {
	h := newListenHarness(t, map[string]string{"10.0.0.1:8000": "a"})
	a := h.dialEngine("kv@10.0.0.1:8000@m")
	a.send(0, BlockStored{BlockHashes: []uint64{1}, TokenIDs: toks(1, 4), BlockSize: 4})
	h.waitFor("seq 0", func() bool { return h.replica("a").LastSeq == 0 })

	c, err := net.Dial("tcp", strings.TrimPrefix(h.l.Endpoint(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := zmtpHandshake(c, "PUB"); err != nil {
		t.Fatalf("handshake: %v", err)
	}
	if _, err := c.Write(zmtpHeader(0, 1<<62)); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the guard's refusal", func() bool { return h.l.Stats().Refused["frame_too_large"] == 1 })

	// A peer of a socket type that cannot publish is refused too.
	c2, err := net.Dial("tcp", strings.TrimPrefix(h.l.Endpoint(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_ = zmtpHandshake(c2, "REQ")
	h.waitFor("the REQ peer's refusal", func() bool {
		n := 0
		for _, v := range h.l.Stats().Refused {
			n += int(v)
		}
		return n == 2
	})

	a.send(1, BlockStored{BlockHashes: []uint64{2}, ParentHash: 1, HasParent: true, TokenIDs: toks(5, 4), BlockSize: 4})
	h.waitFor("seq 1 after the hostile peers", func() bool { return h.replica("a").LastSeq == 1 })
}

func TestListenerConfigValidate(t *testing.T) {
	ok := ListenerConfig{Endpoint: "tcp://0.0.0.0:5557", Resolve: func(string) (string, bool) { return "", false }, Index: NewIndex()}
	for _, c := range []struct {
		name string
		edit func(*ListenerConfig)
		want string // "" valid
	}{
		{"valid", func(*ListenerConfig) {}, ""},
		{"ipc", func(c *ListenerConfig) { c.Endpoint = "ipc:///tmp/kv.sock" }, ""},
		{"no transport", func(c *ListenerConfig) { c.Endpoint = "0.0.0.0:5557" }, "not a ZeroMQ endpoint"},
		{"inproc", func(c *ListenerConfig) { c.Endpoint = "inproc://kv" }, "cannot be dialled"},
		{"wildcard host", func(c *ListenerConfig) { c.Endpoint = "tcp://*:5557" }, ""},
		{"no port", func(c *ListenerConfig) { c.Endpoint = "tcp://0.0.0.0" }, "want tcp://HOST:PORT"},
		{"bad port", func(c *ListenerConfig) { c.Endpoint = "tcp://0.0.0.0:http" }, "not a number"},
		{"no resolver", func(c *ListenerConfig) { c.Resolve = nil }, "Resolve is required"},
		{"no index", func(c *ListenerConfig) { c.Index = nil }, "Index is required"},
	} {
		cfg := ok
		c.edit(&cfg)
		err := cfg.Validate()
		if got := ""; err != nil {
			got = err.Error()
			if c.want == "" || !strings.Contains(got, c.want) {
				t.Errorf("%s: Validate = %q, want %q", c.name, got, c.want)
			}
		} else if c.want != "" {
			t.Errorf("%s: Validate = nil, want %q", c.name, c.want)
		}
	}
}

func TestListenerBindError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	l := NewListener(ListenerConfig{Endpoint: "tcp://" + ln.Addr().String(),
		Resolve: func(string) (string, bool) { return "", false }, Index: NewIndex()})
	err = l.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "bind") {
		t.Fatalf("Run on a taken port = %v, want a bind error", err)
	}
}

func TestTopicPod(t *testing.T) {
	for _, c := range []struct{ topic, want string }{
		{"kv@10.0.0.1:8000@Qwen/Qwen3-8B", "10.0.0.1:8000"},
		{"kv@pod-a@m@with@ats", "pod-a"},
		{"kv@@m", ""},
		{"kv@10.0.0.1:8000", ""},
		{"", ""},
	} {
		if got := TopicPod(c.topic); got != c.want {
			t.Errorf("TopicPod(%q) = %q, want %q", c.topic, got, c.want)
		}
	}
}
