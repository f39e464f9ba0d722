package zmtpguard

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/text/cases"
	"golang.org/x/text/language"
)

// ZMTP 3.x wire constants, from RFC 23/ZMTP (https://rfc.zeromq.org/spec/23/):
// a 64-octet greeting (signature 0xFF, 8 octets of padding, 0x7F; version
// major, minor; a 20-octet mechanism; as-server; 31 octets of filler), then
// frames of one flags octet, a 1- or 8-octet size (network order) and a body.
const (
	greetingLen  = 64
	flagMore     = 0x01
	flagLong     = 0x02
	flagCommand  = 0x04
	flagReserved = 0xF8 // bits 7–3: "reserved ... SHALL be zero"

	// maxHandshakeCommand bounds the peer's READY command. NULL's READY
	// carries Socket-Type, Identity (at most 255 octets) and whatever
	// application metadata the peer sets (libzmq's ZMQ_METADATA); real ones
	// are under 100 octets.
	maxHandshakeCommand = 64 << 10
)

// Why the guard refused a connection: the reason label of the metrics.
const (
	ReasonBadGreeting      = "bad_greeting"        // not a ZMTP ≥ 3.0 NULL greeting
	ReasonBadHandshake     = "bad_handshake"       // no well-formed READY command after the greeting
	ReasonBadFraming       = "bad_framing"         // reserved flag bits, a command with MORE or inside a message
	ReasonFrameTooLarge    = "frame_too_large"     // a frame declared over MaxFrameBytes
	ReasonMessageTooLarge  = "message_too_large"   // MORE-chained frames over MaxMessageBytes
	ReasonTooManyFrames    = "too_many_frames"     // MORE-chained frames over MaxFrames
	ReasonHandshakeTimeout = "handshake_timeout"   // no READY within HandshakeTimeout
	ReasonWriteTimeout     = "write_timeout"       // the peer read nothing for WriteTimeout
	ReasonIncompatiblePeer = "incompatible_peer"   // a Socket-Type not in PeerTypes
	ReasonTooManyPending   = "too_many_handshakes" // MaxHandshakes already in progress
	ReasonGreetingMismatch = "greeting_mismatch"   // zmq4 sent another greeting than the guard's
)

// Error is a connection the guard refused and closed. It is a net.Error
// whose Timeout is false even for ReasonHandshakeTimeout and
// ReasonWriteTimeout: go-zeromq/zmq4 (conn.go, checkIO) drops a connection
// only on EOF or a net.Error that is not a timeout, and the guard wants
// every refused connection dropped.
type Error struct {
	// Reason is one of the Reason constants.
	Reason string
	// Err says what was seen.
	Err error
}

func (e *Error) Error() string { return "zmtpguard: " + e.Reason + ": " + e.Err.Error() }

// Unwrap returns the detail.
func (e *Error) Unwrap() error { return e.Err }

// Timeout is always false (see Error).
func (e *Error) Timeout() bool { return false }

// Temporary is always false: a refused connection stays closed.
func (e *Error) Temporary() bool { return false }

// Reason returns the reason of the guard's *Error in err's chain, or "".
func Reason(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

func refuse(reason, format string, args ...any) *Error {
	return &Error{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// Limits bound what one peer may send after its handshake. Every field must
// be positive.
type Limits struct {
	// MaxFrameBytes bounds one frame's declared size.
	MaxFrameBytes int64
	// MaxMessageBytes bounds the sum of the declared sizes of one message's
	// frames (a frame with MORE and those that follow it).
	MaxMessageBytes int64
	// MaxFrames bounds the frames of one message.
	MaxFrames int
}

type scanState uint8

const (
	stGreeting scanState = iota
	stFlags
	stSize
	stBody
	stFailed
)

// Scanner checks one direction of a ZMTP 3.x connection, the bytes a peer
// sends, as they arrive, in chunks of any size. It refuses a chunk as soon
// as it completes something go-zeromq/zmq4 must not see: an invalid
// greeting, a first frame that is not a well-formed READY command, bad
// flags, or a frame header over the Limits — before zmq4 (which allocates
// the declared size as soon as it has read a header, conn.go Conn.read)
// could act on it. It is the pure core of the guard: no I/O, no clock.
//
// The zero Scanner is not usable: use NewScanner. Not safe for concurrent
// use.
type Scanner struct {
	lim   Limits
	st    scanState
	buf   [greetingLen]byte // the greeting, then a frame's size octets
	n     int               // octets of buf filled
	want  int               // octets of size wanted: 1 or 8
	flags byte
	left  uint64 // body octets still to come

	msgBytes  int64 // declared size of the message so far
	msgFrames int   // frames of the message so far

	handshaken bool   // the peer's READY has passed
	ready      []byte // the READY command so far, during the handshake
	peerType   string // the READY's Socket-Type
	err        error  // sticky, once failed
}

// NewScanner returns a scanner that expects a greeting first.
func NewScanner(l Limits) *Scanner { return &Scanner{lim: l} }

// Handshaken reports whether the peer's greeting and READY command have
// passed.
func (s *Scanner) Handshaken() bool { return s.handshaken }

// PeerType is the Socket-Type the peer's READY declared, once Handshaken.
func (s *Scanner) PeerType() string { return s.peerType }

// Scan checks the next chunk of the stream. An error is an *Error and
// sticks: every later call returns it.
func (s *Scanner) Scan(p []byte) error {
	if s.st == stFailed {
		return s.err
	}
	for len(p) > 0 {
		switch s.st {
		case stGreeting:
			k := copy(s.buf[s.n:], p)
			s.n += k
			p = p[k:]
			if s.n == greetingLen {
				if err := checkGreeting(s.buf[:]); err != nil {
					return s.fail(err)
				}
				s.st = stFlags
			}
		case stFlags:
			f := p[0]
			p = p[1:]
			if err := s.checkFlags(f); err != nil {
				return s.fail(err)
			}
			s.flags, s.n, s.want, s.st = f, 0, 1, stSize
			if f&flagLong != 0 {
				s.want = 8
			}
		case stSize:
			k := copy(s.buf[s.n:s.want], p)
			s.n += k
			p = p[k:]
			if s.n < s.want {
				continue
			}
			size := uint64(s.buf[0])
			if s.want == 8 {
				size = binary.BigEndian.Uint64(s.buf[:8])
			}
			if err := s.checkSize(size); err != nil {
				return s.fail(err)
			}
			s.left, s.st = size, stBody
			if size == 0 {
				if err := s.endFrame(); err != nil {
					return s.fail(err)
				}
			}
		case stBody:
			k := uint64(len(p))
			if k > s.left {
				k = s.left
			}
			if !s.handshaken {
				s.ready = append(s.ready, p[:k]...)
			}
			s.left -= k
			p = p[k:]
			if s.left == 0 {
				if err := s.endFrame(); err != nil {
					return s.fail(err)
				}
			}
		}
	}
	return nil
}

func (s *Scanner) fail(err *Error) error {
	s.st, s.err, s.ready = stFailed, err, nil
	return err
}

// checkGreeting accepts what zmq4's greeting.read and Conn.greet accept
// (protocol.go, conn.go): signature, version ≥ 3.0, the NULL mechanism (the
// only one prefixlb speaks) and an as-server octet of 0 or 1, so that zmq4
// never fails a handshake the guard let through.
func checkGreeting(g []byte) *Error {
	if g[0] != 0xFF || g[9] != 0x7F {
		return refuse(ReasonBadGreeting, "signature %#02x…%#02x, want 0xff…0x7f", g[0], g[9])
	}
	if g[10] < 3 {
		return refuse(ReasonBadGreeting, "ZMTP version %d.%d, want 3.0 or later", g[10], g[11])
	}
	mech := g[12:32]
	if i := bytes.IndexByte(mech, 0); i >= 0 {
		mech = mech[:i]
	}
	if string(mech) != "NULL" {
		return refuse(ReasonBadGreeting, "security mechanism %q, want NULL", mech)
	}
	if g[32] > 1 {
		return refuse(ReasonBadGreeting, "as-server octet %d, want 0 or 1", g[32])
	}
	return nil
}

func (s *Scanner) checkFlags(f byte) *Error {
	cmd := f&flagCommand != 0
	switch {
	case f&flagReserved != 0:
		return refuse(ReasonBadFraming, "flags %#02x have reserved bits set", f)
	case cmd && f&flagMore != 0:
		return refuse(ReasonBadFraming, "command frame with MORE (flags %#02x)", f)
	case cmd && s.msgFrames > 0:
		return refuse(ReasonBadFraming, "command frame inside a %d-frame message", s.msgFrames)
	case !s.handshaken && !cmd:
		return refuse(ReasonBadHandshake, "message frame before the READY command")
	}
	return nil
}

func (s *Scanner) checkSize(size uint64) *Error {
	if !s.handshaken {
		if size > maxHandshakeCommand {
			return refuse(ReasonBadHandshake, "READY command of %d bytes, limit %d", size, maxHandshakeCommand)
		}
		return nil
	}
	if size > uint64(s.lim.MaxFrameBytes) {
		return refuse(ReasonFrameTooLarge, "frame of %d bytes, limit %d", size, s.lim.MaxFrameBytes)
	}
	if s.msgFrames+1 > s.lim.MaxFrames {
		return refuse(ReasonTooManyFrames, "message of more than %d frames", s.lim.MaxFrames)
	}
	if s.msgBytes+int64(size) > s.lim.MaxMessageBytes {
		return refuse(ReasonMessageTooLarge, "message of %d bytes or more, limit %d", s.msgBytes+int64(size), s.lim.MaxMessageBytes)
	}
	s.msgFrames++
	s.msgBytes += int64(size)
	return nil
}

// endFrame is reached when a frame's body is complete.
func (s *Scanner) endFrame() *Error {
	s.st = stFlags
	if !s.handshaken {
		peerType, err := parseReady(s.ready)
		if err != nil {
			return err
		}
		s.handshaken, s.peerType, s.ready = true, peerType, nil
		return nil
	}
	if s.flags&flagMore == 0 {
		s.msgBytes, s.msgFrames = 0, 0
	}
	return nil
}

// socketTypes are the Socket-Types zmq4 knows: its SocketType.IsCompatible
// panics on any other (socket_types.go: "unknown socket-type"), in zmq4's
// accept loop for a listener.
var socketTypes = map[string]bool{"PAIR": true, "PUB": true, "SUB": true, "REQ": true, "REP": true,
	"DEALER": true, "ROUTER": true, "PULL": true, "PUSH": true, "XPUB": true, "XSUB": true}

// titleCase is zmq4's toTitle (protocol.go), which names the metadata keys
// it looks up ("socket-type" is found as "Socket-Type", "SOCKET-TYPE" is
// not). A Caser is stateful: one per call.
func titleCase(s string) string { return cases.Title(language.Und, cases.NoLower).String(s) }

// parseReady checks a READY command (RFC 23: name-size, name, then
// properties of name-size, name, 4-octet value-size, value) strictly enough
// that zmq4's Metadata.UnmarshalZMTP, which trusts the lengths it reads
// (protocol.go, Property.Write), cannot index past the end, and that the
// Socket-Type zmq4 will read is one it knows; it returns that type.
func parseReady(b []byte) (string, *Error) {
	if len(b) < 1 || int(b[0]) > len(b)-1 {
		return "", refuse(ReasonBadHandshake, "truncated command name")
	}
	name := string(b[1 : 1+int(b[0])])
	if name != "READY" {
		if name == "ERROR" && len(b) > 1+5 {
			return "", refuse(ReasonBadHandshake, "peer sent ERROR %q", strings.ToValidUTF8(string(b[7:]), "?"))
		}
		return "", refuse(ReasonBadHandshake, "command %q, want READY", strings.ToValidUTF8(name, "?"))
	}
	var peerType string
	p := b[1+len(name):]
	for len(p) > 0 {
		kl := int(p[0])
		if kl == 0 || 1+kl+4 > len(p) {
			return "", refuse(ReasonBadHandshake, "malformed READY property")
		}
		key := string(p[1 : 1+kl])
		vl := binary.BigEndian.Uint32(p[1+kl:])
		p = p[1+kl+4:]
		if uint64(vl) > uint64(len(p)) {
			return "", refuse(ReasonBadHandshake, "READY property %q of %d bytes, %d left", key, vl, len(p))
		}
		if titleCase(key) == "Socket-Type" {
			peerType = string(p[:vl])
		}
		p = p[vl:]
	}
	if !socketTypes[peerType] {
		return "", refuse(ReasonBadHandshake, "READY Socket-Type %q is not a ZeroMQ socket type", strings.ToValidUTF8(peerType, "?"))
	}
	return peerType, nil
}
