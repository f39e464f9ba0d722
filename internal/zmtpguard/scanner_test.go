package zmtpguard

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// wire builds ZMTP byte streams for tests.
type wire struct{ bytes.Buffer }

func (w *wire) greeting() *wire { w.Write(zmq4Greeting[:]); return w }

// frame appends one frame with flags f (LONG added when the body needs it).
func (w *wire) frame(f byte, body []byte) *wire {
	return w.header(f, uint64(len(body))).raw(body)
}

// header appends a frame header declaring size, LONG when size > 255.
func (w *wire) header(f byte, size uint64) *wire {
	if size > 255 {
		w.WriteByte(f | flagLong)
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], size)
		w.Write(b[:])
	} else {
		w.WriteByte(f)
		w.WriteByte(byte(size))
	}
	return w
}

func (w *wire) raw(b []byte) *wire { w.Write(b); return w }

// ready appends a READY command declaring socket type typ.
func (w *wire) ready(typ string) *wire { return w.frame(flagCommand, readyBody(typ)) }

func readyBody(typ string) []byte {
	var b bytes.Buffer
	b.WriteByte(5)
	b.WriteString("READY")
	prop := func(k, v string) {
		b.WriteByte(byte(len(k)))
		b.WriteString(k)
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(v)))
		b.Write(n[:])
		b.WriteString(v)
	}
	prop("Socket-Type", typ)
	prop("Identity", "")
	return b.Bytes()
}

// message appends a multi-frame message.
func (w *wire) message(frames ...[]byte) *wire {
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = flagMore
		}
		w.frame(fl, f)
	}
	return w
}

var testLimits = Limits{MaxFrameBytes: 1000, MaxMessageBytes: 1500, MaxFrames: 4}

func TestScannerVerdicts(t *testing.T) {
	hs := func() *wire { return new(wire).greeting().ready("PUB") }
	badSig := zmq4Greeting
	badSig[9] = 0x7E
	oldVersion := zmq4Greeting
	oldVersion[10] = 2
	plain := zmq4Greeting
	copy(plain[12:32], "PLAIN\x00\x00\x00")
	server2 := zmq4Greeting
	server2[32] = 2
	newer := zmq4Greeting
	newer[10], newer[11] = 3, 1
	for _, tc := range []struct {
		name   string
		stream []byte
		want   string // reason, "" for accepted
		shaken bool
	}{
		{"handshake and messages", hs().message([]byte("kv"), make([]byte, 8), make([]byte, 900)).
			message(nil).frame(flagCommand, []byte("\x04PING\x00\x01")).Bytes(), "", true},
		{"ZMTP 3.1 greeting", new(wire).raw(newer[:]).ready("SUB").Bytes(), "", true},
		{"greeting only", new(wire).greeting().Bytes(), "", false},
		{"bad signature", new(wire).raw(badSig[:]).Bytes(), ReasonBadGreeting, false},
		{"ZMTP 2", new(wire).raw(oldVersion[:]).Bytes(), ReasonBadGreeting, false},
		{"PLAIN mechanism", new(wire).raw(plain[:]).Bytes(), ReasonBadGreeting, false},
		{"as-server 2", new(wire).raw(server2[:]).Bytes(), ReasonBadGreeting, false},
		{"message before READY", new(wire).greeting().frame(0, []byte("x")).Bytes(), ReasonBadHandshake, false},
		{"ERROR instead of READY", new(wire).greeting().frame(flagCommand, []byte("\x05ERROR\x03bye")).Bytes(), ReasonBadHandshake, false},
		{"truncated READY property", new(wire).greeting().frame(flagCommand, []byte("\x05READY\x0bSocket-Type\x00\x00\x00\x09PUB")).Bytes(), ReasonBadHandshake, false},
		{"READY name past the end", new(wire).greeting().frame(flagCommand, []byte("\x09READY")).Bytes(), ReasonBadHandshake, false},
		{"unknown Socket-Type", new(wire).greeting().ready("FOO").Bytes(), ReasonBadHandshake, false},
		{"no Socket-Type", new(wire).greeting().frame(flagCommand, []byte("\x05READY")).Bytes(), ReasonBadHandshake, false},
		{"SOCKET-TYPE, which zmq4 does not find", new(wire).greeting().frame(flagCommand, []byte("\x05READY\x0bSOCKET-TYPE\x00\x00\x00\x03PUB")).Bytes(), ReasonBadHandshake, false},
		{"socket-type, which zmq4 finds", new(wire).greeting().frame(flagCommand, []byte("\x05READY\x0bsocket-type\x00\x00\x00\x03PUB")).Bytes(), "", true},
		{"huge READY", new(wire).greeting().header(flagCommand, 1<<40).Bytes(), ReasonBadHandshake, false},
		{"2^62 frame", hs().header(0, 1<<62).Bytes(), ReasonFrameTooLarge, true},
		{"2^64-1 frame", hs().raw([]byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}).Bytes(), ReasonFrameTooLarge, true},
		{"frame over limit", hs().header(0, 1001).Bytes(), ReasonFrameTooLarge, true},
		{"frame at limit", hs().frame(0, make([]byte, 1000)).Bytes(), "", true},
		{"message over limit", hs().frame(flagMore, make([]byte, 800)).header(0, 701).Bytes(), ReasonMessageTooLarge, true},
		{"too many frames", hs().message(nil, nil, nil, nil, nil).Bytes(), ReasonTooManyFrames, true},
		{"reserved flag", hs().frame(0x08, nil).Bytes(), ReasonBadFraming, true},
		{"command with MORE", hs().frame(flagCommand|flagMore, []byte("\x04PING")).Bytes(), ReasonBadFraming, true},
		{"command inside message", hs().frame(flagMore, []byte("a")).frame(flagCommand, []byte("\x04PING")).Bytes(), ReasonBadFraming, true},
		{"limits reset between messages", hs().message(make([]byte, 800), make([]byte, 700)).
			message(make([]byte, 800), make([]byte, 700)).Bytes(), "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Every chunking must give the same verdict.
			for _, chunk := range []int{1, 2, 3, 7, 64, 65, 1 << 20} {
				s := NewScanner(testLimits)
				var err error
				for b := tc.stream; len(b) > 0 && err == nil; {
					k := min(chunk, len(b))
					err = s.Scan(b[:k])
					b = b[k:]
				}
				if got := Reason(err); got != tc.want {
					t.Fatalf("chunk %d: reason %q (%v), want %q", chunk, got, err, tc.want)
				}
				if err != nil && s.Scan([]byte{0}) != err {
					t.Fatalf("chunk %d: the error did not stick", chunk)
				}
				if tc.want == "" && s.Handshaken() != tc.shaken {
					t.Fatalf("chunk %d: handshaken = %v, want %v", chunk, s.Handshaken(), tc.shaken)
				}
			}
		})
	}
}

func TestScannerPeerType(t *testing.T) {
	s := NewScanner(testLimits)
	if err := s.Scan(new(wire).greeting().ready("DEALER").Bytes()); err != nil {
		t.Fatal(err)
	}
	if got := s.PeerType(); got != "DEALER" {
		t.Errorf("PeerType = %q, want DEALER", got)
	}
}
