package epp

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// The Endpoint Picker protocol's names (gateway-api-inference-extension,
// docs/proposals/004-endpoint-picker-protocol).
const (
	// DestinationHeader carries the picked endpoints, "ip:port[,ip:port...]",
	// primary first; DestinationNamespace is the dynamic-metadata namespace
	// that carries the same value under the same key.
	DestinationHeader    = "x-gateway-destination-endpoint"
	DestinationNamespace = "envoy.lb"
	// ServedKey is the key, in the envoy.lb namespace of the response
	// path's metadata_context, of the endpoint that actually served.
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace / SubsetKey hold the gateway's subset hint: a list of
	// "ip:port" the picker must choose from.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// SessionHeader is a session key for affinity.
	SessionHeader = "x-session-id"
	// RouteHeader explains the decision (as prefixlb serve's x-prefixlb-route).
	RouteHeader = "x-prefixlb-route"
	// RouteTermsHeader gives every term of each candidate's cost, by name
	// (policy.Decision.ExplainTerms; e2 only), beside RouteHeader.
	RouteTermsHeader = "x-prefixlb-route-terms"
	// PrefillerHeader names a disaggregated request's prefill endpoint,
	// "ip:port", for llm-d's routing sidecar on the decode pod, which runs
	// the prefill leg there first (llm-d/llm-d-inference-scheduler
	// pkg/plugins/pre-request/pd_prerequest.go, PrefillHeaderHandler, at
	// 0fe970f8: net.JoinHostPort of the prefill profile's target). A request
	// that is not disaggregated has the header removed, as that plugin
	// clears it: a client cannot steer the prefill.
	PrefillerHeader = "x-prefiller-host-port"
)

// bodyChunkBytes bounds each streamed body chunk sent back to Envoy: some
// Envoy builds cap a chunk at 64 KiB (the GIE picker uses the same margin).
const bodyChunkBytes = 62000

// defaultMaxBodyBytes is ServerConfig.MaxBodyBytes's default.
const defaultMaxBodyBytes = 16 << 20

// ServerConfig configures a Server.
type ServerConfig struct {
	// MaxBodyBytes bounds a request body (default 16 MiB): larger ones get
	// 413.
	MaxBodyBytes int
	// MaxResponseBytes bounds how much of a non-streamed response body is
	// kept to read its usage (default 1 MiB); the body is passed through
	// whole either way.
	MaxResponseBytes int
	// Explain says which requests get the x-prefixlb-route and
	// x-prefixlb-route-terms headers (the decision explained: matched
	// tokens per replica, a cache oracle) on their way to the replica:
	// tenancy.ExplainNever, ExplainTrusted (the default, ""; requests
	// presenting AdminToken in x-prefixlb-admin-token or Authorization:
	// Bearer, nobody without one) or ExplainAlways. The headers go upstream, to the replica, not to the
	// client; a gateway that copies request headers into responses would
	// pass them on, and so is trusted with them.
	Explain tenancy.Explain
	// AdminToken is the token ExplainTrusted asks for ("": nobody is
	// trusted). x-prefixlb-admin-token is removed from every request.
	AdminToken string
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
	// Limits bound the streams, the buffered bodies and the idle streams
	// (zero fields: DefaultLimits'). The gRPC server that serves the
	// Server should be made with Limits.ServerOptions.
	Limits Limits
}

// Server is the ext_proc ExternalProcessor service in front of a Picker,
// for Envoy's FULL_DUPLEX_STREAMED body mode on both paths. One stream is
// one HTTP request.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	p      *Picker
	cfg    ServerConfig
	token  tenancy.Token // cfg.AdminToken
	log    *slog.Logger
	health *health.Server
	slots  streamSlots
	budget *byteBudget
	lm     *limitMetrics
}

// NewServer returns the ext_proc service for p.
func NewServer(p *Picker, cfg ServerConfig) *Server {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = defaultMaxBodyBytes
	}
	if cfg.MaxResponseBytes <= 0 {
		cfg.MaxResponseBytes = 1 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Explain == "" {
		cfg.Explain = tenancy.ExplainTrusted
	}
	cfg.Limits = cfg.Limits.withDefaults()
	lm := newLimitMetrics(p.Registry())
	return &Server{p: p, cfg: cfg, log: cfg.Logger, health: health.NewServer(), token: tenancy.NewToken(cfg.AdminToken),
		slots: streamSlots{max: int64(cfg.Limits.MaxStreams)}, budget: newByteBudget(cfg.Limits.MaxBufferedBytes, lm.buffered), lm: lm}
}

// Register registers the ext_proc service on g.
func (s *Server) Register(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, s) }

// Health is the gRPC health service: SERVING for "" and the ext_proc
// service once SetServing(true).
func (s *Server) Health() *health.Server { return s.health }

// SetServing sets the health status of "" and of the ext_proc service.
func (s *Server) SetServing(ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.health.SetServingStatus("", st)
	s.health.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, st)
}

// exchange is one stream's state.
type exchange struct {
	s        *Server
	srv      extprocv3.ExternalProcessor_ProcessServer
	kind     openai.Kind
	session  string
	hdr      map[string]string // the headers the router-side queue reads
	subset   []string
	body     []byte
	held     int64 // of s.budget, for body (its capacity)
	picked   bool
	pick     Pick
	status   int // upstream response status (0 unknown)
	watch    openai.Watcher
	finished bool
}

// Process implements extprocv3.ExternalProcessorServer. Until the
// request is routed, each message must come within StreamIdleTimeout of
// the last; the stream holds one of MaxStreams slots throughout.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	m := s.p.m
	x := &exchange{s: s, srv: srv}
	if !s.slots.acquire() {
		s.lm.limited.WithLabelValues(limitStreams).Inc()
		s.log.Debug("epp: stream refused", "limit", limitStreams, "max_streams", s.cfg.Limits.MaxStreams)
		// Answered at once, before reading: Envoy sends the request
		// headers as it opens the stream, and takes an immediate
		// response at any point.
		return x.immediate(typev3.StatusCode_TooManyRequests, fmt.Sprintf("the endpoint picker has %d requests open, its limit", s.cfg.Limits.MaxStreams))
	}
	defer s.slots.release()
	m.streams.Inc()
	m.streamsN.Inc()
	defer m.streams.Dec()
	x.watch.Max = s.cfg.MaxResponseBytes
	defer x.finish(false)
	defer x.release()

	// One goroutine receives, so that the wait for a message can be
	// bounded; it ends when the stream does (Recv fails once Process has
	// returned) or when Process no longer takes its messages.
	type received struct {
		req *extprocv3.ProcessingRequest
		err error
	}
	msgs := make(chan received)
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			req, err := srv.Recv()
			select {
			case msgs <- received{req, err}:
			case <-done:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	idle := time.NewTimer(s.cfg.Limits.StreamIdleTimeout)
	defer idle.Stop()
	for {
		var timeout <-chan time.Time
		if !x.picked { // the request is still arriving
			idle.Reset(s.cfg.Limits.StreamIdleTimeout)
			timeout = idle.C
		}
		var r received
		select {
		case r = <-msgs:
		case <-timeout:
			s.lm.limited.WithLabelValues(limitIdle).Inc()
			s.log.Debug("epp: idle stream ended", "limit", limitIdle, "timeout", s.cfg.Limits.StreamIdleTimeout, "buffered", len(x.body))
			return status.Errorf(codes.DeadlineExceeded, "epp: no message for %v before the request was whole", s.cfg.Limits.StreamIdleTimeout)
		}
		req, err := r.req, r.err
		if err == io.EOF || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			m.errors.WithLabelValues(errReceive).Inc()
			return status.Errorf(codes.Unknown, "epp: receive: %v", err)
		}
		done, err := x.handle(req)
		if err != nil || done {
			return err
		}
	}
}

// handle processes one message; done ends the stream (an immediate
// response was sent).
func (x *exchange) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	switch v := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		x.readRequestHeaders(v.RequestHeaders, req.GetMetadataContext())
		if v.RequestHeaders.GetEndOfStream() { // no body: decide now
			return x.decide(false, true)
		}
		return false, nil
	case *extprocv3.ProcessingRequest_RequestBody:
		if x.picked { // a body after the decision (should not happen): pass it on
			return false, x.sendBody(v.RequestBody.GetBody(), v.RequestBody.GetEndOfStream())
		}
		if code, msg := x.buffer(v.RequestBody.GetBody(), v.RequestBody.GetEndOfStream()); code != 0 {
			return true, x.immediate(code, msg)
		}
		if v.RequestBody.GetEndOfStream() {
			return x.decide(true, true)
		}
		return false, nil
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if !x.picked { // the body ended with trailers, not end_of_stream
			if done, err := x.decide(len(x.body) > 0, false); done || err != nil {
				return done, err
			}
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		x.readResponseHeaders(v.ResponseHeaders, req.GetMetadataContext())
		if v.ResponseHeaders.GetEndOfStream() {
			x.finish(true)
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{Response: x.rateHeaders()}}})
	case *extprocv3.ProcessingRequest_ResponseBody:
		b := v.ResponseBody.GetBody()
		if x.watch.Feed(b) && x.picked {
			x.s.p.FirstToken(x.pick.ID)
		}
		if v.ResponseBody.GetEndOfStream() {
			x.finish(true) // before the answer: Envoy may end the stream on it
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: v.ResponseBody.GetEndOfStream()}}}}}}})
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		x.finish(true)
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return false, nil
}

// readRequestHeaders takes the path, the session and the subset hint.
func (x *exchange) readRequestHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) {
	for _, hv := range h.GetHeaders().GetHeaders() {
		val := headerValue(hv)
		switch strings.ToLower(hv.GetKey()) {
		case ":path":
			x.kind = kindOf(val)
		case SessionHeader:
			x.session = val
		case cluster.PriorityHeader, cluster.TenantHeader, cluster.SLOHeader, "authorization", "x-api-key", ObjectiveHeader, tenancy.TokenHeader:
			if x.hdr == nil {
				x.hdr = map[string]string{}
			}
			x.hdr[strings.ToLower(hv.GetKey())] = val
		}
	}
	if ns := md.GetFilterMetadata()[SubsetNamespace]; ns != nil {
		if v, ok := ns.GetFields()[SubsetKey]; ok {
			x.subset = []string{}
			switch k := v.GetKind().(type) {
			case *structpb.Value_ListValue:
				for _, e := range k.ListValue.GetValues() {
					if s := e.GetStringValue(); s != "" {
						x.subset = append(x.subset, s)
					}
				}
			case *structpb.Value_StringValue: // tolerate "a:1,b:2"
				for _, s := range strings.Split(k.StringValue, ",") {
					if s = strings.TrimSpace(s); s != "" {
						x.subset = append(x.subset, s)
					}
				}
			}
		}
	}
}

// kindOf maps an OpenAI path to its kind.
func kindOf(path string) openai.Kind {
	path, _, _ = strings.Cut(path, "?")
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return openai.KindChat
	case strings.HasSuffix(path, "/completions"):
		return openai.KindCompletion
	}
	return openai.KindOther
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// decide picks and answers: the request headers response carrying the
// destination (header and metadata), then the body (if haveBody) streamed
// back unchanged, eos on its last chunk.
func (x *exchange) decide(haveBody, eos bool) (done bool, err error) {
	get := func(k string) string { return x.hdr[strings.ToLower(k)] }
	explain := x.s.cfg.Explain.For(x.s.token.Presented(get))
	pick, err := x.s.p.Pick(x.srv.Context(), Input{Kind: x.kind, Body: x.body, Session: x.session, Subset: x.subset,
		Explain: explain, Header: get})
	if err != nil {
		if ok, err := x.tenantImmediate(err); ok { // 401, or 429 over the tenant's quota
			return true, err
		}
		code := typev3.StatusCode_InternalServerError
		switch {
		case errors.Is(err, openai.ErrBadRequest), errors.Is(err, cluster.ErrPromptTooLong):
			code = typev3.StatusCode_BadRequest
		case errors.Is(err, ErrNoEndpoint), errors.Is(err, ErrPoolDown):
			code = typev3.StatusCode_ServiceUnavailable
		case errors.Is(err, ErrShed):
			code = typev3.StatusCode_TooManyRequests
		}
		if code == typev3.StatusCode_InternalServerError {
			x.s.p.m.errors.WithLabelValues(errRoute).Inc()
			x.s.log.Warn("epp: no pick", "err", err, "status", int(code))
		} else {
			x.s.log.Debug("epp: no pick", "err", err, "status", int(code))
		}
		return true, x.immediate(code, err.Error())
	}
	x.picked, x.pick = true, pick
	dest := strings.Join(pick.Endpoints, ",")
	set := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: DestinationHeader, RawValue: []byte(dest)}}}
	remove := []string{tenancy.TokenHeader} // the admin token never reaches a replica
	if pick.Prefill != "" {
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: PrefillerHeader, RawValue: []byte(pick.Prefill)}})
	} else {
		remove = append(remove, PrefillerHeader)
	}
	if pick.Body != nil {
		// The model was rewritten (InferenceModelRewrite): the body the
		// replica gets has another length.
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: "content-length", RawValue: []byte(strconv.Itoa(len(pick.Body)))}})
	}
	if explain {
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: RouteHeader, RawValue: []byte(pick.Decision.Explain())}})
		if terms := pick.Decision.ExplainTerms(); terms != "" {
			set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: RouteTermsHeader, RawValue: []byte(terms)}})
		}
	}
	md, _ := structpb.NewStruct(map[string]any{DestinationNamespace: map[string]any{DestinationHeader: dest}})
	if err := x.send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{
				ClearRouteCache: true,
				HeaderMutation:  &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: remove},
			}}},
		DynamicMetadata: md,
	}); err != nil {
		return false, err
	}
	if haveBody {
		body := x.body
		if pick.Body != nil {
			body = pick.Body
		}
		err = x.sendBody(body, eos)
	}
	x.release()
	return false, err
}

// buffer appends b, whose message ends the body when eos, to the request
// body, growing its buffer (by doubling, up to MaxBodyBytes) only with
// room in the picker's budget (eos: its reserve too). It returns
// the status to answer with when the body is over MaxBodyBytes (413) or
// the budget has no room (429: another try may find some).
func (x *exchange) buffer(b []byte, eos bool) (typev3.StatusCode, string) {
	s := x.s
	need := len(x.body) + len(b)
	if need > s.cfg.MaxBodyBytes {
		s.lm.limited.WithLabelValues(limitBody).Inc()
		return typev3.StatusCode_PayloadTooLarge, fmt.Sprintf("request body too large: over %d bytes", s.cfg.MaxBodyBytes)
	}
	if need > cap(x.body) {
		size := max(need, min(2*cap(x.body), s.cfg.MaxBodyBytes))
		if eos { // the body is whole: no more to come
			size = need
		}
		if !s.budget.take(int64(size-cap(x.body)), int64(size), eos) {
			size = need // no room to double: exactly what it needs
			if !s.budget.take(int64(size-cap(x.body)), int64(size), eos) {
				s.lm.limited.WithLabelValues(limitBuffered).Inc()
				s.log.Debug("epp: body refused", "limit", limitBuffered, "body", need, "max_buffered_bytes", s.cfg.Limits.MaxBufferedBytes)
				return typev3.StatusCode_TooManyRequests, fmt.Sprintf("the endpoint picker holds %d bytes of request bodies, its limit: retry shortly", s.cfg.Limits.MaxBufferedBytes)
			}
		}
		x.held += int64(size - cap(x.body))
		grown := make([]byte, len(x.body), size)
		copy(grown, x.body)
		x.body = grown
	}
	x.body = append(x.body, b...)
	return 0, ""
}

// release drops the request body and gives its bytes back to the budget.
func (x *exchange) release() {
	x.body = nil
	x.s.budget.give(x.held)
	x.held = 0
}

// sendBody streams b back to Envoy unchanged, in chunks of bodyChunkBytes.
func (x *exchange) sendBody(b []byte, eos bool) error {
	for first := true; first || len(b) > 0; first = false {
		n := min(len(b), bodyChunkBytes)
		chunk := b[:n]
		b = b[n:]
		err := x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos && len(b) == 0}}}}}}})
		if err != nil {
			return err
		}
	}
	return nil
}

// readResponseHeaders takes the status, the content type and the served
// endpoint (metadata, else a header of the same name).
func (x *exchange) readResponseHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) {
	served := ""
	if ns := md.GetFilterMetadata()[DestinationNamespace]; ns != nil {
		served = ns.GetFields()[ServedKey].GetStringValue()
	}
	for _, hv := range h.GetHeaders().GetHeaders() {
		val := headerValue(hv)
		switch strings.ToLower(hv.GetKey()) {
		case ":status":
			x.status = atoi(val)
		case "content-type":
			x.watch.SSE = strings.Contains(val, "text/event-stream")
		case ServedKey:
			if served == "" {
				served = val
			}
		}
	}
	if x.picked && served != "" {
		x.s.p.Served(x.pick.ID, strings.TrimSpace(served))
	}
}

func atoi(s string) int {
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// finish reports the request's end once. complete is false when the stream
// ended without the response's end (the request failed or the gateway does
// not send the response path: counted as done if the status was 2xx).
func (x *exchange) finish(complete bool) {
	if !x.picked || x.finished {
		return
	}
	x.finished = true
	ok := x.status >= 200 && x.status < 300
	if !complete && x.status == 0 {
		ok = false
	}
	out, cached := x.watch.Result()
	fin := router.Finish{OutputTokens: out, CachedTokens: cached, PromptTokens: x.watch.PromptTokens(), OK: ok, Timings: x.watch.Timings.Calibration()}
	fin.ITL, fin.ITLSamples = x.watch.Gaps.Median()
	x.s.p.Finish(x.pick.ID, fin)
	x.settleQuota(out, ok)
}

// immediate answers the request itself with an HTTP status and a JSON
// error body in OpenAI's shape.
func (x *exchange) immediate(code typev3.StatusCode, msg string) error {
	x.s.p.m.immediate.WithLabelValues(strconv.Itoa(int(code))).Inc()
	body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "prefixlb_epp", "code": int(code)}})
	return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: code},
			Body:    body,
			Details: "prefixlb_epp: " + msg,
			Headers: &extprocv3.HeaderMutation{SetHeaders: immediateHeaders(code)},
		}}})
}

// immediateHeaders are an immediate response's headers: JSON, and
// Retry-After on 429 and 503 (the client may try again shortly).
func immediateHeaders(code typev3.StatusCode) []*corev3.HeaderValueOption {
	h := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}
	if code == typev3.StatusCode_TooManyRequests || code == typev3.StatusCode_ServiceUnavailable {
		h = append(h, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte("1")}})
	}
	return h
}

func (x *exchange) send(r *extprocv3.ProcessingResponse) error {
	if err := x.srv.Send(r); err != nil {
		x.s.p.m.errors.WithLabelValues(errSend).Inc()
		return status.Errorf(codes.Unknown, "epp: send to envoy: %v", err)
	}
	return nil
}
