package chaos

import (
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// tcpProxy is a TCP relay on loopback in front of one address. It can delay
// every chunk it relays (a slow network or replica), cut every connection,
// and refuse new ones (a cut link). The test that creates it owns it; it
// stops, with every relay goroutine, at Close (registered as a cleanup).
type tcpProxy struct {
	ln     net.Listener
	target string
	delay  atomic.Int64 // nanoseconds added before relaying each chunk
	refuse atomic.Bool  // close new connections at once
	stop   chan struct{}
	wg     sync.WaitGroup // the accept loop and the relays

	mu    sync.Mutex // guards conns
	conns map[net.Conn]struct{}
}

// newTCPProxy starts a relay to target.
func newTCPProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("chaos: tcp proxy listen: %v", err)
	}
	p := &tcpProxy{ln: ln, target: target, stop: make(chan struct{}), conns: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// addr is the relay's host:port.
func (p *tcpProxy) addr() string { return p.ln.Addr().String() }

// setDelay sets the delay added to each relayed chunk.
func (p *tcpProxy) setDelay(d time.Duration) { p.delay.Store(int64(d)) }

// cut closes every connection; with refuse set, new ones are closed at once
// until it is cleared.
func (p *tcpProxy) cut(refuse bool) {
	p.refuse.Store(refuse)
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// heal accepts connections again.
func (p *tcpProxy) heal() { p.refuse.Store(false) }

// Close stops the relay and waits for its goroutines.
func (p *tcpProxy) Close() {
	select {
	case <-p.stop:
		return
	default:
	}
	close(p.stop)
	p.ln.Close()
	p.cut(true)
	p.wg.Wait()
}

func (p *tcpProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.stop:
		return false
	default:
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *tcpProxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

func (p *tcpProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		if p.refuse.Load() {
			c.Close()
			continue
		}
		p.wg.Add(1)
		go p.relay(c)
	}
}

// relay connects c to the target and copies both ways until either side
// ends or the relay is cut.
func (p *tcpProxy) relay(c net.Conn) {
	defer p.wg.Done()
	if !p.track(c) {
		c.Close()
		return
	}
	defer p.untrack(c)
	up, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		return
	}
	if !p.track(up) {
		up.Close()
		return
	}
	defer p.untrack(up)
	done := make(chan struct{}, 2)
	go func() { p.copy(up, c); done <- struct{}{} }()
	go func() { p.copy(c, up); done <- struct{}{} }()
	<-done
	c.Close()
	up.Close()
	<-done
}

// copy relays src to dst, waiting the configured delay before each chunk
// (the injected fault's timing, interrupted by Close).
func (p *tcpProxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := time.Duration(p.delay.Load()); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-p.stop:
					t.Stop()
					return
				}
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok && err == io.EOF {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// Modes of a front.
const (
	modePass    int32 = iota // forward to the engine
	modeHang                 // accept, read the request, never answer
	modeFail500              // answer inference with 500 (health stays ok)
	modeGarbage              // answer inference with a stream that is not SSE JSON
)

// front is a replica's HTTP face whose behaviour the test switches: it
// forwards to an engine, or hangs, answers 500s or garbage. It listens on
// loopback (httptest) and is closed by a cleanup, hung handlers first.
type front struct {
	srv  *httptest.Server
	rp   *httputil.ReverseProxy
	mode atomic.Int32
	n    atomic.Int64 // inference requests answered in a fault mode
	stop chan struct{}
}

// newFront starts a front forwarding to the engine at target.
func newFront(t testing.TB, target string) *front {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatalf("chaos: front target: %v", err)
	}
	f := &front{rp: httputil.NewSingleHostReverseProxy(u), stop: make(chan struct{})}
	f.rp.FlushInterval = -1
	f.rp.ErrorLog = log.New(io.Discard, "", 0) // cancelled streams are expected
	f.srv = httptest.NewServer(f)
	t.Cleanup(func() {
		close(f.stop)
		f.srv.Close()
	})
	return f
}

// setMode switches the front's behaviour.
func (f *front) setMode(m int32) { f.mode.Store(m) }

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	inference := strings.HasPrefix(r.URL.Path, "/v1/") && r.Method == http.MethodPost
	switch f.mode.Load() {
	case modeHang:
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-f.stop:
		}
		return
	case modeFail500:
		if inference {
			f.n.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprintf(w, `{"error":{"message":"chaos: injected 500 by replica %s","type":"internal_error","code":500}}`, f.srv.Listener.Addr())
			return
		}
	case modeGarbage:
		if inference {
			k := f.n.Add(1)
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			if k%2 == 0 {
				// One good token first: the router has started the
				// client's stream and must end it with an error event.
				_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"ok"}]}`+"\n\n")
				w.(http.Flusher).Flush()
			}
			_, _ = io.WriteString(w, "data: \x00\x01garbage{{{"+strconv.FormatInt(k, 10)+"\n\n")
			return
		}
	}
	f.rp.ServeHTTP(w, r)
}
