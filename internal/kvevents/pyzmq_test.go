package kvevents

import (
	"bufio"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Interop with libzmq through pyzmq, which vLLM's ZmqEventPublisher uses:
// our guarded SUB and replay DEALER against a pyzmq PUB and ROUTER, and our
// guarded PUB and ROUTER against a pyzmq SUB and DEALER. They skip without
// python3-zmq (Debian: apt-get install python3-zmq).

const python = "/usr/bin/python3"

func needPyZMQ(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("pyzmq interop: skipped in -short")
	}
	out, err := exec.Command(python, "-c", "import zmq; print(zmq.zmq_version())").CombinedOutput()
	if err != nil {
		t.Skipf("pyzmq interop: %s cannot import zmq (apt-get install python3-zmq): %v", python, err)
	}
	t.Logf("libzmq %s", strings.TrimSpace(string(out)))
}

// pyPublisher serves vLLM's protocol: batch i of the file argv[1] (hex, one
// a line) as seq i on the PUB every 20 ms, and replays from a ROUTER as
// ZmqEventPublisher._service_replay does, until stdin closes.
const pyPublisher = `
import struct, sys, time, zmq
payloads = [bytes.fromhex(l) for l in open(sys.argv[1]).read().split()]
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
router = ctx.socket(zmq.ROUTER)
print(pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1"), flush=True)
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
seq, nxt = 0, time.time()
while True:
    ev = dict(poller.poll(max(0, nxt - time.time()) * 1000))
    if sys.stdin.fileno() in ev and not sys.stdin.buffer.read1(1):
        break
    if router in ev:
        f = router.recv_multipart()
        start = struct.unpack(">Q", f[-1])[0]
        for s in range(start, seq):
            router.send_multipart([f[0], b"", struct.pack(">Q", s), payloads[s]])
        router.send_multipart([f[0], b"", struct.pack(">q", -1), b""])
    if time.time() >= nxt and seq < len(payloads):
        pub.send_multipart([b"kv@py@model", struct.pack(">Q", seq), payloads[seq]])
        seq += 1
        nxt += 0.02
`

func TestPyZMQPublisherInterop(t *testing.T) {
	needPyZMQ(t)
	const n = 50
	var lines []string
	for i := range n {
		payload, err := EncodeBatch(Batch{TS: 1, Events: []Event{BlockStored{BlockHashes: []uint64{uint64(i + 1)},
			TokenIDs: toks(4*i, 4), BlockSize: 4, Medium: MediumGPU}}}, EncodingMap)
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, hex.EncodeToString(payload))
	}
	file := filepath.Join(t.TempDir(), "batches.hex")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-c", pyPublisher, file)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("python publisher: %v", err)
		}
	}()
	var pubPort, routerPort int
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if _, serr := fmt.Sscan(line, &pubPort, &routerPort); err != nil || serr != nil {
		t.Fatalf("python publisher said %q: %v %v", line, err, serr)
	}

	ix := NewIndex()
	s := NewSubscriber(SubscriberConfig{Replica: "py", Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", routerPort), Topic: "kv@py", Index: ix,
		PollInterval: 100 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	states := watchStates(s)
	stop := runSubscriber(t, s, time.Second)
	defer stop()
	states.waitFor(t, s, fmt.Sprintf("seq %d from pyzmq", n-1), func(st Stats) bool { return st.LastSeq == n-1 })
	st := s.Stats()
	if got := ix.Held("py")[MediumGPU]; got != n {
		t.Errorf("index holds %d blocks, want %d", got, n)
	}
	if len(st.Refused) != 0 || st.LostBatches != 0 {
		t.Errorf("refused %v, lost %d: the guard got in the way of libzmq", st.Refused, st.LostBatches)
	}
}

// pySubscriber subscribes to our PUB, takes one live message, then replays
// from 0 over a DEALER, and prints what it got.
const pySubscriber = `
import struct, sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.RCVTIMEO, 20000)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
f = sub.recv_multipart()
assert len(f) == 3 and f[0] == b"kv@go" and len(f[1]) == 8, f
live = struct.unpack(">Q", f[1])[0]
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.RCVTIMEO, 20000)
d.connect(sys.argv[2])
d.send_multipart([b"", struct.pack(">Q", 0)])
n = 0
while True:
    f = d.recv_multipart()
    assert f[0] == b"" and len(f) == 3, f
    if struct.unpack(">q", f[1])[0] == -1:
        break
    n += 1
print("live", live, "replayed", n, flush=True)
`

func TestPyZMQSubscriberInterop(t *testing.T) {
	needPyZMQ(t)
	h := newHarness(t)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback, Topic: "kv@go"})
	defer stop()
	ctx, cancel := context.WithTimeout(h.ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-c", pySubscriber, p.Endpoint(), p.ReplayEndpoint())
	cmd.Stderr = os.Stderr
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { defer close(done); out, err = cmd.Output() }()
	// Publish until the python subscriber has what it needs (slow joiner).
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for running := true; running; {
		select {
		case <-done:
			running = false
		case <-tick.C:
			if _, perr := p.Publish([]Event{BlockStored{BlockHashes: []uint64{p.NextSeq() + 1}, TokenIDs: toks(0, 4), BlockSize: 4}}, 0); perr != nil {
				t.Fatal(perr)
			}
		}
	}
	if err != nil {
		t.Fatalf("python subscriber: %v (%s)", err, out)
	}
	var live, replayed int
	if _, err := fmt.Sscanf(string(out), "live %d replayed %d", &live, &replayed); err != nil || replayed < live+1 {
		t.Fatalf("python subscriber said %q, want a live seq and a replay of at least that many", out)
	}
	if r := p.Refused(); len(r) != 0 {
		t.Errorf("the guard refused libzmq peers: %v", r)
	}
}
