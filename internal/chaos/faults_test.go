package chaos

import (
	"bytes"
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

// tcpProxy is a TCP relay on loopback in front of one address. It can slow
// every chunk it relays (a slow replica), hold every byte for a fixed time (a
// network's one-way latency), cut every connection, and refuse new ones (a
// cut link). Bytes leave in the order they came, whatever the setting. The
// test that creates it owns it; it stops, with every relay goroutine, at
// Close (registered as a cleanup).
type tcpProxy struct {
	ln      net.Listener
	target  string
	delay   atomic.Int64 // nanoseconds waited after reading each chunk, before reading the next
	latency atomic.Int64 // nanoseconds each chunk is held after it was read, without slowing the reads
	refuse  atomic.Bool  // close new connections at once
	stop    chan struct{}
	wg      sync.WaitGroup // the accept loop and the relays

	mu        sync.Mutex // guards conns and relatency
	conns     map[net.Conn]struct{}
	relatency chan struct{} // closed (and replaced) when the latency changes
}

// newTCPProxy starts a relay to target.
func newTCPProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("chaos: tcp proxy listen: %v", err)
	}
	p := &tcpProxy{ln: ln, target: target, stop: make(chan struct{}), conns: make(map[net.Conn]struct{}),
		relatency: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// addr is the relay's host:port.
func (p *tcpProxy) addr() string { return p.ln.Addr().String() }

// setDelay sets the delay added to each relayed chunk. The delays add up: a
// response of n chunks takes n×d longer, as from a replica that is slow to
// produce each one.
func (p *tcpProxy) setDelay(d time.Duration) { p.delay.Store(int64(d)) }

// setLatency sets the time each chunk is held, in each direction, from when
// it was read: a link's one-way delay. Unlike setDelay it does not limit the
// throughput; chunks still leave in order. A chunk already held leaves at its
// read time plus the new latency (0: at once).
func (p *tcpProxy) setLatency(d time.Duration) {
	p.mu.Lock()
	p.latency.Store(int64(d))
	close(p.relatency)
	p.relatency = make(chan struct{})
	p.mu.Unlock()
}

// hold waits until c has been held the latency in force; false if the relay
// was closed first.
func (p *tcpProxy) hold(c chunk) bool {
	if p.latency.Load() == 0 {
		return true
	}
	for {
		p.mu.Lock()
		changed := p.relatency
		p.mu.Unlock()
		d := time.Until(c.at.Add(time.Duration(p.latency.Load())))
		if d <= 0 {
			return true
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
			return true
		case <-changed: // wait again, for the new latency
			t.Stop()
		case <-p.stop:
			t.Stop()
			return false
		}
	}
}

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

// chunk is what one read returned, and when it is ready to be sent on.
type chunk struct {
	b  []byte
	at time.Time
}

// copy relays src to dst: its reader waits the configured delay after each
// chunk it reads and queues the chunk; a writer goroutine, owned by copy and
// joined before it returns, sends each chunk on once it has been held the
// latency. A write error closes src, which ends the read; the
// end of src is passed on (a half-close) once every chunk has been sent.
func (p *tcpProxy) copy(dst, src net.Conn) {
	q := make(chan chunk, 1024)
	wdone := make(chan struct{})
	go func() {
		defer close(wdone)
		for c := range q {
			if !p.hold(c) {
				return
			}
			if _, err := dst.Write(c.b); err != nil {
				src.Close()
				return
			}
		}
	}()
	eof := p.read(src, q, wdone)
	close(q)
	<-wdone
	if tc, ok := dst.(*net.TCPConn); ok && eof {
		_ = tc.CloseWrite()
	}
}

// read queues what src sends until it ends (true: at EOF), the writer
// stops, or the relay is closed.
func (p *tcpProxy) read(src net.Conn, q chan<- chunk, wdone <-chan struct{}) (eof bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := time.Duration(p.delay.Load()); d > 0 && !p.wait(d) {
				return false
			}
			select {
			case q <- chunk{b: bytes.Clone(buf[:n]), at: time.Now()}:
			case <-wdone:
				return false
			case <-p.stop:
				return false
			}
		}
		if err != nil {
			return err == io.EOF
		}
	}
}

// wait waits d (the injected fault's timing); false if the relay was closed
// first.
func (p *tcpProxy) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-p.stop:
		return false
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
	// fat counts the requests answered with a fat stream (fatHeader),
	// fatBytes the bytes written to them.
	fat, fatBytes atomic.Int64
}

// fatHeader, on a streamed inference request, makes a front answer with
// fatStreamBytes of SSE as fast as the router takes them, whatever its
// mode: a replica whose answer is large and quick (a long answer with
// logprobs, say), so that a client that stops reading fills the sockets
// between them within seconds rather than after minutes of decoding. The
// router forwards client headers, so an attacker's request carries it.
const (
	fatHeader      = "X-Chaos-Fat-Stream"
	fatStreamBytes = 24 << 20
)

// newFront starts a front forwarding to the engine at target.
func newFront(t testing.TB, target string) *front {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatalf("chaos: front target: %v", err)
	}
	f := &front{rp: httputil.NewSingleHostReverseProxy(u), stop: make(chan struct{})}
	f.rp.FlushInterval = -1
	// A transport of its own, which keeps a connection per stream in
	// flight: the shared default keeps 2 idle a host and churns the rest.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 256
	f.rp.Transport = tr
	f.rp.ErrorLog = log.New(io.Discard, "", 0) // cancelled streams are expected
	f.srv = httptest.NewServer(f)
	t.Cleanup(func() {
		close(f.stop)
		f.srv.Close()
		tr.CloseIdleConnections()
	})
	return f
}

// setMode switches the front's behaviour.
func (f *front) setMode(m int32) { f.mode.Store(m) }

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	inference := strings.HasPrefix(r.URL.Path, "/v1/") && r.Method == http.MethodPost
	if inference && r.Header.Get(fatHeader) != "" {
		f.serveFat(w, r)
		return
	}
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
	// The body is read whole before the proxy starts: net/http may refuse
	// reads of a request body once the response has begun, and the
	// Transport, reading past the declared length for EOF after the engine
	// has already answered, would then tear down the engine connection
	// mid-stream (a cut the router would blame on the replica).
	if r.Body != nil {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(b))
	}
	f.rp.ServeHTTP(w, r)
}

// serveFat answers a streamed completion with fatStreamBytes of text
// events of 4 KiB, then usage and [DONE], until the router stops taking
// them or goes away.
func (f *front) serveFat(w http.ResponseWriter, r *http.Request) {
	f.fat.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	ev := []byte(`data: {"id":"cmpl-fat","object":"text_completion","model":"m","choices":[{"index":0,"text":"` +
		strings.Repeat("x", 4<<10) + `","finish_reason":null}]}` + "\n\n")
	fl := w.(http.Flusher)
	for sent := 0; sent < fatStreamBytes; sent += len(ev) {
		if _, err := w.Write(ev); err != nil {
			return
		}
		fl.Flush()
		f.fatBytes.Add(int64(len(ev)))
		select {
		case <-r.Context().Done():
			return
		case <-f.stop:
			return
		default:
		}
	}
	_, _ = io.WriteString(w, `data: {"id":"cmpl-fat","object":"text_completion","model":"m","choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":6000,"total_tokens":6008}}`+"\n\ndata: [DONE]\n\n")
}
