// Package zmtpguard bounds what a ZeroMQ peer can make go-zeromq/zmq4 do.
//
// zmq4 v0.17.0 has no maximum message size: its reader allocates whatever
// size a frame header declares (conn.go, Conn.read: make([]byte, size)), so
// ten bytes declaring 2^62 panic the process in zmq4's own goroutine, where
// nothing of ours can recover it. Its Dial and accept loop run the ZMTP
// handshake with no deadline (socket.go), so a peer that accepts TCP and
// never greets blocks a dial for ever, and one idle connection blocks a
// listener's serial accept loop for every later peer.
//
// The guard keeps zmq4 as the protocol engine and wraps the transport under
// it: init registers it with zmq4.RegisterTransport as "zmtpguard-tcp" and
// "zmtpguard-ipc", Endpoint maps "tcp://" and "ipc://" endpoints to them,
// and WithConfig passes each socket its Config in the socket's context.
// Every connection's inbound bytes pass a Scanner before zmq4 reads them;
// see conn and listener for the deadlines.
package zmtpguard

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	zmqtransport "github.com/go-zeromq/zmq4/transport"
)

// The transport names the guard registers with zmq4.
const (
	SchemeTCP = "zmtpguard-tcp"
	SchemeIPC = "zmtpguard-ipc"
)

func init() {
	for name, network := range map[string]string{SchemeTCP: "tcp", SchemeIPC: "unix"} {
		if err := zmq4.RegisterTransport(name, guardTransport{network: network}); err != nil {
			panic(fmt.Sprintf("zmtpguard: register transport %s: %v", name, err))
		}
	}
}

// Endpoint maps a "tcp://" or "ipc://" endpoint to the guarded transport;
// any other endpoint is returned unchanged.
func Endpoint(ep string) string {
	for from, to := range map[string]string{"tcp://": SchemeTCP + "://", "ipc://": SchemeIPC + "://"} {
		if rest, ok := strings.CutPrefix(ep, from); ok {
			return to + rest
		}
	}
	return ep
}

// guardTransport is a zmq4 transport over network ("tcp" or "unix").
type guardTransport struct{ network string }

var _ zmqtransport.Transport = guardTransport{}

// Dial connects to addr and starts the handshake deadline. The connection
// is closed when ctx (the zmq4 socket's) ends, so closing the socket ends a
// dial blocked in zmq4's handshake at once.
func (t guardTransport) Dial(ctx context.Context, d zmqtransport.Dialer, addr string) (net.Conn, error) {
	cfg := configFrom(ctx)
	nc, err := d.DialContext(ctx, t.network, addr)
	if err != nil {
		return nil, err
	}
	c := newConn(nc, cfg)
	_ = nc.SetDeadline(time.Now().Add(cfg.HandshakeTimeout))
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	c.stop.Store(&stop)
	if cfg.OnConnect != nil {
		cfg.OnConnect()
	}
	return c, nil
}

// Listen listens on addr; see listener.
func (t guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := net.Listen(t.network, addr)
	if err != nil {
		return nil, err
	}
	return newListener(ctx, ln, configFrom(ctx)), nil
}

// Addr resolves an endpoint's address as zmq4's own transport does.
func (t guardTransport) Addr(ep string) (string, error) {
	return zmqtransport.New(t.network).Addr(ep)
}

// listener accepts in its own goroutine and runs each peer's side of the
// handshake concurrently, under HandshakeTimeout: it sends the greeting zmq4
// would send (a libzmq peer waits for our signature before it sends its
// whole greeting), reads the peer's greeting and READY through the Scanner,
// and only then hands the connection to zmq4's serial accept loop, whose
// handshake then finds every byte it reads already buffered. A slow, silent
// or hostile peer is dropped at the deadline and delays no one else.
type listener struct {
	ln    net.Listener
	cfg   Config
	ready chan *conn    // handshaken connections for Accept
	done  chan struct{} // closed by Close
	slots chan struct{} // one per handshake in progress
	wg    sync.WaitGroup

	mu      sync.Mutex  // guards pending, closed and stop
	stop    func() bool // stops the AfterFunc on the socket's context
	pending map[net.Conn]struct{}
	closed  bool
}

func newListener(ctx context.Context, ln net.Listener, cfg Config) *listener {
	l := &listener{
		ln:      ln,
		cfg:     cfg,
		ready:   make(chan *conn),
		done:    make(chan struct{}),
		slots:   make(chan struct{}, cfg.MaxHandshakes),
		pending: make(map[net.Conn]struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	stop := context.AfterFunc(ctx, func() { _ = l.Close() })
	l.mu.Lock()
	l.stop = stop
	l.mu.Unlock()
	return l
}

// Accept returns the next connection whose handshake bytes are buffered.
func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.done:
		return nil, errClosed
	}
}

// Addr is the listening address.
func (l *listener) Addr() net.Addr { return l.ln.Addr() }

// Close stops accepting, closes the handshakes in progress and waits for
// the listener's goroutines.
func (l *listener) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	for nc := range l.pending {
		_ = nc.Close()
	}
	if l.stop != nil {
		l.stop()
	}
	l.mu.Unlock()
	err := l.ln.Close()
	l.wg.Wait()
	return err
}

// acceptLoop owns the network listener until Close.
func (l *listener) acceptLoop() {
	defer l.wg.Done()
	var backoff time.Duration
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			// As net/http's Server.Serve: back off on errors such as
			// EMFILE instead of spinning.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			t := time.NewTimer(backoff)
			select {
			case <-l.done:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		backoff = 0
		select {
		case l.slots <- struct{}{}:
		default:
			_ = nc.Close()
			l.refuse(refuse(ReasonTooManyPending, "%d handshakes in progress; %s dropped", cap(l.slots), nc.RemoteAddr()))
			continue
		}
		if !l.track(nc) {
			_ = nc.Close()
			<-l.slots
			return
		}
		l.wg.Add(1)
		go l.handshake(nc)
	}
}

func (l *listener) refuse(e *Error) {
	if l.cfg.OnRefuse != nil {
		l.cfg.OnRefuse(e)
	}
}

// track records nc as pending; false once the listener is closed.
func (l *listener) track(nc net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.pending[nc] = struct{}{}
	return true
}

func (l *listener) untrack(nc net.Conn) {
	l.mu.Lock()
	delete(l.pending, nc)
	l.mu.Unlock()
}

// handshake runs the peer's side of the handshake on nc and hands the
// connection to Accept.
func (l *listener) handshake(nc net.Conn) {
	defer l.wg.Done()
	defer func() { <-l.slots }()
	defer l.untrack(nc)
	c := newConn(nc, l.cfg)
	_ = nc.SetDeadline(time.Now().Add(l.cfg.HandshakeTimeout))
	if _, err := nc.Write(zmq4Greeting[:]); err != nil {
		if isTimeout(err) {
			_ = c.fail(refuse(ReasonHandshakeTimeout, "%s read no greeting within %v", nc.RemoteAddr(), l.cfg.HandshakeTimeout))
		}
		_ = c.Close()
		return
	}
	c.swallow = zmq4Greeting[:]
	var buf [512]byte
	c.rmu.Lock()
	for !c.scan.Handshaken() {
		n, err := c.readScanned(buf[:])
		c.pre = append(c.pre, buf[:n]...)
		if err != nil {
			c.rmu.Unlock()
			_ = c.Close()
			return
		}
	}
	peer := c.scan.PeerType()
	c.rmu.Unlock()
	if len(l.cfg.PeerTypes) > 0 && !contains(l.cfg.PeerTypes, peer) {
		_ = c.fail(refuse(ReasonIncompatiblePeer, "%s is a %q socket, want one of %v", nc.RemoteAddr(), peer, l.cfg.PeerTypes))
		return
	}
	select {
	case l.ready <- c:
	case <-l.done:
		_ = c.Close()
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
