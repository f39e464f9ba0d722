package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/tenancy"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// TestMain fails the package if a test leaves a goroutine of this package
// running.
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if leaked := leakedGoroutines(); leaked != "" {
			fmt.Fprintf(os.Stderr, "leaked goroutines:\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

// leakedGoroutines returns the stacks of goroutines still running this
// package's code. Goroutine ends cannot be waited on, so it polls briefly.
func leakedGoroutines() string {
	var stacks []string
	for range 100 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		stacks = stacks[:0]
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "prefixlb/internal/proxy.") && !strings.Contains(g, "leakedGoroutines") &&
				!strings.Contains(g, "TestMain") {
				stacks = append(stacks, g)
			}
		}
		if len(stacks) == 0 {
			return ""
		}
		time.Sleep(10 * time.Millisecond)
	}
	return strings.Join(stacks, "\n\n")
}

// testConfig is a config over reps with fast health checks and no
// scraping, quiet logs.
func testConfig(reps ...*fakeReplica) Config {
	c := DefaultConfig()
	for _, r := range reps {
		c.Backends = append(c.Backends, r.backend())
	}
	c.HealthInterval = time.Hour // tests that need checks set it
	c.ScrapeInterval = 0
	c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	return c
}

// startProxy builds a proxy for cfg and serves its handler on loopback.
func startProxy(t *testing.T, cfg Config) (*Proxy, *httptest.Server) {
	t.Helper()
	p, err := New(cfg)
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

// runLoops runs p.Run until the test ends.
func runLoops(t *testing.T, p *Proxy) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

func post(t *testing.T, url, path, body string) *http.Response {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return b
}

const (
	streamBody = `{"model":"m","prompt":"You are a helpful assistant. Answer briefly and precisely, please. Question one?","stream":true,"max_tokens":5,"stream_options":{"include_usage":true}}`
	chatBody   = `{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant with a long system prompt that is shared."},{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true,"max_tokens":3}`
	plainBody  = `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":3}`
)

func TestStreamPassedThroughByteForByte(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	_, srv := startProxy(t, cfg)
	for _, tc := range []struct{ name, path, body string }{
		{"completions", "/v1/completions", streamBody},
		{"chat", "/v1/chat/completions", chatBody},
		{"non-streamed", "/v1/completions", plainBody},
	} {
		t.Run(tc.name, func(t *testing.T) {
			direct := post(t, rep.srv.URL, tc.path, tc.body)
			want := readAll(t, direct)
			resp := post(t, srv.URL, tc.path, tc.body)
			got := readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("proxied body differs:\n got %q\nwant %q", got, want)
			}
			if ct, wct := resp.Header.Get("Content-Type"), direct.Header.Get("Content-Type"); ct != wct {
				t.Errorf("Content-Type %q, want %q", ct, wct)
			}
			if got := resp.Header.Get(HeaderReplica); got != "r0" {
				t.Errorf("%s = %q, want r0", HeaderReplica, got)
			}
			if got := resp.Header.Get(HeaderRoute); !strings.HasPrefix(got, "branch=") || !strings.Contains(got, "matched=") {
				t.Errorf("%s = %q, want an explanation", HeaderRoute, got)
			}
		})
	}
}

// TestStreamFlushesEachEvent checks that an event reaches the client while
// the replica is still generating (no buffering of the stream).
func TestStreamFlushesEachEvent(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	rep.mode.Store(modeHold)
	_, srv := startProxy(t, testConfig(rep))
	resp := post(t, srv.URL, "/v1/completions", streamBody)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q, %v", line, err)
	}
	_, release, _ := rep.holdChans()
	close(release)
	rest, _ := io.ReadAll(br)
	if !bytes.HasSuffix(rest, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream ends %q", rest)
	}
}

func TestExplanationHeadersAndMetrics(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	a.cached.Store(0)
	b.cached.Store(0)
	cfg := testConfig(a, b)
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	_, srv := startProxy(t, cfg)
	// The same long prompt twice: the second decision matches the first's
	// prefix (e2 exploit) and goes to the same replica.
	long := strings.Repeat("shared system prompt. ", 40)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, long)
	r1 := post(t, srv.URL, "/v1/completions", body)
	readAll(t, r1)
	r2 := post(t, srv.URL, "/v1/completions", body)
	readAll(t, r2)
	if r1.Header.Get(HeaderReplica) != r2.Header.Get(HeaderReplica) {
		t.Errorf("same prompt went to %s then %s", r1.Header.Get(HeaderReplica), r2.Header.Get(HeaderReplica))
	}
	route := r2.Header.Get(HeaderRoute)
	if !strings.Contains(route, "branch=exploit") || strings.Contains(route, "matched=0;") {
		t.Errorf("second decision %q, want an exploit with matched tokens", route)
	}
	m := readAll(t, mustGet(t, srv.URL+"/metrics"))
	for _, want := range []string{
		`prefixlb_requests_total{code="200",policy="e2",replica="` + r1.Header.Get(HeaderReplica) + `"} 2`,
		`prefixlb_decisions_total{branch="exploit",policy="e2"`,
		`prefixlb_replica_up{replica="a"} 1`,
		`prefixlb_cache_predictions_total{outcome="over"} 1`, // predicted a hit, replica reported 0
		`prefixlb_cache_predictions_total{outcome="exact"} 1`,
		`prefixlb_request_latency_seconds_count`,
		`prefixlb_inflight{replica="a"} 0`,
		"prefixlb_tree_blocks 13", // 880 bytes of prompt: 13 full 64-byte chunks
	} {
		if !strings.Contains(string(m), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

func mustGet(t *testing.T, url string) *http.Response {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func TestRetryWhenReplicaIsDead(t *testing.T) {
	live := newFakeReplica(t, "live")
	cfg := testConfig()
	cfg.Policy = "round-robin"
	cfg.Backends = []Backend{{Name: "dead", URL: deadURL(t)}, live.backend()}
	p, srv := startProxy(t, cfg)
	for i := range 3 {
		for _, body := range []string{streamBody, plainBody} {
			resp := post(t, srv.URL, "/v1/completions", body)
			got := readAll(t, resp)
			if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderReplica) != "live" {
				t.Fatalf("request %d: status %d from %q: %s", i, resp.StatusCode, resp.Header.Get(HeaderReplica), got)
			}
			if i == 0 && body == streamBody && resp.Header.Get(HeaderRetries) != "1" {
				t.Errorf("first request: %s = %q, want 1", HeaderRetries, resp.Header.Get(HeaderRetries))
			}
		}
	}
	if reps := p.Replicas(); reps[0].Up || !reps[1].Up {
		t.Errorf("replicas %+v: want dead ejected, live up", reps)
	}
	if got := live.served.Load(); got != 6 {
		t.Errorf("live served %d, want 6", got)
	}
	m := string(readAll(t, mustGet(t, srv.URL+"/metrics")))
	if !strings.Contains(m, `prefixlb_retries_total{reason="dial",replica="dead"} 1`) {
		t.Errorf("metrics lack the retry:\n%s", grep(m, "retries"))
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func TestRetryOn5xxAndGarbage(t *testing.T) {
	for _, mode := range []string{modeStatus, modeGarbage, modeNoEvent} {
		t.Run(mode, func(t *testing.T) {
			bad, good := newFakeReplica(t, "bad"), newFakeReplica(t, "good")
			bad.mode.Store(mode)
			cfg := testConfig(bad, good)
			cfg.Policy = "round-robin"
			p, srv := startProxy(t, cfg)
			body := plainBody
			if mode == modeNoEvent {
				body = streamBody
			}
			resp := post(t, srv.URL, "/v1/completions", body)
			got := readAll(t, resp)
			if resp.StatusCode != 200 || resp.Header.Get(HeaderReplica) != "good" || resp.Header.Get(HeaderRetries) != "1" {
				t.Fatalf("status %d from %q (retries %q): %s", resp.StatusCode, resp.Header.Get(HeaderReplica), resp.Header.Get(HeaderRetries), got)
			}
			if reps := p.Replicas(); !reps[0].Up {
				t.Errorf("a replica that answered is not ejected passively")
			}
			if bad.served.Load() != 1 {
				t.Errorf("bad served %d, want 1", bad.served.Load())
			}
		})
	}
}

func TestAllReplicasFailReplaysLast5xx(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	a.mode.Store(modeStatus)
	b.mode.Store(modeStatus)
	cfg := testConfig(a, b)
	cfg.MaxRetries = 5 // more than replicas: each is tried once
	_, srv := startProxy(t, cfg)
	resp := post(t, srv.URL, "/v1/completions", plainBody)
	got := readAll(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(got), "overloaded") {
		t.Errorf("status %d: %s", resp.StatusCode, got)
	}
	if n := a.served.Load() + b.served.Load(); n != 2 {
		t.Errorf("replicas served %d attempts, want 2", n)
	}
}

func TestEjectionAndReadmission(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	cfg := testConfig(a, b)
	cfg.Policy = "round-robin"
	cfg.HealthInterval = 5 * time.Millisecond
	cfg.EjectAfter, cfg.ReadmitAfter = 2, 3
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 16)
	p.hookState = func(name string, up bool) { events <- fmt.Sprintf("%s:%v", name, up) }
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()
	defer p.Close()
	runLoops(t, p)

	wait := func(want string) {
		t.Helper()
		select {
		case got := <-events:
			if got != want {
				t.Fatalf("state change %s, want %s", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no state change %s", want)
		}
	}
	a.healthy.Store(false)
	wait("a:false")
	for range 4 {
		resp := post(t, srv.URL, "/v1/completions", plainBody)
		readAll(t, resp)
		if got := resp.Header.Get(HeaderReplica); got != "b" {
			t.Fatalf("request went to ejected %s", got)
		}
	}
	if h := mustGet(t, srv.URL+"/health"); h.StatusCode != 200 {
		t.Errorf("/health %d with one replica up", h.StatusCode)
	}
	b.healthy.Store(false)
	wait("b:false")
	resp := post(t, srv.URL, "/v1/completions", plainBody)
	if body := readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), `"type":"service_unavailable_error"`) {
		t.Errorf("no replica up: status %d %s", resp.StatusCode, body)
	}
	if h := mustGet(t, srv.URL+"/health"); h.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/health %d with no replica up", h.StatusCode)
	}
	a.healthy.Store(true)
	wait("a:true")
	resp = post(t, srv.URL, "/v1/completions", plainBody)
	readAll(t, resp)
	if got := resp.Header.Get(HeaderReplica); resp.StatusCode != 200 || got != "a" {
		t.Errorf("after re-admission: %d from %q", resp.StatusCode, got)
	}
}

func TestClientCancelReachesReplica(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	rep.mode.Store(modeHold)
	p, srv := startProxy(t, testConfig(rep))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/completions", strings.NewReader(streamBody))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q, %v", line, err)
	}
	cancel()
	resp.Body.Close()
	_, _, canceled := rep.holdChans()
	select {
	case <-canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("the replica never saw the client's cancel")
	}
	// The core learns the request ended.
	for deadline := time.Now().Add(10 * time.Second); ; {
		if p.Replicas()[0].InFlight == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("request still in flight in the router")
		}
		runtime.Gosched()
	}
}

func TestDrainOnShutdown(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	rep.mode.Store(modeHold)
	cfg := testConfig(rep)
	cfg.DrainTimeout = 30 * time.Second
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	draining := make(chan struct{})
	p.hookShutdown = func() { close(draining) }
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- p.Serve(ctx, ln) }()

	resp := post(t, "http://"+ln.Addr().String(), "/v1/completions", streamBody)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q, %v", line, err)
	}
	stop()
	<-draining
	select {
	case err := <-served:
		t.Fatalf("Serve returned %v with a stream in flight", err)
	default:
	}
	if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		t.Error("still accepting connections while draining")
	}
	_, release, _ := rep.holdChans()
	close(release)
	rest, err := io.ReadAll(br)
	if err != nil || !bytes.HasSuffix(rest, []byte("data: [DONE]\n\n")) {
		t.Errorf("drained stream ends %q, %v", rest, err)
	}
	if err := <-served; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

func TestDrainTimeout(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	rep.mode.Store(modeHold)
	cfg := testConfig(rep)
	cfg.DrainTimeout = 50 * time.Millisecond
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- p.Serve(ctx, ln) }()
	resp := post(t, "http://"+ln.Addr().String(), "/v1/completions", streamBody)
	defer resp.Body.Close()
	_, _ = bufio.NewReader(resp.Body).ReadString('\n')
	stop()
	if err := <-served; !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Serve after an incomplete drain: %v", err)
	}
	_, _, canceled := rep.holdChans()
	<-canceled // the forced close reached the replica
}

func TestBadInput(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.MaxBodyBytes = 1024
	_, srv := startProxy(t, cfg)
	for _, tc := range []struct {
		name, path, body string
		status           int
		msg, typ         string
	}{
		{"malformed", "/v1/completions", `{"model":"m","prompt":`, 400, "malformed JSON", "invalid_request_error"},
		{"not an object", "/v1/completions", `[1,2]`, 400, "JSON object", "invalid_request_error"},
		{"stream type", "/v1/completions", `{"model":"m","prompt":"x","stream":"yes"}`, 400, "field stream", "invalid_request_error"},
		{"max_tokens type", "/v1/completions", `{"model":"m","prompt":"x","max_tokens":"9"}`, 400, "field max_tokens", "invalid_request_error"},
		{"prompt type", "/v1/completions", `{"model":"m","prompt":5}`, 400, "prompt must be", "invalid_request_error"},
		{"mixed prompt", "/v1/completions", `{"model":"m","prompt":[1,"a"]}`, 400, "token ids", "invalid_request_error"},
		{"negative id", "/v1/completions", `{"model":"m","prompt":[1,-2]}`, 400, "out of range", "invalid_request_error"},
		{"no prompt", "/v1/completions", `{"model":"m"}`, 400, "prompt", "invalid_request_error"},
		{"no model", "/v1/completions", `{"prompt":"x"}`, 400, "model", "invalid_request_error"},
		{"messages type", "/v1/chat/completions", `{"model":"m","messages":"hi"}`, 400, "field messages", "invalid_request_error"},
		{"no messages", "/v1/chat/completions", `{"model":"m","messages":[]}`, 400, "messages", "invalid_request_error"},
		{"content type", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":7}]}`, 400, "content", "invalid_request_error"},
		{"too large", "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("x", 2000) + `"}`, 413, "too large", "invalid_request_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, srv.URL, tc.path, tc.body)
			body := readAll(t, resp)
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(body, &e); err != nil {
				t.Fatalf("error body %q is not JSON: %v", body, err)
			}
			if !strings.Contains(e.Error.Message, tc.msg) || e.Error.Type != tc.typ || e.Error.Code != tc.status {
				t.Errorf("error %+v, want message with %q, type %s", e.Error, tc.msg, tc.typ)
			}
		})
	}
	if n := rep.served.Load(); n != 0 {
		t.Errorf("bad requests reached the replica %d times", n)
	}
}

// TestBrokenReplicaIsolated: a replica that answers garbage or closes a
// stream midway gives its client a clean error; a concurrent request on the
// other replica is unaffected.
func TestBrokenReplicaIsolated(t *testing.T) {
	for _, tc := range []struct {
		mode, body string
		stream     bool
	}{
		{modeGarbage, streamBody, true},
		{modeCut, streamBody, true},
		{modeGarbage, plainBody, false},
	} {
		t.Run(tc.mode+fmt.Sprint(tc.stream), func(t *testing.T) {
			bad, good := newFakeReplica(t, "bad"), newFakeReplica(t, "good")
			bad.mode.Store(tc.mode)
			cfg := testConfig(bad, good)
			cfg.Policy = "round-robin"
			cfg.MaxRetries = 0
			p, srv := startProxy(t, cfg)
			type answer struct {
				replica string
				status  int
				body    []byte
			}
			answers := make(chan answer, 2)
			var wg sync.WaitGroup
			for range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(tc.body))
					if err != nil {
						answers <- answer{body: []byte(err.Error())}
						return
					}
					b, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if err != nil {
						b = append(b, []byte("READ ERROR "+err.Error())...)
					}
					answers <- answer{resp.Header.Get(HeaderReplica), resp.StatusCode, b}
				}()
			}
			wg.Wait()
			close(answers)
			for a := range answers {
				switch a.replica {
				case "good":
					if a.status != 200 || (tc.stream && !bytes.HasSuffix(a.body, []byte("data: [DONE]\n\n"))) {
						t.Errorf("good replica's client: %d %q", a.status, a.body)
					}
				case "bad":
					if tc.stream {
						// 200 already sent: the stream ends with an error event.
						want := "\"type\":\"upstream_error\""
						if a.status != 200 || !bytes.Contains(a.body, []byte(want)) || !bytes.HasSuffix(a.body, []byte("data: [DONE]\n\n")) {
							t.Errorf("bad replica's client: %d %q", a.status, a.body)
						}
						if bytes.Contains(a.body, []byte("this is not json")) || bytes.Contains(a.body, []byte("partial")) {
							t.Errorf("garbage reached the client: %q", a.body)
						}
					} else if a.status != http.StatusBadGateway || !bytes.Contains(a.body, []byte(`"type":"upstream_error"`)) {
						t.Errorf("bad replica's client: %d %q", a.status, a.body)
					}
				default:
					t.Errorf("answer from %q: %d %q", a.replica, a.status, a.body)
				}
			}
			if n := p.Replicas()[0].InFlight + p.Replicas()[1].InFlight; n != 0 {
				t.Errorf("%d requests left in flight", n)
			}
		})
	}
}

func TestModelsHealthNotFound(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	_, srv := startProxy(t, testConfig(a, b))
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/v1/models")), &list); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if got, want := strings.Join(ids, ","), "m-a,shared,m-b"; got != want {
		t.Errorf("models %s, want %s", got, want)
	}
	if r := mustGet(t, srv.URL+"/health"); r.StatusCode != 200 {
		t.Errorf("/health %d", r.StatusCode)
	}
	r := mustGet(t, srv.URL+"/nope")
	if body := readAll(t, r); r.StatusCode != 404 || !strings.Contains(string(body), "not_found_error") {
		t.Errorf("/nope %d %s", r.StatusCode, body)
	}
}

func TestOtherV1PathForwarded(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	seen := make(chan string, 1)
	rep.srv.Config.Handler.(*http.ServeMux).HandleFunc("/v1/embeddings", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen <- string(b)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"data":[]}`)
	})
	_, srv := startProxy(t, testConfig(rep))
	resp := post(t, srv.URL, "/v1/embeddings", `{"model":"m","input":"hello"}`)
	body := readAll(t, resp)
	got := <-seen
	if resp.StatusCode != 200 || string(body) != `{"data":[]}` || got != `{"model":"m","input":"hello"}` || resp.Header.Get(HeaderReplica) != "r0" {
		t.Errorf("embeddings: %d %s (replica saw %s)", resp.StatusCode, body, got)
	}
}

func TestDebugRouteAuth(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	cfg := testConfig(a, b)
	cfg.AdminToken = "s3cret"
	_, srv := startProxy(t, cfg)
	do := func(token string) *http.Response {
		req, _ := http.NewRequest("POST", srv.URL+"/debug/route", strings.NewReader(chatBody))
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for _, tok := range []string{"", "wrong"} {
		resp := do(tok)
		body := readAll(t, resp)
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(body), "authentication_error") {
			t.Errorf("token %q: %d %s", tok, resp.StatusCode, body)
		}
	}
	resp := do("s3cret")
	var ex RouteExplanation
	if err := json.Unmarshal(readAll(t, resp), &ex); err != nil || resp.StatusCode != 200 {
		t.Fatalf("debug route: %d %v", resp.StatusCode, err)
	}
	if (ex.Replica != "a" && ex.Replica != "b") || ex.Branch == "" || ex.Policy != "e2" || len(ex.Candidates) == 0 || !strings.HasPrefix(ex.Explain, "branch=") || ex.Keys == 0 {
		t.Errorf("explanation %+v", ex)
	}
	// e2's terms, per candidate and rendered.
	if !strings.Contains(ex.ExplainTerms, "prefill=") || ex.Candidates[0].Terms == nil {
		t.Errorf("no cost terms: %q, candidate %+v", ex.ExplainTerms, ex.Candidates[0])
	}
	if n := a.served.Load() + b.served.Load(); n != 0 {
		t.Errorf("debug route forwarded %d requests", n)
	}
	req, _ := http.NewRequest("GET", srv.URL+"/debug/replicas", nil)
	req.Header.Set("Authorization", "Bearer s3cret")
	r2, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, r2); r2.StatusCode != 200 || !strings.Contains(string(body), `"name":"a"`) {
		t.Errorf("debug replicas: %d %s", r2.StatusCode, body)
	}
}

func TestScrapeFeedsTheRouter(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.pool.Scrape(context.Background(), p.backendAt(0).Member)
	got := p.Replicas()[0]
	if got.Running != 2 || got.Waiting != 1 || got.KVUsage != 0.25 {
		t.Errorf("scraped load %+v", got)
	}
}

func TestParseLoad(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		want       upstream.Load
	}{
		{"vllm", `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.3
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="x"} 1024.0
`, upstream.Load{Waiting: 7, Running: 5, KVUsage: 0.4}},
		{"vllm old", `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 4
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.125
`, upstream.Load{Waiting: 4, Running: 1, KVUsage: 0.125}},
		{"sglang", `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.82
`, upstream.Load{Waiting: 3, Running: 12, KVUsage: 0.82}},
		{"unknown engine", "# TYPE up gauge\nup 1\n", upstream.UnknownLoad},
		{"nan", "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running 1\n", upstream.Load{Waiting: -1, Running: 1, KVUsage: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := upstream.ParseLoad(strings.NewReader(tc.text))
			if err != nil {
				t.Fatal(err)
			}
			if got.Waiting != tc.want.Waiting || got.Running != tc.want.Running || abs(got.KVUsage-tc.want.KVUsage) > 1e-9 {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
	if _, err := upstream.ParseLoad(strings.NewReader("this is { not prometheus")); err == nil {
		t.Error("garbage parsed")
	}
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

// backendAt returns the replica in router slot id.
func (p *Proxy) backendAt(id int) *backend {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pool.Member(id).Front.(*backend)
}
