package epp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// newTestPicker returns a picker over ready replicas r0..r(n-1) at
// 10.0.0.(i+1):8000.
func newTestPicker(t *testing.T, cfg Config, n int) *Picker {
	t.Helper()
	if cfg.Policy == "" {
		cfg.Policy = "e2"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p, err := NewPicker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		p.Add(Replica{Name: fmt.Sprintf("r%d", i), Address: addr(i), Ready: true})
	}
	return p
}

func addr(i int) string { return fmt.Sprintf("10.0.0.%d:8000", i+1) }

// startServer serves s over an in-memory listener and returns a client.
func startServer(t *testing.T, s *Server) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	s.Register(g)
	healthpb.RegisterHealthServer(g, s.Health())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
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

// envoy is a client that behaves as Envoy's ext_proc filter does with
// request and response bodies in FULL_DUPLEX_STREAMED mode.
type envoy struct {
	t      *testing.T
	stream extprocv3.ExternalProcessor_ProcessClient
	// answered, when set, lets a send find the stream closed: the test
	// expects an immediate answer before the request is all sent.
	answered bool
}

func newEnvoy(t *testing.T, conn *grpc.ClientConn) *envoy {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &envoy{t: t, stream: st}
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func (e *envoy) send(r *extprocv3.ProcessingRequest) {
	e.t.Helper()
	if err := e.stream.Send(r); err != nil {
		if errors.Is(err, io.EOF) && e.answered {
			return // the server answered at once and closed; Envoy stops sending too
		}
		e.t.Fatalf("send: %v", err)
	}
}

func (e *envoy) recv() *extprocv3.ProcessingResponse {
	e.t.Helper()
	r, err := e.stream.Recv()
	if err != nil {
		e.t.Fatalf("recv: %v", err)
	}
	return r
}

// request sends the request headers (with md as metadata_context) and the
// body in chunks of chunk bytes, the last with end_of_stream.
func (e *envoy) request(path string, body []byte, chunk int, md *corev3.Metadata, extra ...string) {
	e.t.Helper()
	h := hdrs(append([]string{":method", "POST", ":path", path, "content-type", "application/json"}, extra...)...)
	e.send(&extprocv3.ProcessingRequest{MetadataContext: md,
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: h}}})
	for i := 0; i < len(body); i += chunk {
		end := min(i+chunk, len(body))
		e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[i:end], EndOfStream: end == len(body)}}})
	}
}

// decision reads the request-headers response and the streamed body; it
// returns the destination header, the metadata value and the body.
func (e *envoy) decision() (header, meta string, body []byte) {
	e.t.Helper()
	r := e.recv()
	rh := r.GetRequestHeaders()
	if rh == nil {
		e.t.Fatalf("first response is %T, want RequestHeaders: %v", r.Response, r)
	}
	for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == DestinationHeader {
			header = string(h.GetHeader().GetRawValue())
		}
	}
	meta = r.GetDynamicMetadata().GetFields()[DestinationNamespace].GetStructValue().GetFields()[DestinationHeader].GetStringValue()
	for {
		r := e.recv()
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			e.t.Fatalf("body response is %v, want a streamed body", r)
		}
		if len(sr.Body) > bodyChunkBytes {
			e.t.Fatalf("body chunk of %d bytes, want ≤ %d", len(sr.Body), bodyChunkBytes)
		}
		body = append(body, sr.Body...)
		if sr.EndOfStream {
			return header, meta, body
		}
	}
}

// immediate reads an ImmediateResponse and returns its status.
func (e *envoy) immediate() typev3.StatusCode {
	e.t.Helper()
	r := e.recv()
	ir := r.GetImmediateResponse()
	if ir == nil {
		e.t.Fatalf("response is %v, want ImmediateResponse", r)
	}
	return ir.GetStatus().GetCode()
}

// respond plays the upstream's response: headers (with the served
// endpoint in envoy.lb metadata) then body chunks; each must come back
// unchanged. after is called after each chunk's answer.
func (e *envoy) respond(served, contentType string, chunks []string, after func(i int)) {
	e.t.Helper()
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		DestinationNamespace: mustStruct(e.t, map[string]any{ServedKey: served})}}
	e.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: hdrs(":status", "200", "content-type", contentType)}}})
	if r := e.recv(); r.GetResponseHeaders() == nil {
		e.t.Fatalf("response is %v, want ResponseHeaders", r)
	}
	for i, c := range chunks {
		eos := i == len(chunks)-1
		e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: []byte(c), EndOfStream: eos}}})
		sr := e.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil || string(sr.Body) != c || sr.EndOfStream != eos {
			e.t.Fatalf("response body chunk %d came back as %v, want %q eos=%v unchanged", i, sr, c, eos)
		}
		if after != nil {
			after(i)
		}
	}
}

func mustStruct(t *testing.T, m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func subsetHint(t *testing.T, eps ...string) *corev3.Metadata {
	l := make([]any, len(eps))
	for i, e := range eps {
		l[i] = e
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		SubsetNamespace: mustStruct(t, map[string]any{SubsetKey: l})}}
}

func completionBody(prompt string, stream bool) []byte {
	return fmt.Appendf(nil, `{"model":"m","prompt":%q,"max_tokens":8,"stream":%v}`, prompt, stream)
}

// state returns replica name's router state.
func state(t *testing.T, p *Picker, name string) (inflight, prefilling int) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.pool.ByName(name)
	if r == nil {
		t.Fatalf("no replica %s", name)
	}
	st, _ := p.rt.Replica(r.ID)
	return st.InFlight, st.Prefilling
}

func TestExtProcFullDuplex(t *testing.T) {
	p := newTestPicker(t, Config{}, 3)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))

	// A 150 KB prompt in 40 KB chunks, as Envoy buffers nothing.
	body := completionBody(strings.Repeat("You are a helpful assistant. ", 5000), true)
	e.request("/v1/completions", body, 40000, nil)
	header, meta, echoed := e.decision()
	eps := strings.Split(header, ",")
	if len(eps) != 3 {
		t.Fatalf("%s = %q: want a primary and 2 fallbacks", DestinationHeader, header)
	}
	if meta != header {
		t.Errorf("metadata %s.%s = %q, want the header's %q", DestinationNamespace, DestinationHeader, meta, header)
	}
	if !bytes.Equal(echoed, body) {
		t.Errorf("body came back changed (%d bytes, want %d)", len(echoed), len(body))
	}
	primary := eps[0]
	name := map[string]string{addr(0): "r0", addr(1): "r1", addr(2): "r2"}[primary]
	if n, _ := state(t, p, name); n != 1 {
		t.Fatalf("%s in flight %d after the pick, want 1", name, n)
	}

	sse := []string{
		"data: {\"choices\":[{\"text\":\"\"}]}\n\n",
		"data: {\"choices\":[{\"text\":\"Hel",
		"lo\"}]}\n\ndata: {\"choices\":[{\"text\":\" world\"}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":37500,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n",
	}
	e.respond(primary, "text/event-stream", sse, func(i int) {
		_, prefilling := state(t, p, name)
		if want := map[bool]int{true: 1, false: 0}[i < 2]; prefilling != want {
			t.Errorf("after chunk %d %s prefilling = %d, want %d (first token in chunk 2)", i, name, prefilling, want)
		}
	})
	if n, _ := state(t, p, name); n != 0 {
		t.Errorf("%s in flight %d after the response ended, want 0", name, n)
	}
	if st := stats(p); st.Finished != 1 || st.PredictionsChecked != 1 {
		t.Errorf("router stats %+v, want 1 finished with a cached-tokens report", st)
	}
}

// TestExtProcSameReplicaForSharedPrefix: the second request with the same
// long prefix goes where the first went (the cache is there).
func TestExtProcSameReplicaForSharedPrefix(t *testing.T) {
	p := newTestPicker(t, Config{}, 4)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	prefix := strings.Repeat("system prompt with tools ", 2000)
	var first string
	for i := range 3 {
		e := newEnvoy(t, conn)
		e.request("/v1/completions", completionBody(prefix+fmt.Sprint(i), false), 16384, nil)
		h, _, _ := e.decision()
		primary, _, _ := strings.Cut(h, ",")
		if i == 0 {
			first = primary
		} else if primary != first {
			t.Errorf("request %d went to %s, want %s (shared prefix)", i, primary, first)
		}
		e.respond(primary, "application/json", []string{`{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`}, nil)
	}
}

func TestExtProcChat(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	e.request("/v1/chat/completions", body, 10, nil, SessionHeader, "s1")
	h, _, echoed := e.decision()
	if h == "" || !bytes.Equal(echoed, body) {
		t.Fatalf("chat: destination %q, body %q", h, echoed)
	}
}

func TestExtProcSubsetHint(t *testing.T) {
	p := newTestPicker(t, Config{}, 4)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	for range 3 {
		e := newEnvoy(t, conn)
		e.request("/v1/completions", completionBody("hello", false), 1000, subsetHint(t, addr(2), addr(3)))
		h, _, _ := e.decision()
		for _, ep := range strings.Split(h, ",") {
			if ep != addr(2) && ep != addr(3) {
				t.Fatalf("destination %q has %s, outside the subset hint", h, ep)
			}
		}
	}
	// A subset with nothing ready in it: 503.
	e := newEnvoy(t, conn)
	e.request("/v1/completions", completionBody("hello", false), 1000, subsetHint(t, "10.9.9.9:8000"))
	if got := e.immediate(); got != typev3.StatusCode_ServiceUnavailable {
		t.Errorf("unknown subset: status %v, want 503", got)
	}
	p.SetReady("r2", false)
	p.SetReady("r3", false)
	e = newEnvoy(t, conn)
	e.request("/v1/completions", completionBody("hello", false), 1000, subsetHint(t, addr(2), addr(3)))
	if got := e.immediate(); got != typev3.StatusCode_ServiceUnavailable {
		t.Errorf("unready subset: status %v, want 503", got)
	}
}

func TestExtProcErrors(t *testing.T) {
	t.Run("no endpoint", func(t *testing.T) {
		p := newTestPicker(t, Config{}, 0)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
		e.request("/v1/completions", completionBody("hi", false), 100, nil)
		if got := e.immediate(); got != typev3.StatusCode_ServiceUnavailable {
			t.Errorf("status %v, want 503", got)
		}
	})
	t.Run("none ready", func(t *testing.T) {
		p := newTestPicker(t, Config{}, 2)
		p.SetReady("r0", false)
		p.SetReady("r1", false)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
		e.request("/v1/completions", completionBody("hi", false), 100, nil)
		if got := e.immediate(); got != typev3.StatusCode_ServiceUnavailable {
			t.Errorf("status %v, want 503", got)
		}
	})
	t.Run("bad body", func(t *testing.T) {
		p := newTestPicker(t, Config{}, 2)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
		e.request("/v1/completions", []byte(`{"model":"m","prompt":`), 5, nil)
		if got := e.immediate(); got != typev3.StatusCode_BadRequest {
			t.Errorf("status %v, want 400", got)
		}
	})
	t.Run("too large", func(t *testing.T) {
		p := newTestPicker(t, Config{}, 2)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{MaxBodyBytes: 100})))
		// The server answers 413 once 100 bytes are in and may close the
		// stream while the rest of the body is still being sent.
		e.answered = true
		e.request("/v1/completions", completionBody(strings.Repeat("x", 200), false), 50, nil)
		if got := e.immediate(); got != typev3.StatusCode_PayloadTooLarge {
			t.Errorf("status %v, want 413", got)
		}
	})
	t.Run("prompt too long", func(t *testing.T) {
		// serve's max_prompt_tokens, held the same way: 400 before a decision.
		p := newTestPicker(t, Config{MaxPromptTokens: 10}, 2)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
		e.request("/v1/completions", completionBody(strings.Repeat("x", 200), false), 1<<20, nil)
		if got := e.immediate(); got != typev3.StatusCode_BadRequest {
			t.Errorf("status %v, want 400", got)
		}
		if n := p.rt.InFlight(); n != 0 {
			t.Errorf("%d requests routed", n)
		}
	})
	t.Run("shed", func(t *testing.T) {
		// Two replicas, at most 2 queued each: the fifth request is shed.
		p := newTestPicker(t, Config{MaxQueue: 2, Policy: "least-load"}, 2)
		conn := startServer(t, NewServer(p, ServerConfig{}))
		for i := range 4 {
			e := newEnvoy(t, conn)
			e.request("/v1/completions", completionBody(fmt.Sprint("p", i), false), 100, nil)
			e.decision() // stays in flight: the stream is left open
		}
		e := newEnvoy(t, conn)
		e.request("/v1/completions", completionBody("p5", false), 100, nil)
		if got := e.immediate(); got != typev3.StatusCode_TooManyRequests {
			t.Errorf("status %v, want 429", got)
		}
		// An engine that reports a short queue is not saturated.
		p.mu.Lock()
		_ = p.rt.ReplicaLoad(0, 0, 1, 0.1)
		p.mu.Unlock()
		e = newEnvoy(t, conn)
		e.request("/v1/completions", completionBody("p6", false), 100, nil)
		if h, _, _ := e.decision(); !strings.HasPrefix(h, addr(0)) {
			t.Errorf("destination %q, want %s first (its engine reports 1 queued)", h, addr(0))
		}
	})
}

// TestExtProcServedElsewhere: the gateway fell back to another endpoint;
// the request's load moves there.
func TestExtProcServedElsewhere(t *testing.T) {
	p := newTestPicker(t, Config{}, 3)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
	e.request("/v1/completions", completionBody("hello there", true), 100, nil)
	h, _, _ := e.decision()
	eps := strings.Split(h, ",")
	e.respond(eps[1], "text/event-stream", []string{"data: {\"choices\":[{\"text\":\"a\"}]}\n\n"}, func(int) {})
	// The response ended: every replica is back at 0.
	for _, n := range []string{"r0", "r1", "r2"} {
		if f, _ := state(t, p, n); f != 0 {
			t.Errorf("%s in flight %d after the response, want 0", n, f)
		}
	}
	if st := stats(p); st.Finished != 1 || st.Failed != 1 {
		t.Errorf("router stats %+v: want the primary's flight failed over and the served one finished", st)
	}
}

// TestExtProcStreamCut: Envoy closes the stream before the response ends:
// the request finishes (failed) and leaves nothing in flight.
func TestExtProcStreamCut(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	ctx, cancel := context.WithCancel(context.Background())
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e := &envoy{t: t, stream: st}
	e.request("/v1/completions", completionBody("hi", false), 100, nil)
	e.decision()
	finished := make(chan struct{})
	p.mu.Lock()
	p.onFinish = func() { close(finished) }
	p.mu.Unlock()
	cancel()
	<-finished
	for _, r := range p.Replicas() {
		if r.InFlight != 0 {
			t.Errorf("%s in flight %d after the stream was cut, want 0", r.Name, r.InFlight)
		}
	}
	if st := stats(p); st.Failed != 1 {
		t.Errorf("router stats %+v, want 1 failed", st)
	}
}

func TestHealth(t *testing.T) {
	p := newTestPicker(t, Config{}, 1)
	s := NewServer(p, ServerConfig{})
	conn := startServer(t, s)
	hc := healthpb.NewHealthClient(conn)
	s.SetServing(true)
	r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: extprocv3.ExternalProcessor_ServiceDesc.ServiceName})
	if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health = %v, %v; want SERVING", r, err)
	}
	s.SetServing(false)
	if r, _ := hc.Check(context.Background(), &healthpb.HealthCheckRequest{}); r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health = %v, want NOT_SERVING", r)
	}
}

// stats returns the router's counters under the picker's lock.
func stats(p *Picker) router.Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rt.Stats()
}

// TestExtProcExplainTerms: with Explain, the answer explains e2's decision
// term by term (x-prefixlb-route-terms) beside x-prefixlb-route; without
// it (the default), or for a request that does not present the admin
// token under ExplainTrusted, neither header is set. The token header is
// always removed from the request the replica gets.
func TestExtProcExplainTerms(t *testing.T) {
	for _, tc := range []struct {
		mode    tenancy.Explain
		headers []string
		explain bool
	}{
		{tenancy.ExplainAlways, nil, true},
		{"", nil, false},
		{"", []string{tenancy.TokenHeader, "tok"}, true}, // the default is trusted
		{tenancy.ExplainNever, []string{tenancy.TokenHeader, "tok"}, false},
		{tenancy.ExplainTrusted, nil, false},
		{tenancy.ExplainTrusted, []string{tenancy.TokenHeader, "nope"}, false},
		{tenancy.ExplainTrusted, []string{tenancy.TokenHeader, "tok"}, true},
		{tenancy.ExplainTrusted, []string{"authorization", "Bearer tok"}, true},
	} {
		explain := tc.explain
		p := newTestPicker(t, Config{}, 2)
		e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{Explain: tc.mode, AdminToken: "tok"})))
		e.request("/v1/completions", completionBody("hello there", false), 1<<20, nil, tc.headers...)
		got := map[string]string{}
		mut := e.recv().GetRequestHeaders().GetResponse().GetHeaderMutation()
		for _, h := range mut.GetSetHeaders() {
			got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
		}
		if !slices.Contains(mut.GetRemoveHeaders(), tenancy.TokenHeader) {
			t.Errorf("%s %v: %s is not removed", tc.mode, tc.headers, tenancy.TokenHeader)
		}
		terms, route := got[RouteTermsHeader], got[RouteHeader]
		if !explain {
			if terms != "" || route != "" {
				t.Errorf("%s %v: without Explain: %q, %q", tc.mode, tc.headers, route, terms)
			}
			continue
		}
		if route == "" {
			t.Error("no x-prefixlb-route")
		}
		for _, name := range []string{"r0:", "r1:", "decode=", "history=", "pending=", "interference=", "self_decode=",
			"prefill_slowdown=", "slot_wait=", "eviction=", "prefill="} {
			if !strings.Contains(terms, name) {
				t.Errorf("x-prefixlb-route-terms %q lacks %q", terms, name)
			}
		}
	}
}
