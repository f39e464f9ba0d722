package chaos

import (
	"bufio"
	"context"
	binenc "encoding/binary" // "binary" is the prefixlb binary's path
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// The fault points themselves, without processes (these run under -short).

// TestTCPProxyLatency: with a latency set, every line is held at least that
// long, lines arrive in order, and the reads are not slowed (n lines take
// the latency once, not n times); a latency set back to 0 releases what is
// held at once.
func TestTCPProxyLatency(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type arrival struct {
		line string
		at   time.Time
	}
	got := make(chan arrival, 100)
	go func() { // the target, owned by this test: ends when the client's connection does
		c, err := ln.Accept()
		if err != nil {
			close(got)
			return
		}
		defer c.Close()
		sc := bufio.NewScanner(c)
		for sc.Scan() {
			got <- arrival{sc.Text(), time.Now()}
		}
		close(got)
	}()
	p := newTCPProxy(t, ln.Addr().String())
	const latency = 150 * time.Millisecond
	p.setLatency(latency)
	c, err := net.Dial("tcp", p.addr())
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	sent := make([]time.Time, n)
	for i := range n {
		sent[i] = time.Now()
		if _, err := fmt.Fprintf(c, "%d\n", i); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // the pace of the sender, not a wait for an event
	}
	for i := range n {
		a := <-got
		if a.line != strconv.Itoa(i) {
			t.Fatalf("line %d: got %q, want %d (reordered)", i, a.line, i)
		}
		if d := a.at.Sub(sent[i]); d < latency {
			t.Errorf("line %d held %v, want ≥ %v", i, d, latency)
		}
	}
	if d := time.Since(sent[0]); d > latency+time.Second {
		t.Errorf("%d lines took %v through a %v latency: the latency limits throughput", n, d, latency)
	}

	// Held lines leave at once when the latency is lifted.
	p.setLatency(time.Hour)
	at := time.Now()
	fmt.Fprintf(c, "held\n")
	// Give the proxy time to read the line and hold it. Were this too short,
	// the line would not be held at all and the check below would still hold.
	time.Sleep(20 * time.Millisecond)
	p.setLatency(0)
	a := <-got
	if a.line != "held" || a.at.Sub(at) > time.Second {
		t.Errorf("after the latency was lifted: got %q after %v, want \"held\" at once", a.line, a.at.Sub(at))
	}
	c.Close()
	if _, ok := <-got; ok {
		t.Error("target read past the end")
	}
}

// TestZMQRelayGap: the relay passes messages unchanged and in order; in gap
// mode it drops all but one per period on the same connection, so the
// subscriber sees seq jumps; after it, consecutive seqs again.
func TestZMQRelayGap(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQ))
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	r := newZMQRelay(t, "tcp://"+pub.Addr().String())
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quietZMQ))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(r.endpoint); err != nil {
		t.Fatal(err)
	}
	// The publisher, owned by this test: a message every 2 ms until cancel.
	go func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for seq := uint64(0); ; seq++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			var sb [8]byte
			binenc.BigEndian.PutUint64(sb[:], seq)
			_ = pub.Send(zmq4.NewMsgFrom([]byte("kv@t"), sb[:], []byte("payload-"+strconv.FormatUint(seq, 10))))
		}
	}()
	recv := func() uint64 {
		t.Helper()
		m, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Frames) != 3 || string(m.Frames[0]) != "kv@t" || len(m.Frames[1]) != 8 {
			t.Fatalf("relayed message changed: %q", m.Frames)
		}
		seq := binenc.BigEndian.Uint64(m.Frames[1])
		if want := "payload-" + strconv.FormatUint(seq, 10); string(m.Frames[2]) != want {
			t.Fatalf("seq %d: payload %q, want %q", seq, m.Frames[2], want)
		}
		return seq
	}
	// steps receives n messages and returns the largest step between seqs;
	// jumps counts the steps over 1 (each one a gap the relay made: it
	// dropped messages before that one).
	last := recv()
	jumps := 0
	steps := func(n int) (maxStep uint64) {
		for range n {
			s := recv()
			if s <= last {
				t.Fatalf("seq %d after %d: reordered", s, last)
			}
			if s-last > 1 {
				jumps++
			}
			maxStep = max(maxStep, s-last)
			last = s
		}
		return maxStep
	}
	if m := steps(20); m != 1 {
		t.Errorf("pass-through: largest seq step %d, want 1", m)
	}
	r.setGap(100 * time.Millisecond)
	if m := steps(3); m < 3 {
		t.Errorf("gap mode: largest seq step %d, want ≥ 3 (a message per 100 ms of one per 2 ms)", m)
	}
	r.setGap(0)
	steps(1) // the first after gap mode may still jump
	if m := steps(20); m != 1 {
		t.Errorf("after gap mode: largest seq step %d, want 1", m)
	}
	// Every jump the subscriber saw is a gap the relay counted. (Not "≥ 3
	// gaps": a publisher starved of CPU for over 100 ms sends its next
	// message after no drop, and the relay rightly counts no gap there.)
	st := r.stats()
	if st.Dropped == 0 || st.Gaps < jumps || jumps == 0 || st.Err != nil {
		t.Errorf("relay stats %+v: want drops, ≥ %d gaps (the jumps seen), no error", st, jumps)
	}
}
