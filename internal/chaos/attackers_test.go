package chaos

import (
	"context"
	binenc "encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The hostile column's attackers: peers and clients that misbehave on
// purpose, each owned by the test that starts it (a cleanup stops it) and
// bounded in connections and time.

// Modes of a kvFront.
const (
	kvPass   int32 = iota // relay to the engine's socket
	kvBomb                // greet as a PUB, then declare a 2^62-byte frame
	kvSilent              // accept the connection and never say a word
)

// kvFront stands in front of one of an engine's ZeroMQ sockets (the PUB or
// the replay ROUTER). In kvPass it relays bytes both ways; in kvBomb it
// answers every connection with a valid ZMTP 3.0 greeting and READY, then
// the header of a frame that declares 2^62 bytes (D1 of issue 26: zmq4
// allocates what a frame declares); in kvSilent it accepts and stays mute
// (D3: a handshake that never completes). A switch of mode closes every
// open connection, so that the router dials again and meets the new mode.
type kvFront struct {
	ln     net.Listener
	target string
	mode   atomic.Int32
	bombs  atomic.Int64 // connections answered with a bomb
	mutes  atomic.Int64 // connections held silent

	mu    sync.Mutex // guards conns
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// newKVFront listens on loopback in front of the engine socket at target
// ("127.0.0.1:port").
func newKVFront(t testing.TB, target string) *kvFront {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("chaos: kv front: %v", err)
	}
	f := &kvFront{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(f.Close)
	return f
}

// endpoint is the ZeroMQ endpoint of the front.
func (f *kvFront) endpoint() string { return "tcp://" + f.ln.Addr().String() }

// setMode switches the front and drops every connection it holds.
func (f *kvFront) setMode(m int32) {
	f.mode.Store(m)
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
}

// Close stops the front and waits for its goroutines.
func (f *kvFront) Close() {
	f.ln.Close()
	f.setMode(kvPass)
	f.wg.Wait()
}

func (f *kvFront) track(c net.Conn) {
	f.mu.Lock()
	f.conns[c] = struct{}{}
	f.mu.Unlock()
}

func (f *kvFront) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (f *kvFront) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.track(c)
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.untrack(c)
			switch f.mode.Load() {
			case kvBomb:
				f.bombs.Add(1)
				_, _ = c.Write(zmtpBomb())
				_, _ = io.Copy(io.Discard, c) // until the peer hangs up or the mode changes
			case kvSilent:
				f.mutes.Add(1)
				_, _ = io.Copy(io.Discard, c)
			default:
				f.relay(c)
			}
		}()
	}
}

// relay copies c to and from the target until either side ends.
func (f *kvFront) relay(c net.Conn) {
	up, err := net.DialTimeout("tcp", f.target, time.Second)
	if err != nil {
		return
	}
	f.track(up)
	defer f.untrack(up)
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
}

// zmtpBomb is what a hostile PUB sends: a ZMTP 3.0 greeting for the NULL
// mechanism (RFC 23/ZMTP: signature 0xFF, 8 bytes of padding, 0x7F;
// version 3.0; "NULL" padded to 20 bytes; as-server 0; 31 bytes of filler),
// a READY command naming socket type PUB, and the long-frame header of a
// message frame that declares 2^62 bytes of body.
func zmtpBomb() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xFF, 0x7F, 3
	copy(g[12:], "NULL")
	ready := []byte{5}
	ready = append(ready, "READY"...)
	ready = append(ready, byte(len("Socket-Type")))
	ready = append(ready, "Socket-Type"...)
	ready = binenc.BigEndian.AppendUint32(ready, 3)
	ready = append(ready, "PUB"...)
	out := append(g, 0x04, byte(len(ready))) // command, short size
	out = append(out, ready...)
	out = append(out, 0x02) // message, long size
	return binenc.BigEndian.AppendUint64(out, 1<<62)
}

// slowBodies holds n connections to addr, each with a request whose headers
// declare a body of declared bytes, of which it sends only a few (D2: a
// buffer sized from the declared length before a byte arrives). Each
// connection trickles a byte a second so that only the router's body
// deadline can end it; ended ones are opened again until stop.
type slowBodies struct {
	opened, refused atomic.Int64
	cancel          context.CancelFunc
	wg              sync.WaitGroup
}

func startSlowBodies(addr string, n int, declared int64) *slowBodies {
	ctx, cancel := context.WithCancel(context.Background())
	s := &slowBodies{cancel: cancel}
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{\"prompt\":\"", addr, declared)
	for range n {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			for ctx.Err() == nil {
				c, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp", addr)
				if err != nil {
					s.refused.Add(1)
					if !sleepCtx(ctx, 100*time.Millisecond) {
						return
					}
					continue
				}
				s.opened.Add(1)
				stop := context.AfterFunc(ctx, func() { c.Close() })
				_, err = io.WriteString(c, head)
				for err == nil && sleepCtx(ctx, time.Second) {
					_, err = io.WriteString(c, "a")
				}
				stop()
				c.Close()
			}
		}()
	}
	return s
}

// stop closes every connection and waits for the goroutines.
func (s *slowBodies) stop() {
	s.cancel()
	s.wg.Wait()
}

// zeroWindow holds n streaming requests whose clients never read their
// responses, with a receive buffer as small as the kernel allows (D4: a
// write to the client that never completes holds the request's slot and
// its replica request). Each request carries fatHeader, so that its
// replica streams fast enough to fill the sockets between them.
type zeroWindow struct {
	opened, failed atomic.Int64
	cancel         context.CancelFunc
	wg             sync.WaitGroup
}

func startZeroWindow(addr string, n int, body string) *zeroWindow {
	ctx, cancel := context.WithCancel(context.Background())
	z := &zeroWindow{cancel: cancel}
	// fatHeader: the replica answers a large stream quickly (faults_test.go).
	req := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s: 1\r\nContent-Length: %d\r\n\r\n%s", addr, fatHeader, len(body), body)
	d := &net.Dialer{Timeout: time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 1024)
		}); err != nil {
			return err
		}
		return serr
	}}
	for range n {
		z.wg.Add(1)
		go func() {
			defer z.wg.Done()
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				z.failed.Add(1)
				return
			}
			z.opened.Add(1)
			defer c.Close()
			if _, err := io.WriteString(c, req); err != nil {
				z.failed.Add(1)
				return
			}
			<-ctx.Done() // never read
		}()
	}
	return z
}

func (z *zeroWindow) stop() {
	z.cancel()
	z.wg.Wait()
}

// sleepCtx sleeps d unless ctx ends first; it reports whether it slept.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// rssSampler reads a process's resident memory every interval until
// stopped, keeping the peak.
type rssSampler struct {
	peak, last atomic.Int64
	samples    atomic.Int64
	cancel     context.CancelFunc
	done       chan struct{}
}

func sampleRSS(pid int, every time.Duration) *rssSampler {
	ctx, cancel := context.WithCancel(context.Background())
	s := &rssSampler{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			if st, err := readProcStats(pid); err == nil {
				s.samples.Add(1)
				s.last.Store(st.RSSBytes)
				if st.RSSBytes > s.peak.Load() {
					s.peak.Store(st.RSSBytes)
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

func (s *rssSampler) stop() {
	s.cancel()
	<-s.done
}

// bigBodies holds n connections to addr, each with a request declaring a
// body of declared bytes and sending sent of them at once, then nothing:
// the body memory a router takes as fast as the attacker can send, held
// until its body deadline (D2 at speed, beside slowBodies' trickle).
type bigBodies struct {
	opened, sentAll atomic.Int64
	done            atomic.Int64 // connections that sent all or were refused
	cancel          context.CancelFunc
	wg              sync.WaitGroup
}

func startBigBodies(addr string, n int, declared, sent int64) *bigBodies {
	ctx, cancel := context.WithCancel(context.Background())
	b := &bigBodies{cancel: cancel}
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{\"prompt\":\"", addr, declared)
	chunk := make([]byte, 64<<10)
	for i := range chunk {
		chunk[i] = 'a'
	}
	for range n {
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			if c := b.send(ctx, addr, head, chunk, sent); c != nil {
				b.done.Add(1)
				<-ctx.Done() // hold it, the body unfinished
				c.Close()
				return
			}
			b.done.Add(1)
		}()
	}
	return b
}

// send opens one connection and sends the head and sent bytes of body; it
// returns the connection, still open, or nil if the router refused it.
func (b *bigBodies) send(ctx context.Context, addr, head string, chunk []byte, sent int64) net.Conn {
	c, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil
	}
	b.opened.Add(1)
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if _, err := io.WriteString(c, head); err != nil {
		c.Close()
		return nil
	}
	for left := sent; left > 0; left -= int64(len(chunk)) {
		if _, err := c.Write(chunk[:min(left, int64(len(chunk)))]); err != nil {
			c.Close() // refused (429) and closed
			return nil
		}
	}
	b.sentAll.Add(1)
	return c
}

func (b *bigBodies) stop() {
	b.cancel()
	b.wg.Wait()
}
