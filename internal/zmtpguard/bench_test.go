package zmtpguard

import (
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// loopConn is an in-memory peer: it sends head once, then body for ever,
// in reads of at most chunk bytes (as a socket hands over what arrived);
// writes are discarded.
type loopConn struct {
	head, body []byte
	off        int
	chunk      int
}

func (c *loopConn) Read(p []byte) (int, error) {
	if len(p) > c.chunk {
		p = p[:c.chunk]
	}
	if len(c.head) > 0 {
		n := copy(p, c.head)
		c.head = c.head[n:]
		return n, nil
	}
	n := copy(p, c.body[c.off:])
	c.off = (c.off + n) % len(c.body)
	return n, nil
}

func (c *loopConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *loopConn) Close() error                     { return nil }
func (c *loopConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *loopConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *loopConn) SetDeadline(time.Time) error      { return nil }
func (c *loopConn) SetReadDeadline(time.Time) error  { return nil }
func (c *loopConn) SetWriteDeadline(time.Time) error { return nil }

// BenchmarkSubscriberRead measures zmq4's reader (a SUB's Conn.RecvMsg) on
// vLLM-shaped messages [topic, seq, payload], bare and through the guard:
// the difference is the guard's cost per byte.
func BenchmarkSubscriberRead(b *testing.B) {
	for _, size := range []int{1 << 10, 64 << 10, 1 << 20} {
		msg := new(wire).message([]byte("kv@10.0.0.1:8000@llama"), make([]byte, 8), make([]byte, size)).Bytes()
		// Many messages per loop so a read chunk spans message boundaries.
		var body []byte
		for range max(1, (4<<20)/len(msg)) {
			body = append(body, msg...)
		}
		head := new(wire).greeting().ready("PUB").Bytes()
		for _, guarded := range []bool{false, true} {
			name := map[bool]string{false: "bare", true: "guarded"}[guarded]
			b.Run(name+"/"+sizeName(size), func(b *testing.B) {
				var nc net.Conn = &loopConn{head: head, body: body, chunk: 64 << 10}
				if guarded {
					nc = newConn(nc, DefaultConfig())
				}
				zc, err := zmq4.Open(nc, null.Security(), zmq4.Sub, nil, false, nil)
				if err != nil {
					b.Fatal(err)
				}
				b.SetBytes(int64(len(msg)))
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					if _, err := zc.RecvMsg(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return "1MiB"
	}
	if n >= 1<<10 {
		return map[int]string{1 << 10: "1KiB", 64 << 10: "64KiB"}[n]
	}
	return "small"
}

// BenchmarkScanner is the guard's own cost: scanning vLLM-shaped messages
// in 64 KiB reads, as a socket delivers them.
func BenchmarkScanner(b *testing.B) {
	for _, size := range []int{1 << 10, 64 << 10} {
		msg := new(wire).message([]byte("kv@10.0.0.1:8000@llama"), make([]byte, 8), make([]byte, size)).Bytes()
		var stream []byte
		for range max(1, (4<<20)/len(msg)) {
			stream = append(stream, msg...)
		}
		b.Run(sizeName(size), func(b *testing.B) {
			s := NewScanner(DefaultConfig().Limits)
			if err := s.Scan(new(wire).greeting().ready("PUB").Bytes()); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			for range b.N {
				for p := stream; len(p) > 0; {
					k := min(64<<10, len(p))
					if err := s.Scan(p[:k]); err != nil {
						b.Fatal(err)
					}
					p = p[k:]
				}
			}
		})
	}
}
