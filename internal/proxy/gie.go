package proxy

// The GIE data plane: with Config.EndpointPicker set, serve asks a Gateway
// API Inference Extension endpoint picker where each inference request
// goes, as Envoy's ext_proc filter would in front of it, and forwards the
// request there itself. The protocol is kubernetes-sigs/
// gateway-api-inference-extension's docs/proposals/
// 004-endpoint-picker-protocol/README.md (commit 0fc3b125, protocol
// v1.0.0) over Envoy's ext_proc v3 in FULL_DUPLEX_STREAMED body mode on
// both paths, the mode GIE's picker requires (pkg/epp/handlers/server.go:
// "Order of requests matter in FULL_DUPLEX_STREAMING"). docs/gie.md lists
// the conformance points; the tests cite them by name.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/prefixlb/prefixlb/internal/openai"
)

// gieChunkBytes bounds each body chunk sent to the picker: some Envoy
// builds cap a streamed chunk at 64 KiB and pickers keep their answers
// under it (GIE's bodyByteLimit is 62000); the same margin here.
const gieChunkBytes = 62000

// Reasons a picker exchange failed, as prefixlb_picker_failures_total's
// labels.
const (
	gieUnavailable = "unavailable" // no connection, or the stream could not open
	gieTimeout     = "timeout"     // no answer within EndpointPickerTimeout
	gieError       = "error"       // the picker ended the stream with an error, or without answering
	gieProtocol    = "protocol"    // the answer broke the protocol (garbage, no endpoint, out of order)
	gieSubset      = "subset"      // every endpoint named was outside the subset sent
	gieResponse    = "response"    // the picker failed on the response path
)

// gieClient is the proxy's connection to the endpoint picker.
type gieClient struct {
	addr string
	conn *grpc.ClientConn
	cli  extprocv3.ExternalProcessorClient
	m    *gieMetrics
}

// gieMetrics count the picker's work.
type gieMetrics struct {
	calls     *prometheus.CounterVec // outcome
	failures  *prometheus.CounterVec // reason
	fallbacks *prometheus.CounterVec // kind
	pick      prometheus.Histogram
}

func newGIEMetrics(reg prometheus.Registerer) (*gieMetrics, error) {
	m := &gieMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_picker_calls_total",
			Help: "Requests sent to the endpoint picker, by outcome: routed (it named an endpoint), immediate (it answered the request itself), failed.",
		}, []string{"outcome"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_picker_failures_total",
			Help: "Endpoint picker failures by reason: unavailable, timeout, error (it ended the stream), protocol (a garbage answer), subset (only endpoints outside the subset named), response (on the response path).",
		}, []string{"reason"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_picker_fallbacks_total",
			Help: "Fallbacks by kind: endpoint (the next endpoint of the picker's list, after a connection failure), fail_open (the request routed by serve's own policy, the picker having failed).",
		}, []string{"kind"}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "prefixlb_picker_pick_seconds",
			Help:    "Time from sending a request to the endpoint picker to knowing its endpoint (or its own answer).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 20),
		}),
	}
	for _, o := range []string{"routed", "immediate", "failed"} {
		m.calls.WithLabelValues(o)
	}
	for _, r := range []string{gieUnavailable, gieTimeout, gieError, gieProtocol, gieSubset, gieResponse} {
		m.failures.WithLabelValues(r)
	}
	for _, k := range []string{"endpoint", "fail_open"} {
		m.fallbacks.WithLabelValues(k)
	}
	for _, c := range []prometheus.Collector{m.calls, m.failures, m.fallbacks, m.pick} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// newGIEClient makes the picker's client (it connects on first use).
func newGIEClient(addr string, reg prometheus.Registerer) (*gieClient, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("proxy: endpoint picker %s: %w", addr, err)
	}
	m, err := newGIEMetrics(reg)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("proxy: metrics: %w", err)
	}
	return &gieClient{addr: addr, conn: conn, cli: extprocv3.NewExternalProcessorClient(conn), m: m}, nil
}

// inference is the handler of one kind of inference request: through the
// endpoint picker when one is configured, else serve's own routing.
func (p *Proxy) inference(kind openai.Kind) http.HandlerFunc {
	if p.gie != nil {
		return func(w http.ResponseWriter, r *http.Request) { p.serveGIE(w, r, kind) }
	}
	return func(w http.ResponseWriter, r *http.Request) { p.serveInference(w, r, kind) }
}

// pickerError is a failed exchange with the picker.
type pickerError struct {
	reason string
	err    error
}

func (e *pickerError) Error() string { return e.err.Error() }
func (e *pickerError) Unwrap() error { return e.err }

// status is the HTTP status a failed-closed request gets: 503 for a
// picker that is down, slow or erring, or that named no eligible endpoint
// (the protocol's own answer when none is); 502 for garbage.
func (e *pickerError) status() int {
	if e.reason == gieProtocol {
		return http.StatusBadGateway
	}
	return http.StatusServiceUnavailable
}

// gieDecision is the picker's answer to a request: its own response
// (immediate), or the endpoints with the request as mutated.
type gieDecision struct {
	immediate *extprocv3.ImmediateResponse
	header    http.Header
	body      []byte
	endpoints []string
}

// gieExchange is one request's ext_proc stream.
type gieExchange struct {
	p      *Proxy
	g      *gieClient
	w      http.ResponseWriter
	r      *http.Request
	ctx    context.Context // the stream's
	cancel context.CancelFunc
	st     extprocv3.ExternalProcessor_ProcessClient
	// timedOut is set when EndpointPickerTimeout cancelled the stream.
	timedOut atomic.Bool
	subset   []string
	code     string // outcome label of prefixlb_requests_total
	replica  string
	abort    bool
	// sh is the request's shadow (shadow.go); nil without
	// Config.ShadowPolicy or when the request could not be keyed.
	sh *shadowFlight
}

// serveGIE serves one inference request through the endpoint picker.
func (p *Proxy) serveGIE(w http.ResponseWriter, r *http.Request, kind openai.Kind) {
	g := p.gie
	var cw *clientWriter
	if d := p.cfg.ClientWriteTimeout; d > 0 {
		cw = newClientWriter(w, d)
		w = cw
	}
	body, held, err := readBodyWithin(w, r, p.cfg.MaxBodyBytes, p.bodies)
	if err != nil {
		if errors.Is(err, ErrBodyMemory) {
			p.m.refused.WithLabelValues(refusedBodyMemory).Inc()
			w.Header().Set("Retry-After", "1")
		}
		code := writeError(w, err)
		p.m.requests.WithLabelValues("endpoint-picker", "", strconv.Itoa(code)).Inc()
		if cw != nil {
			cw.finish()
		}
		return
	}
	released := false
	release := func() {
		if !released {
			released = true
			p.bodies.release(held)
		}
	}
	ctx := r.Context()
	if p.cfg.RequestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.cfg.RequestTimeout)
		defer cancel()
	}
	sctx, cancel := context.WithCancel(ctx)
	x := &gieExchange{p: p, g: g, w: w, r: r, ctx: sctx, cancel: cancel}
	if p.shadow != nil {
		x.sh = p.shadowStart(r, kind, body)
	}
	defer func() {
		cancel()
		release()
		if cw != nil {
			cw.finish()
			if cw.timedOut() {
				x.code = codeClientTimeout
			}
		}
		if x.sh != nil {
			p.shadowFinish(x.sh, !x.abort && len(x.code) == 3 && x.code[0] == '2')
		}
		if x.code != "" {
			p.m.requests.WithLabelValues("endpoint-picker", x.replica, x.code).Inc()
		}
		if x.abort {
			panic(http.ErrAbortHandler)
		}
	}()

	start := time.Now()
	d, err := x.pick(body)
	g.m.pick.Observe(time.Since(start).Seconds())
	if err != nil {
		var pe *pickerError
		if !errors.As(err, &pe) {
			pe = &pickerError{reason: gieError, err: err}
		}
		g.m.calls.WithLabelValues("failed").Inc()
		g.m.failures.WithLabelValues(pe.reason).Inc()
		if r.Context().Err() != nil {
			x.code = "cancelled"
			return
		}
		if p.cfg.EndpointPickerFailOpen {
			p.log.Warn("endpoint picker failed: routing with serve's own policy (fail open)", "picker", g.addr, "reason", pe.reason, "err", err)
			g.m.fallbacks.WithLabelValues("fail_open").Inc()
			cancel()
			release()
			r.Body = io.NopCloser(bytes.NewReader(body))
			r.ContentLength = int64(len(body))
			p.serveInference(w, r, kind)
			return
		}
		p.log.Warn("endpoint picker failed: request refused (fail closed; --endpoint-picker-fail-open routes it with serve's own policy)",
			"picker", g.addr, "reason", pe.reason, "err", err)
		w.Header().Set("Retry-After", "1")
		st := pe.status()
		writeErrorStatus(w, st, fmt.Errorf("%w (the request was not sent: serve fails closed without its endpoint picker)", err))
		x.code = strconv.Itoa(st)
		return
	}
	if d.immediate != nil {
		g.m.calls.WithLabelValues("immediate").Inc()
		x.code = strconv.Itoa(x.writeImmediate(d.immediate, w.Header()))
		return
	}
	g.m.calls.WithLabelValues("routed").Inc()
	if x.sh != nil {
		p.shadowDecide(x.sh, d.endpoints[0])
	}
	release() // the picker's body is the one sent now
	x.forward(d)
}

// failure classifies an error of the stream at stage.
func (x *gieExchange) failure(stage string, err error) *pickerError {
	reason := gieError
	switch {
	case x.timedOut.Load():
		reason = gieTimeout
		err = fmt.Errorf("no answer within %v: %w", x.p.cfg.EndpointPickerTimeout, err)
	case errors.Is(err, errPickerProtocol):
		reason = gieProtocol
	case err == io.EOF:
		err = errors.New("the picker closed the stream without answering")
	case status.Code(err) == codes.Unavailable:
		reason = gieUnavailable
	}
	return &pickerError{reason: reason, err: fmt.Errorf("proxy: endpoint picker %s: %s: %w", x.g.addr, stage, err)}
}

// pick sends the request's headers and body to the picker and reads its
// decision, all within EndpointPickerTimeout.
func (x *gieExchange) pick(body []byte) (*gieDecision, error) {
	p := x.p
	timer := time.AfterFunc(p.cfg.EndpointPickerTimeout, func() { x.timedOut.Store(true); x.cancel() })
	defer timer.Stop()
	st, err := x.g.cli.Process(x.ctx)
	if err != nil {
		return nil, x.failure("open stream", err)
	}
	x.st = st
	hdr := x.r.Header.Clone()
	removeHop(hdr)
	// A client never names its own endpoint: the picker does.
	hdr.Del(gieDestination)
	hdr.Del(gieServed)
	hdr.Del("Accept-Encoding") // identity bodies: the picker reads the usage
	if hdr.Get("X-Request-Id") == "" {
		// Envoy gives every request one; GIE's picker logs by it.
		hdr.Set("X-Request-Id", fmt.Sprintf("%016x%016x", rand.Uint64(), rand.Uint64()))
	}
	if x.sh != nil {
		x.sh.rid = hdr.Get("X-Request-Id")
	}
	x.subset = p.pickerSubset()
	sent := make(chan error, 1)
	go func() { sent <- x.sendRequest(hdr, body) }()
	d, err := x.decision(hdr, body)
	if err != nil {
		x.cancel() // unblocks the sender
	}
	serr := <-sent
	if err != nil {
		return nil, err
	}
	if serr != nil && d.immediate == nil {
		return nil, x.failure("send request", serr)
	}
	return d, nil
}

// pickerSubset is the subset hint: the pool's replicas in routing (all of
// them when none is).
func (p *Proxy) pickerSubset() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var up, all []string
	for _, m := range p.pool.Members() {
		all = append(all, m.Address)
		if m.Up() {
			up = append(up, m.Address)
		}
	}
	if len(up) > 0 {
		return up
	}
	return all
}

// envoyHeaders is h as Envoy's ext_proc filter sends it: lower-case keys,
// values in raw_value, pseudo-headers first.
func envoyHeaders(pseudo [][2]string, h http.Header) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(pseudo)+len(h))}
	for _, kv := range pseudo {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])})
	}
	for k, vs := range h {
		lk := strings.ToLower(k)
		for _, v := range vs {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: lk, RawValue: []byte(v)})
		}
	}
	return hm
}

// sendRequest sends the request headers (end_of_stream when there is no
// body), with the subset hint and the protocol configuration, then the
// body in chunks, end_of_stream on the last.
func (x *gieExchange) sendRequest(hdr http.Header, body []byte) error {
	r := x.r
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	pseudo := [][2]string{{":method", r.Method}, {":path", r.URL.RequestURI()}, {":authority", r.Host}, {":scheme", scheme}}
	err := x.st.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: envoyHeaders(pseudo, hdr), EndOfStream: len(body) == 0}},
		MetadataContext: subsetMetadata(x.subset),
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	})
	for len(body) > 0 && err == nil {
		n := min(len(body), gieChunkBytes)
		err = x.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[:n], EndOfStream: n == len(body)}}})
		body = body[n:]
	}
	return err
}

// decision reads the picker's answers to the request: the headers
// response (header mutations, the destination in dynamic metadata), then
// the streamed body, to its end_of_stream; or an immediate response.
func (x *gieExchange) decision(hdr http.Header, body []byte) (*gieDecision, error) {
	limit := int(x.p.cfg.MaxBodyBytes)
	d := &gieDecision{header: hdr}
	var md *structpb.Struct
	gotHeaders, done := false, false
	var out []byte
	for !done {
		resp, err := x.st.Recv()
		if err != nil {
			return nil, x.failure("routing", err)
		}
		if m := resp.GetDynamicMetadata(); m != nil {
			md = m
		}
		var cr *extprocv3.CommonResponse
		switch v := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return &gieDecision{immediate: v.ImmediateResponse}, nil
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if gotHeaders {
				return nil, x.failure("routing", fmt.Errorf("%w: a second request headers response", errPickerProtocol))
			}
			gotHeaders = true
			cr = v.RequestHeaders.GetResponse()
			if len(body) == 0 {
				done = true
			}
		case *extprocv3.ProcessingResponse_RequestBody:
			if !gotHeaders {
				return nil, x.failure("routing", fmt.Errorf("%w: a request body response before the headers response", errPickerProtocol))
			}
			cr = v.RequestBody.GetResponse()
		case *extprocv3.ProcessingResponse_RequestTrailers:
			continue
		default:
			return nil, x.failure("routing", fmt.Errorf("%w: a %T before the request was routed", errPickerProtocol, v))
		}
		if err := applyHeaderMutation(d.header, cr.GetHeaderMutation()); err != nil {
			return nil, x.failure("routing", err)
		}
		switch m := cr.GetBodyMutation().GetMutation().(type) {
		case *extprocv3.BodyMutation_StreamedResponse:
			if len(out)+len(m.StreamedResponse.GetBody()) > limit {
				return nil, x.failure("routing", fmt.Errorf("%w: a request body over %d bytes", errPickerProtocol, limit))
			}
			out = append(out, m.StreamedResponse.GetBody()...)
			if m.StreamedResponse.GetEndOfStream() {
				d.body, done = out, true
			}
		case *extprocv3.BodyMutation_Body: // a buffered-mode answer: the whole body
			if len(m.Body) > limit {
				return nil, x.failure("routing", fmt.Errorf("%w: a request body over %d bytes", errPickerProtocol, limit))
			}
			d.body, done = m.Body, true
		case *extprocv3.BodyMutation_ClearBody:
			d.body, done = nil, true
		case nil:
			if _, ok := resp.GetResponse().(*extprocv3.ProcessingResponse_RequestBody); ok {
				d.body, done = body, true // no mutation: the body as sent
			} else if done {
				d.body = body
			}
		}
	}
	eps, conflict, err := destination(d.header, md)
	if err != nil {
		return nil, x.failure("routing", err)
	}
	if conflict {
		x.p.log.Warn("endpoint picker: the x-gateway-destination-endpoint header and envoy.lb metadata differ; the metadata's endpoints are used",
			"picker", x.g.addr, "header", clip(strings.Join(d.header.Values(gieDestination), ","), 200), "metadata", strings.Join(eps, ","))
	}
	kept, outside := inSubset(eps, x.subset)
	if len(outside) > 0 {
		x.p.log.Warn("endpoint picker named endpoints outside the subset: skipped", "picker", x.g.addr, "outside", strings.Join(outside, ","))
	}
	if len(kept) == 0 {
		return nil, &pickerError{reason: gieSubset, err: fmt.Errorf("proxy: endpoint picker %s: it named %s, none of serve's replicas (%s)",
			x.g.addr, strings.Join(eps, ","), strings.Join(x.subset, ","))}
	}
	d.endpoints = kept
	return d, nil
}

// writeImmediate answers the client with the picker's own response and
// returns its status.
func (x *gieExchange) writeImmediate(ir *extprocv3.ImmediateResponse, h http.Header) int {
	code := int(ir.GetStatus().GetCode())
	if code < 200 || code > 599 {
		code = http.StatusInternalServerError
	}
	if err := applyHeaderMutation(h, ir.GetHeaders()); err != nil {
		x.p.log.Warn("endpoint picker: immediate response headers ignored", "picker", x.g.addr, "err", err)
		for k := range h {
			delete(h, k)
		}
	}
	body := ir.GetBody()
	h.Set("Content-Length", strconv.Itoa(len(body)))
	x.w.WriteHeader(code)
	_, _ = x.w.Write(body)
	return code
}

// forward sends the request to the first of the picker's endpoints that
// accepts a connection, then streams the response back through the
// picker.
func (x *gieExchange) forward(d *gieDecision) {
	p := x.p
	var lastErr error
	for i, ep := range d.endpoints {
		uctx, ucancel := context.WithCancel(x.r.Context())
		out, name := x.outRequest(uctx, ep, d)
		resp, err := p.fwd.RoundTrip(out)
		if err == nil {
			x.replica = name
			if x.sh != nil {
				p.shadowServed(x.sh, ep)
			}
			x.respond(resp, ep, ucancel)
			ucancel()
			return
		}
		ucancel()
		lastErr = err
		if x.r.Context().Err() != nil {
			x.code = "cancelled"
			return
		}
		var op *net.OpError
		if !errors.As(err, &op) || op.Op != "dial" {
			break // the request may have reached it: not retried
		}
		if i+1 < len(d.endpoints) {
			x.g.m.fallbacks.WithLabelValues("endpoint").Inc()
			p.log.Warn("endpoint picker's endpoint unreachable: trying its next", "endpoint", ep, "next", d.endpoints[i+1], "err", err)
		}
	}
	st := http.StatusServiceUnavailable
	writeErrorStatus(x.w, st, fmt.Errorf("proxy: no endpoint the picker named (%s) answered: %w", strings.Join(d.endpoints, ","), lastErr))
	x.code = strconv.Itoa(st)
}

// outRequest builds the request to endpoint ep: a pool member's scheme,
// host and base path, else http://ep.
func (x *gieExchange) outRequest(ctx context.Context, ep string, d *gieDecision) (*http.Request, string) {
	p := x.p
	scheme, host, base, name := "http", ep, "", ep
	p.mu.Lock()
	if m := p.pool.ByAddress(ep); m != nil {
		b := m.Front.(*backend)
		scheme, host, base, name = b.Base.Scheme, b.host, b.basePath, b.Name
	}
	p.mu.Unlock()
	u := &url.URL{Scheme: scheme, Host: host, Path: base + x.r.URL.Path, RawQuery: x.r.URL.RawQuery}
	out := (&http.Request{Method: x.r.Method, Header: d.header.Clone(), Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1}).WithContext(ctx)
	out.URL, out.Host = u, host
	body := d.body
	if len(body) > 0 {
		out.Body, out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	out.Header.Del("Content-Length")
	if h, _, err := net.SplitHostPort(x.r.RemoteAddr); err == nil {
		if prior := x.r.Header.Values("X-Forwarded-For"); len(prior) > 0 {
			h = strings.Join(prior, ", ") + ", " + h
		}
		out.Header.Set("X-Forwarded-For", h)
	}
	return out, name
}

// respond streams the replica's response back through the picker (its
// headers with the endpoint that served, its body in chunks, then
// end_of_stream, as Envoy does in FULL_DUPLEX_STREAMED mode) and writes
// what the picker answers to the client. A picker that fails here fails
// closed by aborting the response, or, with EndpointPickerFailOpen, is
// skipped: the rest of the response goes to the client as the replica
// sends it (Envoy's failure_mode_allow).
func (x *gieExchange) respond(resp *http.Response, ep string, ucancel context.CancelFunc) {
	p := x.p
	defer resp.Body.Close()
	timeout := p.cfg.EndpointPickerTimeout
	watch := time.AfterFunc(timeout, func() { x.timedOut.Store(true); x.cancel() })
	defer watch.Stop()
	var body io.Reader = resp.Body
	if d := p.cfg.IdleTimeout; d > 0 {
		ir := &idleReader{r: resp.Body, t: time.AfterFunc(d, ucancel), d: d}
		defer ir.t.Stop()
		body = ir
	}
	if x.sh != nil {
		x.sh.watch.SSE = isEventStream(resp.Header)
		body = &shadowTee{r: body, p: p, f: x.sh}
	}
	noBody := resp.ContentLength == 0 || x.r.Method == http.MethodHead ||
		resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified
	h := filterHeader(resp.Header)
	err := x.st.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: envoyHeaders([][2]string{{":status", strconv.Itoa(resp.StatusCode)}}, h), EndOfStream: noBody}},
		MetadataContext: servedMetadata(ep),
	})
	if err == nil {
		err = x.responseHeaders(h)
	}
	if ir, ok := err.(immediateErr); ok {
		x.code = strconv.Itoa(x.writeImmediate(ir.ir, x.w.Header()))
		return
	}
	watch.Stop()
	if err != nil {
		pe := x.failure("response headers", err)
		x.g.m.failures.WithLabelValues(gieResponse).Inc()
		if !p.cfg.EndpointPickerFailOpen {
			p.log.Warn("endpoint picker failed on the response path: response refused (fail closed)", "picker", x.g.addr, "err", pe)
			writeErrorStatus(x.w, http.StatusBadGateway, pe)
			x.code = strconv.Itoa(http.StatusBadGateway)
			return
		}
		p.log.Warn("endpoint picker failed on the response path: passing the response through (fail open)", "picker", x.g.addr, "err", pe)
		x.cancel()
		h = filterHeader(resp.Header)
		x.writeHead(h, resp.StatusCode)
		x.passThrough(nil, body)
		return
	}
	x.writeHead(h, resp.StatusCode)
	if noBody {
		_ = x.st.CloseSend()
		return
	}
	x.streamBody(body, watch)
}

// immediateErr is an immediate response on the response path.
type immediateErr struct{ ir *extprocv3.ImmediateResponse }

func (immediateErr) Error() string { return "immediate response" }

// responseHeaders reads the picker's answer to the response headers and
// applies its mutations to h.
func (x *gieExchange) responseHeaders(h http.Header) error {
	for {
		resp, err := x.st.Recv()
		if err != nil {
			return err
		}
		switch v := resp.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ResponseHeaders:
			return applyHeaderMutation(h, v.ResponseHeaders.GetResponse().GetHeaderMutation())
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return immediateErr{v.ImmediateResponse}
		case *extprocv3.ProcessingResponse_RequestBody, *extprocv3.ProcessingResponse_RequestTrailers:
			continue // late answers of the request path
		default:
			return fmt.Errorf("%w: a %T before the response headers response", errPickerProtocol, v)
		}
	}
}

// writeHead sends the response status and headers to the client. The
// picker may change the body's length: it goes chunked.
func (x *gieExchange) writeHead(h http.Header, code int) {
	dst := x.w.Header()
	for k, vs := range h {
		dst[k] = vs
	}
	dst.Del("Content-Length")
	if x.replica != "" {
		dst.Set(HeaderReplica, x.replica)
	}
	x.w.WriteHeader(code)
	_ = http.NewResponseController(x.w).Flush()
	x.code = strconv.Itoa(code)
}

// unacked holds the response bytes sent to the picker and not yet
// answered, for a fail-open picker failure mid-body (guarded by mu).
type unacked struct {
	mu   sync.Mutex
	buf  []byte
	max  int
	lost bool // over max, or the picker answered more than it was sent
}

func (u *unacked) add(b []byte) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.lost || len(u.buf)+len(b) > u.max {
		u.lost, u.buf = true, nil
		return
	}
	u.buf = append(u.buf, b...)
}

func (u *unacked) ack(n int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.lost || n > len(u.buf) {
		u.lost, u.buf = true, nil
		return
	}
	u.buf = u.buf[n:]
}

// streamBody sends the body to the picker as it arrives while writing the
// picker's streamed answers to the client, each flushed.
func (x *gieExchange) streamBody(body io.Reader, watch *time.Timer) {
	p := x.p
	rc := http.NewResponseController(x.w)
	var pending *unacked
	if p.cfg.EndpointPickerFailOpen {
		pending = &unacked{max: int(p.cfg.MaxResponseBytes)}
	}
	var readErr error // the replica's body failed (set before sent is closed)
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		buf := make([]byte, 32<<10)
		for {
			n, err := body.Read(buf)
			if n > 0 {
				chunk := bytes.Clone(buf[:n])
				if pending != nil {
					pending.add(chunk)
				}
				if x.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
					ResponseBody: &extprocv3.HttpBody{Body: chunk}}}) != nil {
					return
				}
			}
			if err == io.EOF {
				watch.Reset(p.cfg.EndpointPickerTimeout)
				if x.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
					ResponseBody: &extprocv3.HttpBody{EndOfStream: true}}}) == nil {
					_ = x.st.CloseSend()
				}
				return
			}
			if err != nil {
				readErr = err
				x.cancel()
				return
			}
		}
	}()
	for {
		resp, err := x.st.Recv()
		if err == nil {
			switch v := resp.GetResponse().(type) {
			case *extprocv3.ProcessingResponse_ResponseBody:
				sr := v.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse()
				if sr == nil {
					err = fmt.Errorf("%w: a response body answer without a streamed_response", errPickerProtocol)
					break
				}
				b := sr.GetBody()
				if pending != nil {
					pending.ack(len(b))
				}
				if len(b) > 0 {
					if _, werr := x.w.Write(b); werr != nil {
						x.cancel()
						<-sent
						x.code = "cancelled"
						return
					}
					_ = rc.Flush()
				}
				if sr.GetEndOfStream() {
					watch.Stop()
					x.cancel() // a picker that ended early: stop sending
					<-sent
					if readErr != nil {
						x.abort, x.code = true, "aborted"
					}
					return
				}
				continue
			case *extprocv3.ProcessingResponse_ResponseTrailers:
				continue
			default:
				err = fmt.Errorf("%w: a %T on the response body path", errPickerProtocol, v)
			}
		}
		// The stream failed: the replica's body, the client, or the picker.
		x.cancel()
		<-sent
		if readErr != nil || x.r.Context().Err() != nil {
			x.abort, x.code = true, "aborted"
			return
		}
		pe := x.failure("response body", err)
		x.g.m.failures.WithLabelValues(gieResponse).Inc()
		if pending == nil || pending.lost {
			p.log.Warn("endpoint picker failed mid-response: response cut (fail closed, or not recoverable)", "picker", x.g.addr, "err", pe)
			x.abort, x.code = true, "aborted"
			return
		}
		p.log.Warn("endpoint picker failed mid-response: passing the rest through (fail open)", "picker", x.g.addr, "err", pe)
		x.passThrough(pending.buf, body)
		return
	}
}

// passThrough writes head, then the rest of body, to the client, flushing
// each read (fail open: the picker is gone).
func (x *gieExchange) passThrough(head []byte, body io.Reader) {
	rc := http.NewResponseController(x.w)
	if len(head) > 0 {
		if _, err := x.w.Write(head); err != nil {
			return
		}
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := x.w.Write(buf[:n]); werr != nil {
				return
			}
			_ = rc.Flush()
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			x.abort, x.code = true, "aborted"
			return
		}
	}
}
