package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// maxErrorBody bounds the body of a 5xx answer kept to replay to the client
// when no other replica can be tried.
const maxErrorBody = 1 << 20

// hopHeaders are hop-by-hop headers (RFC 9110 §7.6.1), never forwarded.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// exchange is one client request on its way through the proxy.
type exchange struct {
	p    *Proxy
	w    http.ResponseWriter
	r    *http.Request
	body []byte // this attempt's body: orig, or a decode leg's (pd.go)
	orig []byte // the client's body
	req  *openai.Request
	// pd, rid and prefilled are a disaggregated request's (pd.go): its
	// body's members, its X-Request-Id, the replica that ran the prefill
	// leg of this attempt (nil: none, or it failed).
	pd        *pdBodies
	rid       string
	prefilled *backend
	start     time.Time
	// wrote is set once any byte of the response went to the client: from
	// then on the request cannot be retried.
	wrote bool
	// code is the outcome label of prefixlb_requests_total; status the
	// status sent to the client (writeHead; 0: none yet).
	code   string
	status int
	// tq is the request's tenant and quota (tenants.go).
	tq tenantState
	// cw is w when ClientWriteTimeout bounds the writes to the client
	// (nil: no bound).
	cw *clientWriter
	// abort makes the handler end by aborting the response (the connection
	// closed, HTTP/2's stream reset): a response whose rest could not be
	// read must not end as if it were whole.
	abort bool
	// explain says the client gets the decision's explanation
	// (Config.Explain; explain.go).
	explain bool
}

// result is the outcome of one attempt on one replica.
type result struct {
	// err is nil when the attempt answered the client.
	err error
	// retry says the attempt failed before any byte reached the client and
	// another replica may be tried; dead says the replica refused the
	// connection (it is ejected at once).
	retry, dead bool
	// resp is a replica's 5xx answer, kept to replay if no retry succeeds.
	resp *storedResponse
}

// storedResponse is a buffered replica answer.
type storedResponse struct {
	status int
	header http.Header
	body   []byte
}

// serveInference routes and forwards one /v1 request.
func (p *Proxy) serveInference(w http.ResponseWriter, r *http.Request, kind openai.Kind) {
	x := &exchange{p: p, w: w, r: r, start: time.Now()}
	if d := p.cfg.ClientWriteTimeout; d > 0 {
		x.cw = newClientWriter(w, d)
		x.w, w = x.cw, x.cw
	}
	var last *backend // the replica of the last attempt
	var held int64    // the body's bytes reserved from p.bodies
	defer func() {
		p.bodies.release(held)
		if x.cw != nil {
			x.cw.finish()
			if x.cw.timedOut() {
				x.code = codeClientTimeout
				name := ""
				if last != nil {
					name = last.Name
				}
				p.log.Info("client stopped reading: write timed out, request ended", "replica", name,
					"client", r.RemoteAddr, "client_write_timeout", p.cfg.ClientWriteTimeout)
			}
		}
		if last != nil {
			last.m.request(x.code).Inc()
		} else {
			p.m.requests.WithLabelValues(p.policy, "", x.code).Inc()
		}
		if x.abort {
			// As httputil.ReverseProxy ends a body it could not copy whole:
			// net/http closes the connection without ending the response.
			panic(http.ErrAbortHandler)
		}
	}()
	fail := func(err error) {
		x.code = strconv.Itoa(writeError(w, err))
	}
	if !x.identify() {
		return
	}
	body, n, err := readBodyWithin(w, r, p.cfg.MaxBodyBytes, p.bodies)
	held = n
	if err != nil {
		if errors.Is(err, ErrBodyMemory) {
			p.m.refused.WithLabelValues(refusedBodyMemory).Inc()
			w.Header().Set("Retry-After", "1")
		}
		fail(err)
		return
	}
	x.body, x.orig = body, body
	req, err := openai.ParseRequest(kind, body)
	if err != nil {
		fail(err)
		return
	}
	x.req = req
	if err := x.admitClient(req); err != nil {
		fail(err)
		return
	}
	keys, tokens, err := p.pool.Key(req)
	if err != nil {
		fail(fmt.Errorf("proxy: %w", err))
		return
	}
	preq := policy.Request{Keys: keys, PromptTokens: tokens, Estimated: req.TokensEstimated, OutputTokens: req.MaxTokens,
		Session: r.Header.Get(HeaderSession), Unary: !req.Stream, Adapter: req.Adapter}
	if preq.Session == "" {
		preq.Session = req.User
	}
	if !x.reserve(tokens, req.MaxTokens) {
		return
	}
	defer x.settle()
	ctx := r.Context()
	if p.cfg.RequestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.cfg.RequestTimeout)
		defer cancel()
	}

	var tried []int
	var lastRes result
	var lastD policy.Decision
	retries := 0 // attempts after the first: another replica was chosen
	for attempt := 0; ; attempt++ {
		preq.ID = p.nextID.Add(1)
		var (
			d     policy.Decision
			b, pb *backend
			err   error
		)
		if attempt == 0 && p.gate != nil {
			d, b, pb, err = p.admitRoute(ctx, x, req.Model, preq)
		} else {
			d, b, pb, err = p.route(preq, tried)
		}
		if err != nil {
			if attempt == 0 {
				switch {
				case errors.Is(err, ErrShed):
					x.code = strconv.Itoa(writeShed(w, err, time.Second))
				case r.Context().Err() != nil:
					x.code = "cancelled"
				default:
					fail(fmt.Errorf("proxy: route: %w", err))
				}
				return
			}
			break // no replica left to try: answer the last failure
		}
		if attempt > 0 {
			// Another replica was chosen: the retry of the last failure
			// happens (and only now is it one).
			retries++
			reason := reasonOf(lastRes.err)
			p.m.retries.WithLabelValues(last.Name, reason).Inc()
			p.log.Warn("retrying on another replica", "replica", last.Name, "next", b.Name, "reason", reason, "err", lastRes.err)
		}
		last = b
		b.m.decision(d.Branch).Inc()
		x.body, x.prefilled = x.orig, nil
		if pb != nil {
			x.requestID()
			var prefilled bool
			if x.body, prefilled = x.prefillLeg(ctx, preq.ID, &d, pb); prefilled {
				x.prefilled = pb
			}
		} else if p.pdOn {
			p.m.pd.WithLabelValues(pdLocal).Inc()
		}
		res := x.attempt(ctx, preq.ID, &d, b, retries)
		p.observe(b, x.verdict(ctx, res))
		if res.err == nil {
			return
		}
		lastRes, lastD = res, d
		if !res.retry || x.wrote || ctx.Err() != nil || attempt >= p.cfg.MaxRetries {
			break
		}
		if res.dead {
			p.checked(b, false, true)
		}
		tried = append(tried, d.Replica)
	}
	if x.wrote {
		return // the attempt ended the stream itself
	}
	if r.Context().Err() != nil {
		x.code = "cancelled"
		return
	}
	x.setRouteHeaders(&lastD, last, retries)
	if lastRes.resp != nil {
		x.code = strconv.Itoa(lastRes.resp.status)
		copyHeader(w.Header(), lastRes.resp.header)
		w.Header().Set("Content-Length", strconv.Itoa(len(lastRes.resp.body)))
		w.WriteHeader(lastRes.resp.status)
		_, _ = w.Write(lastRes.resp.body)
		return
	}
	err = lastRes.err
	if ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("proxy: request timeout after %v: %w", p.cfg.RequestTimeout, context.DeadlineExceeded)
	}
	fail(err)
}

// reasonOf is the metric label of an attempt's failure.
func reasonOf(err error) string {
	var ae *attemptError
	if errors.As(err, &ae) {
		return ae.reason
	}
	return reasonConn
}

// Sizes of readBody's buffer.
const (
	// trustedBodyBytes is how much of a declared Content-Length the buffer
	// is sized for before the bytes arrive: a body of up to 64 KiB (a
	// 16k-token prompt) is read into one buffer of its size, with no copy
	// (io.ReadAll would grow and copy a 25 KB body eight times), while a
	// client that declares 16 MiB and sends nothing holds 64 KiB, not
	// 16 MiB (issue 26, D2). Beyond it the buffer doubles as bytes come.
	trustedBodyBytes = 64 << 10
	// unknownBodyBytes is the first buffer of a body of unknown length
	// (chunked).
	unknownBodyBytes = 4 << 10
)

// readBody reads the request body, bounded by limit, into a buffer that
// grows with the bytes that arrive (readBodyWithin), counted against no
// budget.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, error) {
	body, _, err := readBodyWithin(w, r, limit, nil)
	return body, err
}

// readBodyWithin reads the request body, bounded by limit, into a buffer that
// grows with the bytes that arrive: sized at once for a declared length of
// up to trustedBodyBytes, then doubled (to the declared length at most)
// each time it fills. The buffer's size is reserved from budget before it
// is allocated (nil: no bound); readBodyWithin returns the bytes reserved,
// which the caller releases once it drops the body (none on error).
func readBodyWithin(w http.ResponseWriter, r *http.Request, limit int64, budget *byteBudget) (body []byte, held int64, err error) {
	if r.ContentLength > limit {
		return nil, 0, fmt.Errorf("proxy: read body: %w: %d bytes over the limit of %d", ErrBodyTooLarge, r.ContentLength, limit)
	}
	// The buffer has bytes.MinRead to spare past a declared length, so the
	// read that finds the end needs no growth (as bytes.Buffer.ReadFrom).
	size := int64(unknownBodyBytes)
	if r.ContentLength >= 0 {
		size = min(r.ContentLength, trustedBodyBytes) + bytes.MinRead
	}
	if err := budget.reserve(size); err != nil {
		return nil, 0, fmt.Errorf("proxy: read body: %w", err)
	}
	held = size
	buf := make([]byte, 0, size)
	src := http.MaxBytesReader(w, r.Body, limit)
	for {
		if len(buf) == cap(buf) {
			next := 2 * int64(cap(buf))
			if r.ContentLength > int64(len(buf)) {
				next = min(next, r.ContentLength+bytes.MinRead)
			}
			next = max(min(next, limit+bytes.MinRead), int64(len(buf))+bytes.MinRead)
			// Only the new buffer is counted: the old one is garbage once
			// copied.
			if err := budget.reserve(next - held); err != nil {
				budget.release(held)
				return nil, 0, fmt.Errorf("proxy: read body: %w", err)
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
			buf, held = grown, next
		}
		n, rerr := src.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if rerr == io.EOF {
			return buf, held, nil
		}
		if rerr != nil {
			budget.release(held)
			var mbe *http.MaxBytesError
			if errors.As(rerr, &mbe) {
				return nil, 0, fmt.Errorf("proxy: read body: %w: over the limit of %d bytes", ErrBodyTooLarge, limit)
			}
			if errors.Is(rerr, ErrBodyTimeout) {
				return nil, 0, fmt.Errorf("proxy: read body: %w", rerr)
			}
			return nil, 0, fmt.Errorf("proxy: read body: %w: %v", openai.ErrBadRequest, rerr)
		}
	}
}

// The explanation headers' keys in canonical form, as Header.Set would
// make them on every call.
var (
	canonReplica = http.CanonicalHeaderKey(HeaderReplica)
	canonRoute   = http.CanonicalHeaderKey(HeaderRoute)
	canonRetries = http.CanonicalHeaderKey(HeaderRetries)
)

// setRouteHeaders sets the explanation headers of decision d.
func (x *exchange) setRouteHeaders(d *policy.Decision, b *backend, retries int) {
	h := x.w.Header()
	h[canonReplica] = []string{b.Name}
	if x.explain {
		h[canonRoute] = []string{d.Explain()}
	} else {
		delete(h, canonRoute) // a cache oracle (explain.go)
	}
	if x.prefilled != nil {
		h[canonPrefillReplica] = []string{x.prefilled.Name}
	} else {
		delete(h, canonPrefillReplica)
	}
	if retries > 0 {
		h[canonRetries] = []string{strconv.Itoa(retries)}
	} else {
		delete(h, canonRetries)
	}
}

// attempt forwards the request to replica b as request id, decided by d.
// It reports the request's end to the core (exactly once) and answers the
// client unless it returns a retryable failure.
func (x *exchange) attempt(ctx context.Context, id uint64, d *policy.Decision, b *backend, n int) result {
	p := x.p
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	b.m.inflight.Inc()
	defer b.m.inflight.Dec()

	out, err := x.outRequest(ctx, b)
	if err != nil {
		p.finish(id, 0, -1, false)
		return result{err: err}
	}
	resp, err := p.fwd.RoundTrip(out)
	if err != nil {
		p.finish(id, 0, -1, false)
		return x.transportFailure(b, err)
	}
	defer resp.Body.Close()

	var idled atomic.Bool
	body := io.Reader(resp.Body)
	if p.cfg.IdleTimeout > 0 {
		t := time.AfterFunc(p.cfg.IdleTimeout, func() { idled.Store(true); cancel() })
		defer t.Stop()
		body = &idleReader{r: resp.Body, t: t, d: p.cfg.IdleTimeout}
	}
	readFailure := func(err error) *attemptError {
		if idled.Load() {
			return &attemptError{replica: b.Name, reason: reasonTimeout, err: errIdle}
		}
		// A stream cut short (the replica died or closed the connection) is
		// a connection failure; data that cannot be decoded is garbage.
		if errors.Is(err, errGarbage) || errors.Is(err, openai.ErrEventTooLong) {
			return &attemptError{replica: b.Name, reason: reasonGarbage, err: err}
		}
		return &attemptError{replica: b.Name, reason: reasonConn, err: err}
	}

	if resp.StatusCode >= 500 {
		buf, _ := io.ReadAll(io.LimitReader(body, maxErrorBody))
		p.finish(id, 0, -1, false)
		return result{
			err:   &attemptError{replica: b.Name, reason: reasonStatus, status: resp.StatusCode},
			retry: true,
			resp:  &storedResponse{status: resp.StatusCode, header: filterHeader(resp.Header), body: buf},
		}
	}
	if isEventStream(resp.Header) && resp.StatusCode < 300 {
		return x.stream(id, d, b, n, resp, body, readFailure, cancel)
	}
	return x.buffered(id, d, b, n, resp, body, readFailure)
}

// outRequest builds the request to replica b: b's scheme, host and base
// path with the request's path and query (the URL built as a struct, as
// parsing its string form would give it), the request's headers less
// hop-by-hop ones, and its body, read again from the exchange's buffer.
func (x *exchange) outRequest(ctx context.Context, b *backend) (*http.Request, error) {
	return x.outRequestWith(ctx, b, x.body)
}

// outRequestWith is outRequest with body; a disaggregated request's legs
// carry its X-Request-Id.
func (x *exchange) outRequestWith(ctx context.Context, b *backend, body []byte) (*http.Request, error) {
	u := new(url.URL)
	*u = *b.Base
	u.Path = b.basePath + x.r.URL.Path
	u.RawPath = ""
	u.RawQuery = x.r.URL.RawQuery
	if u.Path != "" && u.Path[0] != '/' {
		// "OPTIONS *": as its string form parses.
		pu, err := url.Parse(u.String())
		if err != nil {
			return nil, fmt.Errorf("proxy: build request to %s: %w", b.Name, err)
		}
		u = pu
	}
	u.Host = b.host
	out, err := http.NewRequestWithContext(ctx, x.r.Method, "", nil)
	if err != nil {
		return nil, fmt.Errorf("proxy: build request to %s: %w", b.Name, err)
	}
	out.URL, out.Host = u, b.host
	if len(body) > 0 {
		// A body the Transport knows is in memory (a *bytes.Reader) goes
		// out with the headers, in one write from the connection's buffer
		// (Transport.WriteBufferSize); any other body, after the headers are
		// flushed, through a copy buffer of its own.
		out.Body, out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	out.Header = x.r.Header.Clone()
	if out.Header == nil {
		out.Header = make(http.Header)
	}
	removeHop(out.Header)
	out.Header.Del("Accept-Encoding") // identity: the proxy reads the body on the side
	if x.rid != "" {
		out.Header.Set(HeaderRequestID, x.rid)
	}
	if host, _, err := net.SplitHostPort(x.r.RemoteAddr); err == nil {
		if prior := x.r.Header.Values("X-Forwarded-For"); len(prior) > 0 {
			host = strings.Join(prior, ", ") + ", " + host
		}
		out.Header.Set("X-Forwarded-For", host)
	}
	return out, nil
}

// newBackend is the proxy's state of pool member m, counting in bm.
func newBackend(m *cluster.Member, bm *backendMetrics) *backend {
	return &backend{Member: m, basePath: strings.TrimSuffix(m.Base.Path, "/"), host: hostOf(m.Base), m: bm, hcOK: true}
}

// hostOf is u's host less an empty port ("h:" is "h"), as
// http.NewRequest sets a request's URL.Host and Host.
func hostOf(u *url.URL) string {
	h := u.Host
	if strings.LastIndex(h, ":") > strings.LastIndex(h, "]") {
		return strings.TrimSuffix(h, ":")
	}
	return h
}

// transportFailure classifies an error of the round trip (no response).
func (x *exchange) transportFailure(b *backend, err error) result {
	if x.r.Context().Err() != nil {
		return result{err: fmt.Errorf("proxy: forward to %s: client gone: %w", b.Name, err)}
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return result{err: &attemptError{replica: b.Name, reason: reasonTimeout, err: err}, retry: true}
		}
		return result{err: &attemptError{replica: b.Name, reason: reasonDial, err: err}, retry: true, dead: true}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return result{err: &attemptError{replica: b.Name, reason: reasonTimeout, err: err}, retry: true}
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return result{err: &attemptError{replica: b.Name, reason: reasonTimeout, err: err}}
	}
	return result{err: &attemptError{replica: b.Name, reason: reasonConn, err: err}, retry: true}
}

// writeHead sends the response status and headers (the replica's, less
// hop-by-hop ones, plus the explanation).
func (x *exchange) writeHead(d *policy.Decision, b *backend, n int, resp *http.Response, contentLength int) {
	h := x.w.Header()
	addEndToEnd(h, resp.Header)
	h.Del("Content-Length")
	if contentLength >= 0 {
		h.Set("Content-Length", strconv.Itoa(contentLength))
	}
	x.setRouteHeaders(d, b, n)
	x.w.WriteHeader(resp.StatusCode)
	x.wrote = true
	x.code = strconv.Itoa(resp.StatusCode)
	x.status = resp.StatusCode
}

// stream passes a Server-Sent Events response through event by event,
// flushing each (with the next ones when they arrived together), and reads
// the events on the side. The status and headers
// go out with the first event, so a replica that fails before its first
// event is retried.
func (x *exchange) stream(id uint64, d *policy.Decision, b *backend, n int, resp *http.Response, body io.Reader, readFailure func(error) *attemptError, cancel func()) result {
	p := x.p
	rc := http.NewResponseController(x.w)
	fr := openai.NewFramer(body, 0)
	defer fr.Release()
	var st openai.Stream
	var gaps calibrate.Gaps
	first := false
	fail := func(err error) result {
		p.finish(id, st.Tokens, -1, false)
		if !x.wrote {
			return result{err: err, retry: x.r.Context().Err() == nil}
		}
		if x.r.Context().Err() != nil {
			x.code = "cancelled"
			return result{err: err}
		}
		p.log.Warn("stream failed after its first event", "replica", b.Name, "err", err)
		_, _ = x.w.Write(openai.ErrorEvent(err))
		_ = rc.Flush()
		x.code = "aborted"
		return result{err: err}
	}
	for {
		ev, err := fr.Next()
		if err == io.EOF {
			if !st.SawDone {
				return fail(readFailure(errTruncated))
			}
			break
		}
		if err != nil {
			if err == io.ErrUnexpectedEOF {
				err = fmt.Errorf("%w: cut inside an event", errTruncated)
			}
			return fail(readFailure(err))
		}
		token, gerr := st.Observe(&ev)
		if gerr != nil {
			return fail(readFailure(errGarbage))
		}
		if !x.wrote {
			x.writeHead(d, b, n, resp, -1)
		}
		if _, werr := x.w.Write(ev.Raw); werr != nil {
			p.finish(id, st.Tokens, -1, false)
			x.code = "cancelled"
			return result{err: fmt.Errorf("proxy: write to client: %w", werr)}
		}
		// Flush now unless the next event has arrived already: events that
		// came in one read (the usage chunk and [DONE], or tokens bunched
		// up under load) leave in one write, at no cost to their latency.
		if !fr.Ready() {
			_ = rc.Flush()
		}
		if token {
			gaps.Token(time.Now())
		}
		if token && !first {
			first = true
			p.firstToken(id)
			b.m.ttft().Observe(time.Since(x.start).Seconds())
		}
		if st.SawDone {
			break
		}
	}
	fin := router.Finish{OutputTokens: st.Tokens, CachedTokens: -1, OK: !st.UpstreamError, Timings: st.Timings.Calibration()}
	if st.Usage != nil {
		fin.OutputTokens, fin.CachedTokens, fin.PromptTokens = st.Usage.CompletionTokens, st.Cached(), st.Usage.PromptTokens
	}
	fin.ITL, fin.ITLSamples = gaps.Median()
	x.done(id, d, b, fin)
	drainAfterDone(fr, cancel)
	return result{}
}

// Bounds on reading a stream's response to its end after [DONE].
const (
	drainWait   = 100 * time.Millisecond
	drainEvents = 4
)

// drainAfterDone reads what follows a stream's [DONE] (nothing, from a
// replica that behaves: its response ends there), up to its end, so that
// the Transport keeps the connection: one whose response body is closed
// before its end is dropped, and the next request dials again. The
// chunked encoding's last chunk often arrives after [DONE], in a write of
// its own. A replica that keeps the stream open after [DONE] costs at most
// drainWait, then cancel aborts the read and the connection is dropped as
// before. Nothing read here reaches the client.
func drainAfterDone(fr *openai.Framer, cancel func()) {
	t := time.AfterFunc(drainWait, cancel)
	defer t.Stop()
	for range drainEvents {
		if _, err := fr.Next(); err != nil {
			return
		}
	}
}

// buffered forwards a response that is not a stream: it reads it (up to
// MaxResponseBytes), checks that a successful completion is JSON, learns its
// usage, and answers. A larger response is passed through unchecked
// (passThrough).
func (x *exchange) buffered(id uint64, d *policy.Decision, b *backend, n int, resp *http.Response, body io.Reader, readFailure func(error) *attemptError) result {
	p := x.p
	limit := p.cfg.MaxResponseBytes
	buf, err := io.ReadAll(io.LimitReader(body, limit+1))
	if err != nil {
		p.finish(id, 0, -1, false)
		return result{err: readFailure(err), retry: x.r.Context().Err() == nil}
	}
	ok := resp.StatusCode < 400
	out, cached, prompt := 0, -1, 0
	var timings *openai.Timings
	if int64(len(buf)) > limit {
		return x.passThrough(id, d, b, n, resp, buf, body, readFailure)
	}
	if ok && resp.StatusCode < 300 && x.req.Kind != openai.KindOther {
		c, isJSON := openai.ReadChunk(buf)
		if !isJSON {
			p.finish(id, 0, -1, false)
			return result{err: readFailure(fmt.Errorf("%w: response is not JSON", errGarbage)), retry: true}
		}
		timings = c.Timings
		if c.HasUsage {
			out, cached, prompt = c.CompletionTokens, c.CachedTokens, c.PromptTokens
		}
	}
	x.writeHead(d, b, n, resp, len(buf))
	if _, err := x.w.Write(buf); err != nil {
		p.finish(id, out, -1, false)
		x.code = "cancelled"
		return result{err: fmt.Errorf("proxy: write to client: %w", err)}
	}
	if ok {
		x.done(id, d, b, router.Finish{OutputTokens: out, CachedTokens: cached, PromptTokens: prompt, OK: true, Timings: timings.Calibration()})
	} else {
		p.finish(id, out, -1, false)
	}
	return result{}
}

// passThrough forwards a non-streamed response larger than
// MaxResponseBytes, unchecked: its head (read already), then the rest as it
// arrives, holding one copy buffer rather than the whole answer. The
// replica's Content-Length is kept when it sent one. A rest that cannot be
// read aborts the response (the client sees it cut, never a short body
// that looks whole).
func (x *exchange) passThrough(id uint64, d *policy.Decision, b *backend, n int, resp *http.Response, head []byte, body io.Reader, readFailure func(error) *attemptError) result {
	p := x.p
	length := -1
	if resp.ContentLength >= 0 && resp.ContentLength <= math.MaxInt {
		length = int(resp.ContentLength)
	}
	x.writeHead(d, b, n, resp, length)
	werr, rerr := copyResponse(x.w, head, body)
	switch {
	case werr != nil:
		p.finish(id, 0, -1, false)
		x.code = "cancelled"
		return result{err: fmt.Errorf("proxy: write to client: %w", werr)}
	case rerr != nil:
		p.finish(id, 0, -1, false)
		err := readFailure(rerr)
		if x.r.Context().Err() != nil {
			x.code = "cancelled"
			return result{err: err}
		}
		p.log.Warn("large response cut", "replica", b.Name, "err", err)
		x.code, x.abort = "aborted", true
		return result{err: err}
	}
	if resp.StatusCode < 400 {
		x.done(id, d, b, router.Finish{CachedTokens: -1, OK: true})
	} else {
		p.finish(id, 0, -1, false)
	}
	return result{}
}

// copyBufferBytes is passThrough's copy buffer, io.Copy's size.
const copyBufferBytes = 32 << 10

// copyResponse writes head, then what body reads to its end, to w, and
// tells a failed write (werr) from a failed read (rerr).
func copyResponse(w io.Writer, head []byte, body io.Reader) (werr, rerr error) {
	if _, err := w.Write(head); err != nil {
		return err, nil
	}
	buf := make([]byte, copyBufferBytes)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr, nil
			}
		}
		if err == io.EOF {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// done records a request that the replica answered, with what the front
// door learnt of it.
func (x *exchange) done(id uint64, d *policy.Decision, b *backend, fin router.Finish) {
	p := x.p
	p.finishWith(id, fin)
	x.tq.answered(&fin)
	if fin.OK {
		b.m.latency().Observe(time.Since(x.start).Seconds())
		if fin.CachedTokens >= 0 {
			p.m.Prediction(d.MatchedTokens, fin.CachedTokens, p.cfg.BlockTokens)
		}
	}
}

// idleReader cancels its request (through t) when a read has waited d.
type idleReader struct {
	r io.Reader
	t *time.Timer
	d time.Duration
}

func (ir *idleReader) Read(b []byte) (int, error) {
	n, err := ir.r.Read(b)
	if n > 0 {
		ir.t.Reset(ir.d)
	}
	return n, err
}

// isEventStream reports whether h declares a Server-Sent Events body.
func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	switch ct {
	case "text/event-stream", "text/event-stream; charset=utf-8": // vLLM's, SGLang's, llama.cpp's
		return true
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

// copyHeader adds src's values to dst.
func copyHeader(dst, src http.Header) {
	for k, vv := range src {
		for _, v := range vv {
			dst.Add(k, v)
		}
	}
}

// addEndToEnd adds src's end-to-end headers to dst: what filterHeader
// keeps, without copying src first. The value lists are shared, capped so
// that a later Add to dst copies them.
func addEndToEnd(dst, src http.Header) {
	conn := src["Connection"]
	for k, vv := range src {
		if isHop(k) || namedIn(conn, k) {
			continue
		}
		if old, ok := dst[k]; ok {
			dst[k] = append(old, vv...)
		} else {
			dst[k] = vv[:len(vv):len(vv)]
		}
	}
}

// isHop reports whether k (canonical) is a hop-by-hop header.
func isHop(k string) bool {
	for _, h := range hopHeaders {
		if k == h {
			return true
		}
	}
	return false
}

// namedIn reports whether the Connection header values conn name k (a key
// of the header map), as removeHop's Del would find it.
func namedIn(conn []string, k string) bool {
	for _, f := range conn {
		for name := range strings.SplitSeq(f, ",") {
			if name = strings.TrimSpace(name); name != "" && http.CanonicalHeaderKey(name) == k {
				return true
			}
		}
	}
	return false
}

// filterHeader returns h less hop-by-hop headers.
func filterHeader(h http.Header) http.Header {
	out := h.Clone()
	removeHop(out)
	return out
}

// removeHop deletes hop-by-hop headers, including those named in
// Connection.
func removeHop(h http.Header) {
	for _, f := range h.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}
