package zmtpguard

import (
	"encoding/binary"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// refVerdict checks a whole stream the simple way, structure by structure,
// and returns the index of the byte that completes the first violation and
// its reason, or -1 and "". It is the model the streaming Scanner must
// agree with, whatever the chunking.
func refVerdict(b []byte, lim Limits) (int, string) {
	if len(b) < greetingLen {
		return -1, ""
	}
	if err := checkGreeting(b[:greetingLen]); err != nil {
		return greetingLen - 1, err.Reason
	}
	pos, shaken := greetingLen, false
	msgFrames, msgBytes := 0, int64(0)
	for pos < len(b) {
		f := b[pos]
		cmd := f&flagCommand != 0
		switch {
		case f&0xF8 != 0, cmd && f&flagMore != 0, cmd && msgFrames > 0:
			return pos, ReasonBadFraming
		case !shaken && !cmd:
			return pos, ReasonBadHandshake
		}
		hdr := 2
		if f&flagLong != 0 {
			hdr = 9
		}
		if pos+hdr > len(b) {
			return -1, ""
		}
		size := uint64(b[pos+1])
		if hdr == 9 {
			size = binary.BigEndian.Uint64(b[pos+1 : pos+9])
		}
		at := pos + hdr - 1
		if !shaken {
			if size > maxHandshakeCommand {
				return at, ReasonBadHandshake
			}
		} else {
			switch {
			case size > uint64(lim.MaxFrameBytes):
				return at, ReasonFrameTooLarge
			case msgFrames+1 > lim.MaxFrames:
				return at, ReasonTooManyFrames
			case msgBytes+int64(size) > lim.MaxMessageBytes:
				return at, ReasonMessageTooLarge
			}
			msgFrames++
			msgBytes += int64(size)
		}
		if uint64(len(b)-pos-hdr) < size {
			return -1, ""
		}
		end := pos + hdr + int(size)
		if !shaken {
			if _, err := parseReady(b[pos+hdr : end]); err != nil {
				return end - 1, err.Reason
			}
			shaken = true
		} else if f&flagMore == 0 {
			msgFrames, msgBytes = 0, 0
		}
		pos = end
	}
	return -1, ""
}

var fuzzLimits = Limits{MaxFrameBytes: 300, MaxMessageBytes: 600, MaxFrames: 4}

func FuzzZMTPGuard(f *testing.F) {
	hs := new(wire).greeting().ready("PUB").Bytes()
	f.Add([]byte{}, uint8(0), true)
	f.Add(hs, uint8(3), false)
	f.Add(new(wire).message([]byte("kv"), make([]byte, 8), []byte("payload")).Bytes(), uint8(1), true)
	f.Add(new(wire).header(0, 1<<62).Bytes(), uint8(0), true)
	f.Add(new(wire).message(make([]byte, 290), make([]byte, 290), make([]byte, 290)).Bytes(), uint8(7), true)
	f.Add(new(wire).message(nil, nil, nil, nil, nil).Bytes(), uint8(2), true)
	f.Add(new(wire).frame(flagCommand, []byte("\x04PING\x00\x00")).frame(flagCommand|flagMore, nil).Bytes(), uint8(0), true)
	f.Add(new(wire).greeting().frame(flagCommand, []byte("\x05READY\x0bSocket-Type\x00\x00\x00\x09PUB")).Bytes(), uint8(5), false)
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8, prefix bool) {
		stream := data
		if prefix {
			stream = append(append([]byte{}, hs...), data...)
		}
		// 1. The scanner, in chunks, agrees with the whole-stream model.
		at, want := refVerdict(stream, fuzzLimits)
		s := NewScanner(fuzzLimits)
		step := int(chunk)%19 + 1
		passed := 0
		var err error
		for b := stream; len(b) > 0; {
			k := min(step, len(b))
			if err = s.Scan(b[:k]); err != nil {
				break
			}
			passed += k
			b = b[k:]
		}
		if got := Reason(err); got != want {
			t.Fatalf("reason %q (%v), model %q at byte %d", got, err, want, at)
		}
		if want != "" && (at < passed || at >= passed+step) {
			t.Fatalf("refused the chunk at %d (+%d), the violation completes at %d", passed, step, at)
		}
		// 2. The same stream through a guarded connection into a real zmq4
		// handshake and reader: no panic, and every message zmq4 returns
		// is within the limits.
		throughZMQ4(t, stream)
	})
}

func throughZMQ4(t *testing.T, stream []byte) {
	a, b := net.Pipe()
	_ = a.SetDeadline(time.Now().Add(10 * time.Second))
	_ = b.SetDeadline(time.Now().Add(10 * time.Second))
	var refused *Error
	cfg := Config{Limits: fuzzLimits, OnRefuse: func(e *Error) { refused = e }}.withDefaults()
	c := newConn(a, cfg)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the peer's side: its bytes, then EOF
		defer wg.Done()
		_, _ = b.Write(stream)
		_ = b.Close()
	}()
	go func() { // what zmq4 sends is drained
		defer wg.Done()
		var buf [512]byte
		for {
			if _, err := b.Read(buf[:]); err != nil {
				return
			}
		}
	}()
	zc, err := zmq4.Open(c, null.Security(), zmq4.Sub, nil, false, nil)
	if err == nil {
		for {
			msg, err := zc.RecvMsg()
			if err != nil {
				break
			}
			var total int
			for _, fr := range msg.Frames {
				if len(fr) > int(fuzzLimits.MaxFrameBytes) {
					t.Fatalf("zmq4 returned a %d-byte frame", len(fr))
				}
				total += len(fr)
			}
			if total > int(fuzzLimits.MaxMessageBytes) || len(msg.Frames) > fuzzLimits.MaxFrames {
				t.Fatalf("zmq4 returned %d frames of %d bytes", len(msg.Frames), total)
			}
		}
	} else if refused == nil && complete(stream) {
		// The guard passed a whole handshake from a PUB: zmq4 must take it.
		t.Fatalf("zmq4 refused a handshake the guard passed: %v", err)
	}
	_ = c.Close()
	wg.Wait()
}

// complete reports whether stream holds a greeting and READY the scanner
// passes, from a socket type zmq4's SUB accepts.
func complete(stream []byte) bool {
	s := NewScanner(fuzzLimits)
	for i := 0; i < len(stream) && !s.Handshaken(); i++ {
		if s.Scan(stream[i:i+1]) != nil {
			return false
		}
	}
	return s.Handshaken() && (s.PeerType() == "PUB" || s.PeerType() == "XPUB")
}
