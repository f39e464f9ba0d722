package proxy

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/zmtpguard"
)

// Hostile KV-event endpoints against `prefixlb serve` (issue 26, D1 and D3).

// kvPeer listens on loopback and runs serve on each connection; accepted
// receives each connection's arrival.
func kvPeer(t *testing.T, serve func(net.Conn)) (addr string, accepted <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	acc := make(chan struct{}, 100)
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
			select {
			case acc <- struct{}{}:
			default:
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(60 * time.Second))
				serve(c)
			}()
		}
	}()
	return ln.Addr().String(), acc
}

// startServe runs RunAndServe (as `prefixlb serve`) over one replica whose
// KV events come from kvAddr; cancel is SIGTERM.
func startServe(t *testing.T, kvAddr string, drain time.Duration) (p *Proxy, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	replica := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	t.Cleanup(replica.Close)
	cfg := DefaultConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: replica.URL, KVEvents: "tcp://" + kvAddr, KVReplay: "tcp://" + kvAddr}}
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.DrainTimeout = drain
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- p.RunAndServe(ctx, ln) }()
	t.Cleanup(cancel)
	return p, cancel, errc
}

// stream is replica r0's subscriber stats.
func stream(p *Proxy) kvevents.Stats {
	for _, r := range p.CacheView().Replicas {
		if r.Stream != nil {
			return *r.Stream
		}
	}
	return kvevents.Stats{}
}

// eventually polls cond (the proxy offers no event to wait on) for 20s.
func eventually(t *testing.T, what string, p *Proxy, cond func(kvevents.Stats) bool) bool {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for !cond(stream(p)) {
		select {
		case <-tick.C:
		case <-deadline:
			t.Errorf("timed out waiting for %s; /debug/cache stream %+v", what, stream(p))
			return false
		}
	}
	return true
}

// stopsWithin cancels and checks RunAndServe returns within bound.
func stopsWithin(t *testing.T, cancel context.CancelFunc, done <-chan error, bound time.Duration) {
	t.Helper()
	cancel()
	start := time.Now()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("RunAndServe: %v", err)
		}
		if d := time.Since(start); d > bound {
			t.Errorf("RunAndServe took %v to stop, want < %v", d, bound)
		}
	case <-time.After(bound + 5*time.Second):
		t.Fatalf("RunAndServe still running %v after SIGTERM: the drain timeout (%v) is ignored", bound+5*time.Second, bound)
	}
}

func TestSilentKVPeerDoesNotHoldShutdown(t *testing.T) {
	// D3: the KV endpoint accepts TCP and never greets. /debug/cache shows
	// the subscriber handshaking, and SIGTERM completes within the drain
	// timeout, although the 5s handshake timeout has not passed.
	addr, accepted := kvPeer(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	const drain = 2 * time.Second
	p, cancel, done := startServe(t, addr, drain)
	select {
	case <-accepted:
	case <-time.After(20 * time.Second):
		t.Fatal("the subscriber never connected to the KV endpoint")
	}
	eventually(t, "state handshaking", p, func(st kvevents.Stats) bool { return st.State == kvevents.StateHandshaking })
	stopsWithin(t, cancel, done, drain)
}

func TestHostileKVPeerDoesNotCrashServe(t *testing.T) {
	// D1: every connection to the KV endpoint gets a valid handshake, then
	// a frame header declaring 2^62 bytes. serve counts, re-dials, keeps
	// serving, and stops on SIGTERM.
	addr, _ := kvPeer(t, func(c net.Conn) {
		go c.Write(append(kvGreeting(), kvReady("PUB")...)) //nolint:errcheck // seen in the read
		var hs [64 + 2]byte                                 // its greeting and READY's header
		if _, err := io.ReadFull(c, hs[:]); err != nil {
			return
		}
		if _, err := io.ReadFull(c, make([]byte, hs[65])); err != nil {
			return
		}
		c.Write([]byte{0x02, 0x40, 0, 0, 0, 0, 0, 0, 0}) // LONG, 2^62
		io.Copy(io.Discard, c)
	})
	const drain = 2 * time.Second
	p, cancel, done := startServe(t, addr, drain)
	eventually(t, "two refusals", p, func(st kvevents.Stats) bool {
		return st.Refused[zmtpguard.ReasonFrameTooLarge] >= 2 && st.Redials >= 2
	})
	stopsWithin(t, cancel, done, drain)
}

func kvGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xFF, 0x7F, 3
	copy(g[12:], "NULL")
	return g
}

func kvReady(typ string) []byte {
	body := []byte("\x05READY\x0bSocket-Type")
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	body = append(body, typ...)
	return append([]byte{0x04, byte(len(body))}, body...)
}
