package epp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/prefixlb/prefixlb/internal/decisiontest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// startTCPServer serves s on 127.0.0.1 from a gRPC server made with its
// limits' options, as Run makes it, and returns a client of it.
func startTCPServer(t *testing.T, s *Server) *grpc.ClientConn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(s.cfg.Limits.ServerOptions()...)
	s.Register(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(ln)
	}()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		g.Stop()
		<-done
	})
	return conn
}

// closeStream ends e's stream from the client side and waits for the
// server's status: once it comes, the server's Process has returned.
func closeStream(t *testing.T, e *envoy) {
	t.Helper()
	if err := e.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := e.stream.Recv(); err != nil {
			if err != io.EOF {
				t.Fatalf("stream ended with %v, want OK", err)
			}
			return
		}
	}
}

// TestMaxStreams: with MaxStreams streams open, a flood of more is
// answered 429 (with Retry-After), each closed and counted, while the
// streams within the limit are still served; a stream that ends frees its
// slot for the next.
func TestMaxStreams(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	s := NewServer(p, ServerConfig{Limits: Limits{MaxStreams: 3}})
	conn := startTCPServer(t, s)
	body := completionBody("hello", false)
	held, dests := make([]*envoy, 3), make([]string, 3)
	for i := range held {
		held[i] = newEnvoy(t, conn)
		held[i].request("/v1/completions", body, 1<<10, nil)
		dests[i], _, _ = held[i].decision() // routed: its stream is open, waiting for the response path
	}
	// A flood of streams over the limit: each is answered 429, naming the
	// limit, with Retry-After, and its stream ends OK (Envoy sends the
	// 429 to the client; a gRPC error would be a 500 or a fail-open).
	const flood = 8
	for i := range flood {
		over := newEnvoy(t, conn)
		over.answered = true
		over.request("/v1/completions", body, 1<<10, nil)
		r := over.recv()
		ir := r.GetImmediateResponse()
		if ir.GetStatus().GetCode() != typev3.StatusCode_TooManyRequests || !strings.Contains(string(ir.GetBody()), "3 requests open") {
			t.Fatalf("stream %d over the limit: %v, want an ImmediateResponse 429 naming the limit", i, r)
		}
		retry := false
		for _, h := range ir.GetHeaders().GetSetHeaders() {
			retry = retry || h.GetHeader().GetKey() == "retry-after"
		}
		if !retry {
			t.Error("429 without Retry-After")
		}
		if _, err := over.stream.Recv(); err != io.EOF {
			t.Errorf("after the 429 the stream ends: got %v, want EOF", err)
		}
	}
	if n := testutil.ToFloat64(s.lm.limited.WithLabelValues(limitStreams)); n != flood {
		t.Errorf("prefixlb_epp_limited_total{limit=streams} = %v, want %d", n, flood)
	}
	// The streams within the limit are still served: their responses pass.
	for i, h := range held[1:] {
		h.respond(strings.Split(dests[i+1], ",")[0], "application/json", []string{`{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`}, nil)
		closeStream(t, h)
	}
	closeStream(t, held[0])
	next := newEnvoy(t, conn)
	next.request("/v1/completions", body, 1<<10, nil)
	if dest, _, _ := next.decision(); dest == "" {
		t.Error("a stream after one ended got no destination")
	}
}

// TestStreamIdleTimeout: a stream that stops sending before its request
// is whole ends with DEADLINE_EXCEEDED after StreamIdleTimeout and gives
// back its buffer; one that never sends anything ends too; a routed
// stream waiting for its response is not cut.
func TestStreamIdleTimeout(t *testing.T) {
	const idle = 300 * time.Millisecond
	p := newTestPicker(t, Config{}, 2)
	s := NewServer(p, ServerConfig{Limits: Limits{StreamIdleTimeout: idle}})
	conn := startTCPServer(t, s)

	e := newEnvoy(t, conn)
	e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: hdrs(":method", "POST", ":path", "/v1/completions")}}})
	e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
		Body: bytes.Repeat([]byte("x"), 100<<10)}}})
	start := time.Now()
	if err := endWithin(t, e, 30*time.Second); status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "no message for") {
		t.Fatalf("silent stream: %v, want DEADLINE_EXCEEDED from the picker", err)
	}
	if took := time.Since(start); took < idle {
		t.Errorf("ended after %v, before the %v timeout", took, idle)
	}
	if used := s.budget.used.Load(); used != 0 {
		t.Errorf("%d bytes still held after the idle stream ended", used)
	}

	mute := newEnvoy(t, conn) // opens the stream, sends nothing
	if err := endWithin(t, mute, 30*time.Second); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("mute stream: %v, want DEADLINE_EXCEEDED", err)
	}
	if n := testutil.ToFloat64(s.lm.limited.WithLabelValues(limitIdle)); n != 2 {
		t.Errorf("prefixlb_epp_limited_total{limit=idle} = %v, want 2", n)
	}

	routed := newEnvoy(t, conn)
	routed.request("/v1/completions", completionBody("hello", false), 1<<10, nil)
	dest, _, _ := routed.decision()
	time.Sleep(3 * idle) // the upstream takes its time: no event to wait for
	routed.respond(strings.Split(dest, ",")[0], "application/json", []string{`{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`}, nil)
}

// endWithin waits at most d for e's stream to end and returns how; a
// stream still open after d fails the test (rather than hanging it).
func endWithin(t *testing.T, e *envoy, d time.Duration) error {
	t.Helper()
	ended := make(chan error, 1)
	go func() {
		for {
			if _, err := e.stream.Recv(); err != nil {
				ended <- err
				return
			}
		}
	}()
	select {
	case err := <-ended:
		return err
	case <-time.After(d):
		t.Fatalf("stream still open after %v", d)
		return nil
	}
}

// TestMaxRecvMsgBytes: a message over MaxRecvMsgBytes ends its stream
// with RESOURCE_EXHAUSTED (gRPC refuses it by its declared length).
func TestMaxRecvMsgBytes(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	s := NewServer(p, ServerConfig{Limits: Limits{MaxRecvMsgBytes: 1 << 20}})
	e := newEnvoy(t, startTCPServer(t, s))
	e.answered = true
	e.request("/v1/completions", bytes.Repeat([]byte("x"), 2<<20), 2<<20, nil)
	if _, err := e.stream.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("2 MiB message: %v, want RESOURCE_EXHAUSTED", err)
	}
}

// TestBufferedBytesBudget: 40 streams each sending a 15 MiB body at once
// (the measure: 1.7 GiB before this bound) hold at most
// MaxBufferedBytes between them, and the heap stays within it plus what
// gRPC has in flight; the streams the budget cannot take get a 429 that
// says why, the others their whole body read; and an ordinary request
// routes meanwhile. Everything is given back at the end.
//
// Under the race detector the bodies are 3 MiB and the budget 16 MiB (the
// full run takes minutes there), and the heap is not checked.
func TestBufferedBytesBudget(t *testing.T) {
	const streams = 40
	size, chunk, budget := 15<<20, 1<<20, int64(64<<20)
	if decisiontest.RaceEnabled {
		size, chunk, budget = 3<<20, 256<<10, 16<<20
	}
	// Collect garbage early, so the heap sampled is mostly what is held.
	defer debug.SetGCPercent(debug.SetGCPercent(25))
	p := newTestPicker(t, Config{}, 2)
	s := NewServer(p, ServerConfig{Limits: Limits{MaxBufferedBytes: budget}})
	conn := startTCPServer(t, s)
	client := extprocv3.NewExternalProcessorClient(conn)
	big := bytes.Repeat([]byte("x"), size) // not JSON: a body read whole gets 400

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak.Load() {
				peak.Store(ms.HeapAlloc)
			}
			select {
			case <-stopSampling:
				return
			case <-tick.C:
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	type outcome struct {
		code typev3.StatusCode
		body string
		err  error
	}
	outcomes := make(chan outcome, streams)
	first429 := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := client.Process(ctx)
			if err != nil {
				outcomes <- outcome{err: err}
				return
			}
			err = st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: hdrs(":method", "POST", ":path", "/v1/completions")}}})
			for off := 0; err == nil && off < size; off += chunk {
				err = st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
					Body: big[off : off+chunk], EndOfStream: off+chunk == size}}})
			}
			if err != nil && !errors.Is(err, io.EOF) { // EOF: the server answered and closed
				outcomes <- outcome{err: err}
				return
			}
			r, err := st.Recv()
			ir := r.GetImmediateResponse()
			o := outcome{code: ir.GetStatus().GetCode(), body: string(ir.GetBody()), err: err}
			if o.code == typev3.StatusCode_TooManyRequests {
				once.Do(func() { close(first429) })
			}
			outcomes <- o
		}()
	}

	// While the budget turns big bodies away, an ordinary request routes.
	// (Without a refusal, once every stream is done: the counts below fail.)
	allDone := make(chan struct{})
	go func() {
		wg.Wait()
		close(allDone)
	}()
	select {
	case <-first429:
	case <-allDone:
	case <-ctx.Done():
		t.Fatal("the streams neither were refused nor ended")
	}
	normal := newEnvoy(t, conn)
	normal.request("/v1/completions", completionBody("an ordinary prompt", false), 1<<10, nil)
	if dest, _, _ := normal.decision(); dest == "" {
		t.Error("the ordinary request got no destination")
	}

	<-allDone
	close(stopSampling)
	<-sampled
	close(outcomes)
	refused, whole := 0, 0
	for o := range outcomes {
		switch {
		case o.err != nil:
			t.Errorf("stream: %v", o.err)
		case o.code == typev3.StatusCode_TooManyRequests && strings.Contains(o.body, "bytes of request bodies"):
			refused++
		case o.code == typev3.StatusCode_BadRequest: // read whole, then found not JSON
			whole++
		default:
			t.Errorf("stream answered %v %q, want 429 or 400", o.code, o.body)
		}
	}
	t.Logf("%d streams refused, %d read whole; budget peak %d MiB; heap peak %d MiB over %d MiB before",
		refused, whole, s.budget.peak.Load()>>20, (peak.Load()-base)>>20, base>>20)
	if refused == 0 || whole == 0 {
		t.Errorf("%d refused and %d read whole: want some of each", refused, whole)
	}
	if got := s.budget.peak.Load(); got > budget || got < budget/2 {
		t.Errorf("buffered bytes peaked at %d, want at most the %d budget (and most of it)", got, budget)
	}
	// What else the heap holds at once: gRPC's messages in flight (on
	// each stream, the client's marshalled chunk, the server's received
	// frames and its unmarshalled copy, and the buffer a growth copies
	// from) and garbage not yet collected. Without the budget the streams
	// hold 40 × 16 MiB.
	// Under the race detector sync.Pool drops what it is given, so gRPC's
	// buffers are garbage: the heap says nothing of what is held there.
	if over, bound := int64(peak.Load())-int64(base), budget+int64(6*streams*chunk); over > bound && !decisiontest.RaceEnabled {
		t.Errorf("heap peaked %d MiB over its start, want ≤ %d MiB (the budget and 6 chunks in flight a stream)", over>>20, bound>>20)
	}
	if n := testutil.ToFloat64(s.lm.limited.WithLabelValues(limitBuffered)); int(n) != refused {
		t.Errorf("prefixlb_epp_limited_total{limit=buffered_bytes} = %v, want %d", n, refused)
	}
	closeStream(t, normal)
	if used, g := s.budget.used.Load(), testutil.ToFloat64(s.lm.buffered); used != 0 || g != 0 {
		t.Errorf("after every stream ended: %d bytes held, gauge %v; want 0", used, g)
	}
}

// TestByteBudgetReserve: bodies still arriving share all but the last
// eighth of the budget; a body of at most smallBody bytes that its
// message completes may take that eighth too.
func TestByteBudgetReserve(t *testing.T) {
	const mib = 1 << 20
	s := NewServer(newTestPicker(t, Config{}, 1), ServerConfig{Limits: Limits{MaxBufferedBytes: 64 * mib}})
	b := s.budget
	steps := []struct {
		n, size int64
		whole   bool
		want    bool
	}{
		{56 * mib, 15 * mib, false, true}, // arriving bodies: up to 7/8
		{1, mib, false, false},            // no more for them
		{mib, mib, true, true},            // a small whole body: the reserve
		{8 * mib, 8 * mib, true, false},   // a large whole one: not
		{7 * mib, smallBody, true, true},  // the reserve is all there is
		{1, 1, true, false},               // and then none
	}
	for i, st := range steps {
		if got := b.take(st.n, st.size, st.whole); got != st.want {
			t.Errorf("step %d: take(%d, %d, %v) = %v, want %v", i, st.n, st.size, st.whole, got, st.want)
		}
	}
	if b.used.Load() != 64*mib || b.peak.Load() != 64*mib {
		t.Errorf("used %d, peak %d; want %d", b.used.Load(), b.peak.Load(), 64*mib)
	}
	b.give(64 * mib)
	if got := testutil.ToFloat64(s.lm.buffered); got != 0 || b.used.Load() != 0 {
		t.Errorf("after giving all back: used %d, gauge %v", b.used.Load(), got)
	}
}

// TestLimitsValidate: zero fields take their defaults; each out-of-range
// limit is refused naming its flag.
func TestLimitsValidate(t *testing.T) {
	if err := (Limits{}).Validate(); err != nil {
		t.Fatalf("zero limits (defaults): %v", err)
	}
	if got, want := (Limits{}).withDefaults(), DefaultLimits(); got != want {
		t.Errorf("withDefaults = %+v, want %+v", got, want)
	}
	for _, c := range []struct {
		l    Limits
		want string
	}{
		{Limits{MaxStreams: -1}, "--max-streams"},
		{Limits{MaxBufferedBytes: 1 << 20}, "--max-buffered-bytes"},
		{Limits{StreamIdleTimeout: -time.Second}, "--stream-idle-timeout"},
		{Limits{MaxRecvMsgBytes: 1}, "max_recv_msg_bytes"},
		{Limits{MaxHeaderListBytes: 1}, "max_header_list_bytes"},
		{Limits{KeepaliveTime: -time.Second}, "keepalive"},
	} {
		if err := c.l.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", c.l, err, c.want)
		}
	}
}
