package proxy

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// scriptPicker is an ext_proc server whose every stream runs fn: a
// picker that does what a test says, conformant or hostile.
type scriptPicker struct {
	extprocv3.UnimplementedExternalProcessorServer
	fn func(extprocv3.ExternalProcessor_ProcessServer) error
}

func (s *scriptPicker) Process(srv extprocv3.ExternalProcessor_ProcessServer) error { return s.fn(srv) }

// startScript serves fn as a picker on a loopback port until the test
// ends.
func startScript(t testing.TB, fn func(extprocv3.ExternalProcessor_ProcessServer) error) string {
	t.Helper()
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, &scriptPicker{fn: fn})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = g.Serve(ln); close(done) }()
	t.Cleanup(func() { g.Stop(); <-done })
	return ln.Addr().String()
}

// seenRequest is what a script read of the request path.
type seenRequest struct {
	headers map[string]string
	md      *corev3.Metadata
	pc      *extprocv3.ProtocolConfiguration
	body    []byte
}

// readRequest reads the request headers and body to end_of_stream.
func readRequest(srv extprocv3.ExternalProcessor_ProcessServer) (seenRequest, error) {
	var s seenRequest
	req, err := srv.Recv()
	if err != nil {
		return s, err
	}
	h := req.GetRequestHeaders()
	if h == nil {
		return s, fmt.Errorf("first message %T, want request headers", req.GetRequest())
	}
	s.headers, s.md, s.pc = map[string]string{}, req.GetMetadataContext(), req.GetProtocolConfig()
	for _, hv := range h.GetHeaders().GetHeaders() {
		s.headers[hv.GetKey()] = string(hv.GetRawValue())
	}
	eos := h.GetEndOfStream()
	for !eos {
		req, err := srv.Recv()
		if err != nil {
			return s, err
		}
		b := req.GetRequestBody()
		s.body = append(s.body, b.GetBody()...)
		eos = b.GetEndOfStream()
	}
	return s, nil
}

// pickAnswer is a picker's answer to the request path.
type pickAnswer struct {
	header, meta string                      // destination header and envoy.lb metadata ("": not set)
	set          []*corev3.HeaderValueOption // more request header mutations
	body         []byte                      // the body sent back (nil: the body as read)
	chunk        int                         // chunk size of the body sent back (0: whole)
}

func (a pickAnswer) send(srv extprocv3.ExternalProcessor_ProcessServer, body []byte) error {
	set := append([]*corev3.HeaderValueOption(nil), a.set...)
	if a.header != "" {
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: gieDestination, RawValue: []byte(a.header)}})
	}
	var md *structpb.Struct
	if a.meta != "" {
		md, _ = structpb.NewStruct(map[string]any{gieNamespace: map[string]any{gieDestination: a.meta}})
	}
	if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}}}, DynamicMetadata: md}); err != nil {
		return err
	}
	if a.body != nil {
		body = a.body
	}
	n := a.chunk
	if n <= 0 {
		n = max(len(body), 1)
	}
	for first := true; first || len(body) > 0; first = false {
		c := body[:min(n, len(body))]
		body = body[len(c):]
		if err := srv.Send(streamed(true, c, len(body) == 0)); err != nil {
			return err
		}
	}
	return nil
}

// streamed is a streamed body answer of the request (req) or response path.
func streamed(req bool, b []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos}}}}}
	if req {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// echoResponse answers the response path as a conformant picker: the
// headers (with respSet added), then every body chunk echoed, until
// end_of_stream. failAfter > 0 ends the stream with an error after that
// many body chunks.
func echoResponse(srv extprocv3.ExternalProcessor_ProcessServer, respSet []*corev3.HeaderValueOption, failAfter int) error {
	chunks := 0
	for {
		req, err := srv.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		switch v := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
				Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: respSet}}}}}); err != nil {
				return err
			}
			if v.ResponseHeaders.GetEndOfStream() {
				return nil
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			chunks++
			if failAfter > 0 && chunks > failAfter {
				return status.Error(codes.Internal, "picker broke down")
			}
			if err := srv.Send(streamed(false, v.ResponseBody.GetBody(), v.ResponseBody.GetEndOfStream())); err != nil {
				return err
			}
			if v.ResponseBody.GetEndOfStream() {
				return nil
			}
		}
	}
}

// conformant is a picker that names a (both header and metadata when
// a.meta is "same"), then echoes the response.
func conformant(a pickAnswer) func(extprocv3.ExternalProcessor_ProcessServer) error {
	return func(srv extprocv3.ExternalProcessor_ProcessServer) error {
		s, err := readRequest(srv)
		if err != nil {
			return err
		}
		if a.meta == "same" {
			a.meta = a.header
		}
		if err := a.send(srv, s.body); err != nil {
			return err
		}
		return echoResponse(srv, nil, 0)
	}
}

func hv(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

// TestGIEPickerAnswers drives serve with scripted pickers, conformant
// and hostile, over one real engine: each answer is honoured or refused
// with a clear error, and nothing panics.
func TestGIEPickerAnswers(t *testing.T) {
	engines := startGIEEngines(t, 2)
	e0, e1 := engines[0].addr, engines[1].addr
	big := make([]byte, 300<<10)
	for i := range big {
		big[i] = 'x'
	}
	hang := func(srv extprocv3.ExternalProcessor_ProcessServer) error {
		<-srv.Context().Done()
		return nil
	}
	cases := []struct {
		name     string
		fn       func(extprocv3.ExternalProcessor_ProcessServer) error
		status   int
		contains string // in the error body
		served   string // the engine that must serve ("": none)
		reason   string // prefixlb_picker_failures_total's reason that must count
	}{
		// Destination Endpoint: "Setting the x-gateway-destination-endpoint
		// HTTP header" alone ...
		{name: "header only", fn: conformant(pickAnswer{header: e1}), status: 200, served: e1},
		// ... or the envoy.lb dynamic metadata alone.
		{name: "metadata only", fn: conformant(pickAnswer{meta: e1}), status: 200, served: e1},
		{name: "both", fn: conformant(pickAnswer{header: e0, meta: "same"}), status: 200, served: e0},
		// "The EPP MUST not set two different values in the header and the
		// inner response metadata value": serve goes by the metadata.
		{name: "header and metadata differ", fn: conformant(pickAnswer{header: e1, meta: e0}), status: 200, served: e0},
		// "The first valid endpoint in the list will be used."
		{name: "invalid first", fn: conformant(pickAnswer{meta: "no-port," + e1}), status: 200, served: e1},
		// Endpoint Subset: "the EPP MUST only select endpoints from the
		// specified list": one outside it is refused ...
		{name: "outside the subset", fn: conformant(pickAnswer{meta: "10.255.0.1:8000"}), status: 503, contains: "none of serve's replicas", reason: gieSubset},
		// ... and the next one in the list is used.
		{name: "outside then inside", fn: conformant(pickAnswer{meta: "10.255.0.1:8000," + e0}), status: 200, served: e0},
		// "If the EPP did not communicate the server endpoint via these
		// two methods, it MUST return an error": a picker that names none
		// broke the protocol.
		{name: "no destination", fn: conformant(pickAnswer{}), status: 502, contains: "no x-gateway-destination-endpoint", reason: gieProtocol},
		{name: "garbage endpoint", fn: conformant(pickAnswer{meta: "a b c"}), status: 502, contains: "no valid endpoint", reason: gieProtocol},
		{name: "garbage header name", fn: conformant(pickAnswer{meta: e0, set: []*corev3.HeaderValueOption{hv("bad name", "v")}}), status: 502, contains: "not a header name", reason: gieProtocol},
		{name: "garbage header value", fn: conformant(pickAnswer{meta: e0, set: []*corev3.HeaderValueOption{hv("x-ok", "a\r\nb")}}), status: 502, contains: "not a header value", reason: gieProtocol},
		{name: "huge body", fn: conformant(pickAnswer{meta: e0, body: big, chunk: 60000}), status: 502, contains: "request body over", reason: gieProtocol},
		// ImmediateResponse, e.g. "429 (Too Many Requests) ... if the
		// request should be dropped", reaches the client as sent.
		{name: "immediate 429", fn: func(srv extprocv3.ExternalProcessor_ProcessServer) error {
			if _, err := readRequest(srv); err != nil {
				return err
			}
			return srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
				Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests}, Body: []byte(`{"error":"shed by the picker"}`)}}})
		}, status: 429, contains: "shed by the picker"},
		{name: "closes without answering", fn: func(srv extprocv3.ExternalProcessor_ProcessServer) error {
			_, err := readRequest(srv)
			return err
		}, status: 503, contains: "closed the stream without answering", reason: gieError},
		{name: "errors", fn: func(srv extprocv3.ExternalProcessor_ProcessServer) error {
			return status.Error(codes.Internal, "picker is broken")
		}, status: 503, contains: "picker is broken", reason: gieError},
		{name: "hangs", fn: hang, status: 503, contains: "no answer within", reason: gieTimeout},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			addr := startScript(t, tc.fn)
			p, srv := gieProxy(t, engines, addr, func(c *Config) {
				c.EndpointPickerTimeout = 300 * time.Millisecond
				c.MaxBodyBytes = 256 << 10
			})
			rid := "rid-" + strings.ReplaceAll(tc.name, " ", "-")
			res := gieSend(t, srv.URL, rid, e2ePrompt(0, 0, 64, 16, 4))
			if res.status != tc.status || !strings.Contains(res.body, tc.contains) {
				t.Fatalf("status %d body %q err %v: want %d with %q", res.status, res.body, res.err, tc.status, tc.contains)
			}
			e := engineOf(engines, rid)
			switch {
			case tc.served == "" && e != nil:
				t.Errorf("served by %s, want by none", e.addr)
			case tc.served != "" && (e == nil || e.addr != tc.served):
				t.Errorf("served by %v, want %s", e, tc.served)
			}
			if tc.served != "" && (!res.done || !res.usage) {
				t.Errorf("stream done=%v usage=%v", res.done, res.usage)
			}
			if tc.reason != "" {
				if got := counter(t, p.m.Reg, "prefixlb_picker_failures_total", "reason", tc.reason); got != 1 {
					t.Errorf("prefixlb_picker_failures_total{reason=%s} = %v, want 1", tc.reason, got)
				}
			}
		})
	}
}

// TestGIEWhatServeSends checks the request path as GIE's picker reads it:
// the headers with pseudo-headers in raw_value, the subset hint in
// filter metadata, FULL_DUPLEX_STREAMED in protocol_config, the body in
// chunks of at most 62000 bytes; and that the picker's mutations of the
// request and of the response are applied.
func TestGIEWhatServeSends(t *testing.T) {
	engines := startGIEEngines(t, 1)
	seen := make(chan seenRequest, 1)
	served := make(chan string, 1)
	addr := startScript(t, func(srv extprocv3.ExternalProcessor_ProcessServer) error {
		s, err := readRequest(srv)
		if err != nil {
			return err
		}
		seen <- s
		// A body rewritten by the picker (as an InferenceModelRewrite
		// does), and a request header it sets.
		body := []byte(strings.Replace(string(s.body), `"max_tokens":16`, `"max_tokens":1`, 1))
		a := pickAnswer{meta: engines[0].addr, body: body, chunk: 100, set: []*corev3.HeaderValueOption{hv("x-request-id", "from-picker")}}
		if err := a.send(srv, nil); err != nil {
			return err
		}
		// Destination Endpoint Served: the response headers carry the
		// endpoint in envoy.lb's x-gateway-destination-endpoint-served.
		req, err := srv.Recv()
		if err != nil {
			return err
		}
		served <- req.GetMetadataContext().GetFilterMetadata()[gieNamespace].GetFields()[gieServed].GetStringValue()
		if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hv("x-picker", "seen")}}}}}}); err != nil {
			return err
		}
		return echoResponse(srv, nil, 0)
	})
	_, srv := gieProxy(t, engines, addr)
	body := e2ePrompt(0, 0, 20000, 16, 16) // ~130 kB: three chunks
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions?x=1", strings.NewReader(body))
	req.Header.Set("X-Gateway-Destination-Endpoint", "10.1.1.1:80") // a client cannot steer
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Picker") != "seen" {
		t.Fatalf("status %d, x-picker %q: %s", resp.StatusCode, resp.Header.Get("X-Picker"), got)
	}
	if n := strings.Count(string(got), `"text":`); n != 1 {
		t.Errorf("%d text events, want 1: the picker's body (max_tokens 1) was not sent", n)
	}
	s := <-seen
	for k, want := range map[string]string{":method": "POST", ":path": "/v1/completions?x=1", ":scheme": "http", ":authority": strings.TrimPrefix(srv.URL, "http://")} {
		if s.headers[k] != want {
			t.Errorf("header %s = %q, want %q", k, s.headers[k], want)
		}
	}
	if _, ok := s.headers[gieDestination]; ok {
		t.Errorf("the client's %s reached the picker", gieDestination)
	}
	if s.headers["x-request-id"] == "" {
		t.Error("no x-request-id sent")
	}
	if string(s.body) != body {
		t.Errorf("picker read %d body bytes, want %d", len(s.body), len(body))
	}
	if s.pc.GetRequestBodyMode().String() != "FULL_DUPLEX_STREAMED" || s.pc.GetResponseBodyMode().String() != "FULL_DUPLEX_STREAMED" {
		t.Errorf("protocol_config %v", s.pc)
	}
	sub := s.md.GetFilterMetadata()[gieSubsetNamespace].GetFields()[gieSubsetKey].GetListValue().GetValues()
	if len(sub) != 1 || sub[0].GetStringValue() != engines[0].addr {
		t.Errorf("subset hint %v, want [%s]", sub, engines[0].addr)
	}
	if ep := <-served; ep != engines[0].addr {
		t.Errorf("served metadata %q, want %s", ep, engines[0].addr)
	}
	if saw := engines[0].saw(); len(saw) != 1 || saw[0] != "from-picker" {
		t.Errorf("engine saw x-request-id %v, want the picker's", saw)
	}
}

// TestGIEPickerFailsMidResponse: a picker that errors after the first
// response body chunk cuts the client's stream when failing closed
// (Envoy resets the stream without failure_mode_allow), and lets the rest
// of the response through when failing open.
func TestGIEPickerFailsMidResponse(t *testing.T) {
	engines := startGIEEngines(t, 1)
	addr := startScript(t, func(srv extprocv3.ExternalProcessor_ProcessServer) error {
		s, err := readRequest(srv)
		if err != nil {
			return err
		}
		if err := (pickAnswer{meta: engines[0].addr}).send(srv, s.body); err != nil {
			return err
		}
		return echoResponse(srv, nil, 1)
	})
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", open), func(t *testing.T) {
			p, srv := gieProxy(t, engines, addr, func(c *Config) { c.EndpointPickerFailOpen = open })
			res := gieSend(t, srv.URL, "mid", e2ePrompt(0, 0, 64, 16, 200))
			if res.status != 200 {
				t.Fatalf("status %d", res.status)
			}
			if open && (!res.done || !res.usage || res.events != 200) {
				t.Errorf("fail open: done=%v usage=%v events=%d err=%v: want the whole stream", res.done, res.usage, res.events, res.err)
			}
			if !open && (res.done || res.err == nil) {
				t.Errorf("fail closed: done=%v err=%v: want the stream cut", res.done, res.err)
			}
			if got := counter(t, p.m.Reg, "prefixlb_picker_failures_total", "reason", gieResponse); got != 1 {
				t.Errorf("prefixlb_picker_failures_total{reason=response} = %v, want 1", got)
			}
		})
	}
}
