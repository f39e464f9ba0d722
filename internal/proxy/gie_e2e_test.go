package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/epp"
)

// gieEngine is one in-process engine (internal/engine) on loopback that
// records which requests it served, by X-Request-Id.
type gieEngine struct {
	name, url, addr string
	srv             *httptest.Server
	mu              sync.Mutex
	seen            []string // guarded by mu
}

func (e *gieEngine) saw() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.seen...)
}

// startGIEEngines runs n modelled replicas, 100 times faster than real
// time, until the test ends; configure, if given, adjusts each engine's
// config.
func startGIEEngines(t testing.TB, n int, configure ...func(*engine.Config)) []*gieEngine {
	t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	var out []*gieEngine
	for i := range n {
		ec := engine.DefaultConfig()
		ec.Replica.Profile = prof
		ec.TimeScale = 100
		ec.Logger = slog.New(slog.DiscardHandler)
		for _, f := range configure {
			f(&ec)
		}
		e, err := engine.New(ec)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()
		ge := &gieEngine{name: fmt.Sprintf("engine-%d", i)}
		h := e.Handler()
		ge.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasPrefix(r.URL.Path, "/v1/") && r.Method == http.MethodPost {
				ge.mu.Lock()
				ge.seen = append(ge.seen, r.Header.Get("X-Request-Id"))
				ge.mu.Unlock()
			}
			h.ServeHTTP(w, r)
		}))
		ge.url = ge.srv.URL
		u, _ := url.Parse(ge.url)
		ge.addr = u.Host
		t.Cleanup(func() {
			ge.srv.Close()
			cancel()
			if err := <-done; err != nil {
				t.Errorf("engine %s: Run: %v", ge.name, err)
			}
		})
		out = append(out, ge)
	}
	return out
}

// pickerLog records the destination prefixlb epp answered for each
// request, by X-Request-Id, from a gRPC interceptor around its server.
type pickerLog struct {
	mu   sync.Mutex
	dest map[string]string // guarded by mu
}

func (l *pickerLog) get(rid string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dest[rid]
}

type recordingStream struct {
	grpc.ServerStream
	log *pickerLog
	mu  sync.Mutex
	rid string // guarded by mu
}

func (s *recordingStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	if req, ok := m.(*extprocv3.ProcessingRequest); ok && err == nil {
		for _, h := range req.GetRequestHeaders().GetHeaders().GetHeaders() {
			if h.GetKey() == "x-request-id" {
				s.mu.Lock()
				s.rid = string(h.GetRawValue())
				s.mu.Unlock()
			}
		}
	}
	return err
}

func (s *recordingStream) SendMsg(m any) error {
	if r, ok := m.(*extprocv3.ProcessingResponse); ok {
		for _, o := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if o.GetHeader().GetKey() == gieDestination {
				s.mu.Lock()
				rid := s.rid
				s.mu.Unlock()
				s.log.mu.Lock()
				s.log.dest[rid] = string(o.GetHeader().GetRawValue())
				s.log.mu.Unlock()
			}
		}
	}
	return s.ServerStream.SendMsg(m)
}

// startEPP runs prefixlb epp's picker and ext_proc server (internal/epp)
// with policy over the engines at addrs, on a loopback TCP port, until the
// test ends.
func startEPP(t testing.TB, addrs []string, policy string, fallbacks int) (*epp.Picker, string, *pickerLog) {
	t.Helper()
	pk, err := epp.NewPicker(epp.Config{Policy: policy, Fallbacks: fallbacks, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for i, a := range addrs {
		pk.Add(epp.Replica{Name: fmt.Sprintf("r%d", i), Address: a, Ready: true})
	}
	s := epp.NewServer(pk, epp.ServerConfig{Logger: slog.New(slog.DiscardHandler)})
	s.SetServing(true)
	log := &pickerLog{dest: map[string]string{}}
	g := grpc.NewServer(grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, &recordingStream{ServerStream: ss, log: log})
	}))
	s.Register(g)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	go func() { _ = g.Serve(ln); done <- struct{}{} }()
	go func() { _ = pk.Run(ctx); done <- struct{}{} }()
	t.Cleanup(func() {
		g.Stop()
		cancel()
		<-done
		<-done
	})
	return pk, ln.Addr().String(), log
}

// gieProxy serves a proxy over the engines' backends (by position in
// backends) with endpoint picker at picker.
func gieProxy(t testing.TB, engines []*gieEngine, picker string, configure ...func(*Config)) (*Proxy, *httptest.Server) {
	t.Helper()
	c := DefaultConfig()
	for _, e := range engines {
		c.Backends = append(c.Backends, Backend{Name: e.name, URL: e.url})
	}
	c.HealthInterval = time.Hour
	c.ScrapeInterval = 0
	c.Logger = slog.New(slog.DiscardHandler)
	c.EndpointPicker = picker
	for _, f := range configure {
		f(&c)
	}
	p, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(func() {
		srv.Close()
		p.Close()
	})
	return p, srv
}

// gieResult is what a client learnt from one request.
type gieResult struct {
	status  int
	replica string
	body    string // a non-200 answer's body
	events  int    // SSE data events with text
	done    bool   // the stream ended with [DONE]
	usage   bool   // an event carried usage
	err     error
}

// gieSend posts a completions body with X-Request-Id rid and reads the
// answer to its end.
func gieSend(t testing.TB, base, rid, body string) gieResult {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", rid)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return gieResult{err: err}
	}
	defer resp.Body.Close()
	res := gieResult{status: resp.StatusCode, replica: resp.Header.Get(HeaderReplica)}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		b, err := io.ReadAll(resp.Body)
		res.body, res.err = string(b), err
		return res
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			res.done = true
			continue
		}
		var c chunkInfo
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			res.err = fmt.Errorf("event %q: %v", data, err)
			return res
		}
		if c.Usage != nil {
			res.usage = true
		}
		for _, ch := range c.Choices {
			if ch.Text != nil && *ch.Text != "" {
				res.events++
			}
		}
	}
	res.err = sc.Err()
	return res
}

// counter sums the series of a counter in reg whose labels include
// labels ("k", "v", ...).
func counter(t testing.TB, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue series
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// engineOf is the engine that served request rid ("" none).
func engineOf(engines []*gieEngine, rid string) *gieEngine {
	for _, e := range engines {
		for _, s := range e.saw() {
			if s == rid {
				return e
			}
		}
	}
	return nil
}

// TestGIEDataPlaneWithEPP runs serve --endpoint-picker in front of
// prefixlb epp over two engines: every request goes to the endpoint the
// picker named, repeat prompts stick to one endpoint, streams arrive
// whole, and the picker reads the usage (it counts the cached tokens the
// engines reported, and no request stays in flight).
func TestGIEDataPlaneWithEPP(t *testing.T) {
	engines := startGIEEngines(t, 2)
	// The prefix policy: repeats go where their prefix is, whatever the
	// timing (e2 may also replicate a prefix under load).
	pk, addr, plog := startEPP(t, []string{engines[0].addr, engines[1].addr}, "prefix", 1)
	p, srv := gieProxy(t, engines, addr)

	const groups, perGroup = 4, 3
	check := func(g, k int, res gieResult) *gieEngine {
		t.Helper()
		rid := fmt.Sprintf("g%d-k%d", g, k)
		if res.err != nil || res.status != http.StatusOK {
			t.Fatalf("%s: status %d, err %v, body %s", rid, res.status, res.err, res.body)
		}
		// Streaming (the protocol's "MUST support streaming mode"): the
		// SSE stream arrives whole through the picker.
		if !res.done || res.events == 0 || !res.usage {
			t.Fatalf("%s: stream done=%v events=%d usage=%v", rid, res.done, res.events, res.usage)
		}
		// Destination Endpoint: the request went to the primary endpoint
		// the picker named.
		e := engineOf(engines, rid)
		dest := plog.get(rid)
		if e == nil || dest == "" || strings.Split(dest, ",")[0] != e.addr {
			t.Fatalf("%s: picker named %q, served by %v", rid, dest, e)
		}
		if res.replica != e.name {
			t.Errorf("%s: %s = %q, want %q", rid, HeaderReplica, res.replica, e.name)
		}
		return e
	}
	// The first round at once (the picker spreads the misses by their
	// load), the repeats one by one.
	home := make([]*gieEngine, groups)
	first := make([]gieResult, groups)
	var wg sync.WaitGroup
	for g := range groups {
		wg.Go(func() { first[g] = gieSend(t, srv.URL, fmt.Sprintf("g%d-k0", g), e2ePrompt(g, 0, 256, 16, 32)) })
	}
	wg.Wait()
	for g := range groups {
		home[g] = check(g, 0, first[g])
	}
	for k := 1; k < perGroup; k++ {
		for g := range groups {
			rid := fmt.Sprintf("g%d-k%d", g, k)
			if e := check(g, k, gieSend(t, srv.URL, rid, e2ePrompt(g, k, 256, 16, 8))); e != home[g] {
				t.Errorf("%s served by %s, its prefix by %s: want prefix affinity", rid, e.name, home[g].name)
			}
		}
	}
	n0, n1 := len(engines[0].saw()), len(engines[1].saw())
	if n0+n1 != groups*perGroup {
		t.Errorf("engines served %d and %d requests, want %d", n0, n1, groups*perGroup)
	}
	t.Logf("engines served %d and %d requests", n0, n1)
	// The response path reached the picker: it read the usage of every
	// stream (the cached tokens of the repeats) and closed every request.
	if got := counter(t, pk.Registry(), "prefixlb_cached_tokens_reported_total"); got < float64(groups*(perGroup-1)*256) {
		t.Errorf("picker read %v cached tokens reported, want ≥ %d", got, groups*(perGroup-1)*256)
	}
	for _, r := range pk.Replicas() {
		if r.InFlight != 0 {
			t.Errorf("picker has %d requests in flight on %s after every response ended", r.InFlight, r.Name)
		}
	}
	if got := counter(t, p.m.Reg, "prefixlb_picker_calls_total", "outcome", "routed"); got != groups*perGroup {
		t.Errorf("prefixlb_picker_calls_total{outcome=routed} = %v, want %d", got, groups*perGroup)
	}
}

// TestGIEFallbackWithEPP stops the engine that holds a prompt's prefix:
// the picker still names it first, with the other as its fallback, and
// serve goes down the list ("If retry is configured, the proxy will go
// sequentially down the list until one valid endpoint is found").
func TestGIEFallbackWithEPP(t *testing.T) {
	engines := startGIEEngines(t, 2)
	_, addr, plog := startEPP(t, []string{engines[0].addr, engines[1].addr}, "e2", 1)
	p, srv := gieProxy(t, engines, addr)
	res := gieSend(t, srv.URL, "warm", e2ePrompt(0, 0, 256, 16, 4))
	if res.status != http.StatusOK {
		t.Fatalf("warm: %d %s", res.status, res.body)
	}
	home := engineOf(engines, "warm")
	home.srv.Close()
	p.fwd.CloseIdleConnections()
	res = gieSend(t, srv.URL, "after", e2ePrompt(0, 1, 256, 16, 4))
	if res.err != nil || res.status != http.StatusOK || !res.done {
		t.Fatalf("after: status %d err %v body %s", res.status, res.err, res.body)
	}
	dest := strings.Split(plog.get("after"), ",")
	if len(dest) < 2 || dest[0] != home.addr {
		t.Fatalf("picker named %v: want the stopped engine %s first, with a fallback", dest, home.addr)
	}
	if e := engineOf(engines, "after"); e == nil || e == home || e.addr != dest[1] {
		t.Fatalf("served by %v, want the fallback %s", e, dest[1])
	}
	if got := counter(t, p.m.Reg, "prefixlb_picker_fallbacks_total", "kind", "endpoint"); got != 1 {
		t.Errorf("prefixlb_picker_fallbacks_total{kind=endpoint} = %v, want 1", got)
	}
}

// TestGIESubsetHintWithEPP gives serve two of the picker's three
// engines: the subset hint it sends keeps every request on those two
// ("If the key x-gateway-destination-endpoint-subset is set, the EPP MUST
// only select endpoints from the specified list").
func TestGIESubsetHintWithEPP(t *testing.T) {
	engines := startGIEEngines(t, 3)
	_, addr, _ := startEPP(t, []string{engines[0].addr, engines[1].addr, engines[2].addr}, "e2", 2)
	_, srv := gieProxy(t, engines[:2], addr)
	for g := range 9 {
		rid := fmt.Sprintf("g%d", g)
		res := gieSend(t, srv.URL, rid, e2ePrompt(g, 0, 64, 16, 2))
		if res.status != http.StatusOK || !res.done {
			t.Fatalf("%s: status %d body %s err %v", rid, res.status, res.body, res.err)
		}
	}
	if n := len(engines[2].saw()); n != 0 {
		t.Errorf("the engine outside the subset served %d requests", n)
	}
}

// TestGIEPickerDown: a picker nobody listens for fails closed with 503
// and a message naming it (GIE's InferencePool failureMode defaults to
// FailClose), or, with EndpointPickerFailOpen, serve routes the request
// itself (FailOpen: "forward the request to an endpoint of its picking").
func TestGIEPickerDown(t *testing.T) {
	engines := startGIEEngines(t, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()

	p, srv := gieProxy(t, engines, dead)
	res := gieSend(t, srv.URL, "closed", e2ePrompt(0, 0, 64, 16, 2))
	if res.status != http.StatusServiceUnavailable || !strings.Contains(res.body, "endpoint picker "+dead) || !strings.Contains(res.body, "fails closed") {
		t.Fatalf("fail closed: status %d body %s", res.status, res.body)
	}
	if got := counter(t, p.m.Reg, "prefixlb_picker_failures_total", "reason", gieUnavailable); got != 1 {
		t.Errorf("prefixlb_picker_failures_total{reason=unavailable} = %v, want 1", got)
	}

	p, srv = gieProxy(t, engines, dead, func(c *Config) { c.EndpointPickerFailOpen = true })
	res = gieSend(t, srv.URL, "open", e2ePrompt(0, 0, 64, 16, 2))
	if res.status != http.StatusOK || !res.done || engineOf(engines, "open") == nil {
		t.Fatalf("fail open: status %d body %s err %v", res.status, res.body, res.err)
	}
	if got := counter(t, p.m.Reg, "prefixlb_picker_fallbacks_total", "kind", "fail_open"); got != 1 {
		t.Errorf("prefixlb_picker_fallbacks_total{kind=fail_open} = %v, want 1", got)
	}
}
