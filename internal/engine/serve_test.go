package engine

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/kvevents"
)

func TestKVOptionsPublisherConfig(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	pc, err := KVOptions{Endpoint: "tcp://*:5557", Encoding: "array"}.PublisherConfig("127.0.0.1:8001", "m", log)
	if err != nil {
		t.Fatal(err)
	}
	if pc.Dial || pc.ReplayEndpoint != "tcp://*:5558" || pc.Topic != "kv@127.0.0.1:8001@m" || pc.Encoding != kvevents.EncodingArray || pc.ReplayTopicFrame {
		t.Errorf("bound, defaults: %+v", pc)
	}
	pc, err = KVOptions{Endpoint: "tcp://10.0.0.1:5557", Replay: "tcp://*:6000", Encoding: "map", Topic: "t"}.PublisherConfig("l", "m", log)
	if err != nil {
		t.Fatal(err)
	}
	if !pc.Dial || pc.ReplayEndpoint != "tcp://*:6000" || pc.Topic != "t" || pc.Encoding != kvevents.EncodingMap || !pc.ReplayTopicFrame {
		t.Errorf("dialled, given: %+v", pc)
	}
	if pc, err = (KVOptions{Endpoint: "tcp://127.0.0.1:5557", Bind: true, Encoding: "array"}).PublisherConfig("l", "m", log); err != nil || pc.Dial {
		t.Errorf("--kv-bind: %v %+v", err, pc)
	}
	if _, err := (KVOptions{Endpoint: "tcp://*:5557", Encoding: "cbor"}).PublisherConfig("l", "m", log); err == nil ||
		err.Error() != `engine: --kv-encoding must be array or map, got "cbor"` {
		t.Errorf("bad encoding: %v", err)
	}
}

func TestServeConfigErrors(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	base := ServeConfig{Engine: DefaultConfig(), Listen: "127.0.0.1:0", Profile: "llama3.1-8b-h100", KV: KVOptions{Encoding: "array"}}
	base.Engine.TimeScale = 1
	for _, tc := range []struct {
		edit func(*ServeConfig)
		want string
	}{
		{func(c *ServeConfig) { c.Engine.TimeScale = 0 }, "engine: --time-scale must be positive, got 0"},
		{func(c *ServeConfig) { c.Profile = "nope" }, "engine: --profile: costmodel: unknown profile"},
		{func(c *ServeConfig) { c.Tokenizer = "/nonexistent" }, "engine: --tokenizer: "},
		{func(c *ServeConfig) { c.KV.Topic = "t" }, "engine: --kv-replay and --kv-topic need --kv-events"},
		{func(c *ServeConfig) { c.KV.Endpoint, c.KV.Encoding = "tcp://*:5557", "cbor" }, "engine: --kv-encoding must be array or map"},
		{func(c *ServeConfig) { c.Listen = "127.0.0.1:-1" }, "engine: listen: "},
	} {
		c := base
		tc.edit(&c)
		if err := Serve(context.Background(), c, log); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("error %v, want %q", err, tc.want)
		}
	}
}

func testEngine(t *testing.T, edit func(*Config)) *Engine {
	t.Helper()
	cfg := testConfig(t)
	if edit != nil {
		edit(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// TestServeShutdown: serve answers until its context ends, then shuts down
// and returns nil.
func TestServeShutdown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- serve(ctx, testEngine(t, nil), ln, time.Second, slog.New(slog.NewTextHandler(&logs, nil)))
	}()
	// /health is 503 until the engine's loop has started (serve starts
	// it beside the listener): wait for it, as a readiness probe would.
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get("http://" + ln.Addr().String() + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/health: %s after 5s", resp.Status)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return")
	}
	if !strings.Contains(logs.String(), `msg="engine shutting down" timeout=1s`) {
		t.Errorf("logs %q", logs.String())
	}
}

// failingPublisher is a KV publisher whose sockets cannot be bound: the
// engine's Run fails at once.
type failingPublisher struct{ ready chan struct{} }

func (p failingPublisher) Publish([]kvevents.Event, float64) (uint64, error) { return 0, nil }
func (p failingPublisher) Run(ctx context.Context) error {
	close(p.ready)
	return errors.New("bind: address already in use")
}
func (p failingPublisher) Ready() <-chan struct{} { return p.ready }
func (p failingPublisher) Endpoint() string       { return "" }

// TestServeEngineFails: an engine that stops first ends serve with its
// error, without waiting for the context.
func TestServeEngineFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := testEngine(t, func(c *Config) { c.KVPublisher = failingPublisher{make(chan struct{})} })
	done := make(chan error, 1)
	go func() {
		done <- serve(context.Background(), e, ln, time.Second, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "engine: run: kv events: bind: address already in use") {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return")
	}
}

// TestServeListenerFails: a server that stops first ends serve with its
// error.
func TestServeListenerFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	done := make(chan error, 1)
	go func() {
		done <- serve(context.Background(), testEngine(t, nil), ln, time.Second, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	select {
	case err := <-done:
		if err == nil || !strings.HasPrefix(err.Error(), "engine: serve: ") {
			t.Errorf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return")
	}
}
