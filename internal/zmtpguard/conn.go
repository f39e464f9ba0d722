package zmtpguard

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// zmq4Greeting is the greeting go-zeromq/zmq4 v0.17.0 writes (conn.go,
// Conn.greet: version 3.0, mechanism NULL, as-server never set). A
// listener sends it for zmq4 before the handshake and swallows zmq4's own
// copy; TestZMQ4GreetingPinned checks that zmq4 still writes these bytes.
var zmq4Greeting = func() [greetingLen]byte {
	var g [greetingLen]byte
	g[0], g[9], g[10], g[11] = 0xFF, 0x7F, 3, 0
	copy(g[12:32], "NULL")
	return g
}()

// conn is one guarded connection: zmq4's reads go through the Scanner and
// fail, closing the connection, on what it refuses; a handshake deadline
// holds until the peer's READY has passed; writes after it have
// WriteTimeout. Any I/O error closes the connection: zmq4 does not close
// one whose handshake fails (socket.go, Dial and accept).
type conn struct {
	nc  net.Conn
	cfg Config

	rmu  sync.Mutex // guards scan and pre (zmq4 reads from one goroutine; this is belt and braces)
	scan *Scanner
	pre  []byte // a listener's pre-read handshake, replayed to zmq4 first

	wmu     sync.Mutex // guards swallow
	swallow []byte     // a listener's greeting, already sent: zmq4's copy is dropped

	handshaken atomic.Bool
	failed     atomic.Pointer[Error]
	closeOnce  sync.Once
	closeErr   error
	stop       atomic.Pointer[func() bool] // stops the context.AfterFunc that closes it
}

func newConn(nc net.Conn, cfg Config) *conn {
	return &conn{nc: nc, cfg: cfg, scan: NewScanner(cfg.Limits)}
}

// Read hands zmq4 the peer's bytes once the scanner has passed them.
func (c *conn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if e := c.failed.Load(); e != nil {
		return 0, e
	}
	if len(c.pre) > 0 {
		n := copy(p, c.pre)
		c.pre = c.pre[n:]
		if len(c.pre) == 0 {
			c.pre = nil
		}
		return n, nil
	}
	return c.readScanned(p)
}

// readScanned reads from the network and scans what came (rmu held).
func (c *conn) readScanned(p []byte) (int, error) {
	n, err := c.nc.Read(p)
	if n > 0 {
		was := c.scan.Handshaken()
		if serr := c.scan.Scan(p[:n]); serr != nil {
			return 0, c.fail(serr.(*Error))
		}
		if !was && c.scan.Handshaken() {
			c.endHandshake()
		}
	}
	if err != nil {
		if isTimeout(err) && !c.handshaken.Load() {
			return 0, c.fail(refuse(ReasonHandshakeTimeout, "no READY from %s within %v", c.nc.RemoteAddr(), c.cfg.HandshakeTimeout))
		}
		_ = c.Close()
	}
	return n, err
}

// endHandshake lifts the handshake deadline: an idle peer is legitimate
// from now on.
func (c *conn) endHandshake() {
	c.handshaken.Store(true)
	_ = c.nc.SetDeadline(time.Time{})
}

// Write sends zmq4's bytes, less a listener's greeting already sent.
func (c *conn) Write(p []byte) (int, error) {
	if e := c.failed.Load(); e != nil {
		return 0, e
	}
	done := 0
	c.wmu.Lock()
	if len(c.swallow) > 0 {
		k := min(len(p), len(c.swallow))
		if !bytes.Equal(p[:k], c.swallow[:k]) {
			c.wmu.Unlock()
			return 0, c.fail(refuse(ReasonGreetingMismatch, "zmq4 sent greeting % x, the guard sent % x", p[:k], c.swallow[:k]))
		}
		c.swallow = c.swallow[k:]
		p, done = p[k:], k
	}
	c.wmu.Unlock()
	if len(p) == 0 {
		return done, nil
	}
	shaken := c.handshaken.Load()
	if shaken && c.cfg.WriteTimeout > 0 {
		_ = c.nc.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout))
	}
	n, err := c.nc.Write(p)
	if err != nil {
		switch {
		case isTimeout(err) && shaken:
			return done + n, c.fail(refuse(ReasonWriteTimeout, "%s read nothing for %v", c.nc.RemoteAddr(), c.cfg.WriteTimeout))
		case isTimeout(err):
			return done + n, c.fail(refuse(ReasonHandshakeTimeout, "%s read no handshake within %v", c.nc.RemoteAddr(), c.cfg.HandshakeTimeout))
		}
		_ = c.Close()
	}
	return done + n, err
}

// fail records the refusal, reports it once and closes the connection.
func (c *conn) fail(e *Error) error {
	if c.failed.CompareAndSwap(nil, e) {
		if c.cfg.OnRefuse != nil {
			c.cfg.OnRefuse(e)
		}
	}
	_ = c.Close()
	return c.failed.Load()
}

// Close closes the network connection once.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		if stop := c.stop.Load(); stop != nil {
			(*stop)()
		}
		c.closeErr = c.nc.Close()
	})
	return c.closeErr
}

func (c *conn) LocalAddr() net.Addr                { return c.nc.LocalAddr() }
func (c *conn) RemoteAddr() net.Addr               { return c.nc.RemoteAddr() }
func (c *conn) SetDeadline(t time.Time) error      { return c.nc.SetDeadline(t) }
func (c *conn) SetReadDeadline(t time.Time) error  { return c.nc.SetReadDeadline(t) }
func (c *conn) SetWriteDeadline(t time.Time) error { return c.nc.SetWriteDeadline(t) }

var _ net.Conn = (*conn)(nil)

func isTimeout(err error) bool {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// String names the connection in logs.
func (c *conn) String() string {
	return fmt.Sprintf("zmtp %s→%s", c.nc.LocalAddr(), c.nc.RemoteAddr())
}
