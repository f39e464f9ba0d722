package proxy

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// waitUntil polls cond (there is no event to wait on: a handler reaching a
// point of its body read) until it holds, failing the test after 20 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// metric returns the value of the series line of /metrics at url that
// starts with series (name and labels as Prometheus prints them), or -1.
func metric(t *testing.T, url, series string) float64 {
	t.Helper()
	for _, l := range strings.Split(string(readAll(t, mustGet(t, url+"/metrics"))), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("metric %s: %v", l, err)
			}
			return f
		}
	}
	return -1
}

// stalledBody opens a connection to addr and sends a completion request
// that declares declared body bytes and sends the first sent of them.
func stalledBody(t *testing.T, addr string, declared, sent int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", declared)
	if _, err := io.WriteString(c, head+`{"model":"m","prompt":"`+strings.Repeat("a", max(0, sent-22))); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestDeclaredBodiesBounded (issue 26, D2): 200 connections that declare
// 16 MiB bodies and send a few bytes hold 64.5 KiB each, not 16 MiB (the
// heap grows by tens of MiB, not 3 GiB), and another client is served
// meanwhile.
func TestDeclaredBodiesBounded(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	p, addr := serveLoopback(t, testConfig(rep))
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	const n = 200
	conns := make([]net.Conn, 0, n)
	for range n {
		conns = append(conns, stalledBody(t, addr, 16<<20, 30))
	}
	per := int64(trustedBodyBytes + bytes.MinRead)
	waitUntil(t, "every stalled body being read", func() bool { return p.bodies.held() == n*per })
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapInuse) - int64(before.HeapInuse); grew > 64<<20 {
		t.Errorf("heap in use grew by %d MiB for %d stalled 16 MiB bodies; want under 64 MiB", grew>>20, n)
	}
	resp := post(t, "http://"+addr, "/v1/completions", plainBody)
	if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("a client beside the stalled ones: %d %s", resp.StatusCode, body)
	}
	for _, c := range conns {
		c.Close()
	}
	waitUntil(t, "the stalled bodies' bytes released", func() bool { return p.bodies.held() == 0 })
}

// TestBodyMemoryBound: a body that would take the bytes held over
// max_inflight_body_bytes gets 429 with Retry-After and an error naming the
// setting, counted; once the body holding them is dropped, requests pass
// again.
func TestBodyMemoryBound(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.MaxBodyBytes = 1 << 20
	cfg.MaxInflightBodyBytes = 1 << 20
	p, addr := serveLoopback(t, cfg)
	url := "http://" + addr

	// 600 KiB of a declared 1 MiB: the buffer has grown to its declared
	// size, which is the whole budget.
	hog := stalledBody(t, addr, 1<<20, 600<<10)
	waitUntil(t, "the large body's buffer at its declared size", func() bool { return p.bodies.held() == 1<<20+bytes.MinRead })

	resp := post(t, url, "/v1/completions", plainBody)
	body := string(readAll(t, resp))
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("over the body budget: %d (Retry-After %q) %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if e := openAIError(t, body); e.Type != "rate_limit_error" || !strings.Contains(e.Message, "max_inflight_body_bytes") {
		t.Errorf("error %+v", e)
	}
	if got := metric(t, url, `prefixlb_refused_total{reason="body_memory"}`); got != 1 {
		t.Errorf("refused body_memory = %v, want 1", got)
	}
	hog.Close()
	waitUntil(t, "the large body's bytes released", func() bool { return p.bodies.held() == 0 })
	resp = post(t, url, "/v1/completions", plainBody)
	if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("after the large body was dropped: %d %s", resp.StatusCode, body)
	}
	if p.bodies.held() != 0 {
		t.Errorf("%d body bytes held after every request ended", p.bodies.held())
	}
}

// floodReplica answers prompts containing "flood" with far more than the
// sockets between it and a client hold (a stream of 64 MiB of events, or a
// 16 MiB JSON answer), stopping when its request is cancelled; other
// prompts get a short stream or a small answer. started and ended receive
// one value as each flood starts and ends.
type floodReplica struct {
	srv            *httptest.Server
	started, ended chan struct{}
}

func newFloodReplica(t *testing.T) *floodReplica {
	f := &floodReplica{started: make(chan struct{}, 8), ended: make(chan struct{}, 8)}
	event := "data: " + `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"` + strings.Repeat("x", 1000) + `","finish_reason":null}]}` + "\n\n"
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		flood, stream := bytes.Contains(b, []byte("flood")), bytes.Contains(b, []byte(`"stream":true`))
		fl := w.(http.Flusher)
		switch {
		case flood && stream:
			w.Header().Set("Content-Type", "text/event-stream")
			f.started <- struct{}{}
			for i := 0; i < 64<<10 && r.Context().Err() == nil; i++ {
				if _, err := io.WriteString(w, event); err != nil {
					break
				}
				fl.Flush()
			}
			f.ended <- struct{}{}
		case flood:
			const size = 16 << 20
			head, tail := `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"`, `","finish_reason":"length"}]}`
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(size))
			f.started <- struct{}{}
			io.WriteString(w, head)
			chunk := bytes.Repeat([]byte("y"), 64<<10)
			for left := size - len(head) - len(tail); left > 0 && r.Context().Err() == nil; left -= len(chunk) {
				if _, err := w.Write(chunk[:min(left, len(chunk))]); err != nil {
					break
				}
			}
			io.WriteString(w, tail)
			f.ended <- struct{}{}
		case stream:
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, event+event+"data: [DONE]\n\n")
		default:
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
		}
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// recv waits for one value on c, failing the test after 20 s.
func recv(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(20 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// TestZeroWindowClientFreesSlot (issue 26, D4): a client that sends a
// request and never reads its answer (a tiny receive buffer, a zero TCP
// window once it fills), streamed or not, loses its request within
// client_write_timeout of its last progress: the replica request is
// cancelled, the router told it ended, the request counted as
// client_timeout, and the only max_concurrent slot taken by the next client.
func TestZeroWindowClientFreesSlot(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			rep := newFloodReplica(t)
			cfg := testConfig()
			cfg.Backends = []Backend{{Name: "r0", URL: rep.srv.URL}}
			cfg.MaxConcurrent = 1
			const timeout = 2 * time.Second
			cfg.ClientWriteTimeout = timeout
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			released := make(chan struct{}, 8)
			p.hookReleased = func() { released <- struct{}{} }
			srv := httptest.NewServer(p.Handler())
			t.Cleanup(func() { srv.Close(); p.Close() })
			addr := strings.TrimPrefix(srv.URL, "http://")

			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := c.(*net.TCPConn).SetReadBuffer(4096); err != nil {
				t.Fatal(err)
			}
			body := fmt.Sprintf(`{"model":"m","prompt":"flood me","stream":%v}`, stream)
			fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			recv(t, "the flood to start", rep.started)
			t0 := time.Now()

			// The slot is held: the next client is refused.
			small := `{"model":"m","prompt":"hello"}`
			if stream {
				small = `{"model":"m","prompt":"hello","stream":true}`
			}
			resp := post(t, srv.URL, "/v1/completions", small)
			if readAll(t, resp); resp.StatusCode != http.StatusTooManyRequests {
				t.Errorf("while the stalled client holds the slot: %d, want 429", resp.StatusCode)
			}

			recv(t, "the stalled client's slot to be released", released)
			if d := time.Since(t0); d < timeout/2 || d > timeout+10*time.Second {
				t.Errorf("slot released %v after the flood started; want about client_write_timeout (%v)", d, timeout)
			}
			recv(t, "the replica's request to be cancelled", rep.ended)
			resp = post(t, srv.URL, "/v1/completions", small)
			got := readAll(t, resp)
			if resp.StatusCode != http.StatusOK || (stream && !bytes.HasSuffix(got, []byte("data: [DONE]\n\n"))) {
				t.Fatalf("the next client: %d %q", resp.StatusCode, got)
			}
			if got := metric(t, srv.URL, `prefixlb_requests_total{code="client_timeout",policy="e2",replica="r0"}`); got != 1 {
				t.Errorf("client_timeout requests = %v, want 1", got)
			}
			if n := p.Replicas()[0].InFlight; n != 0 {
				t.Errorf("the router holds %d requests in flight, want 0", n)
			}
		})
	}
}

// TestRetriesCountOnlyRetriesThatHappen (issue 26, D7): two replicas both
// failing with max_retries 5 make one retry, not two: the header, the
// metric and the log say 1.
func TestRetriesCountOnlyRetriesThatHappen(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	a.mode.Store(modeStatus)
	b.mode.Store(modeStatus)
	cfg := testConfig(a, b)
	cfg.MaxRetries = 5
	var logs bytes.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	_, srv := startProxy(t, cfg)
	resp := post(t, srv.URL, "/v1/completions", plainBody)
	readAll(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want the replayed 503", resp.StatusCode)
	}
	if got := resp.Header.Get(HeaderRetries); got != "1" {
		t.Errorf("%s = %q, want 1 (two replicas: one retry)", HeaderRetries, got)
	}
	total := 0.0
	for _, r := range []string{"a", "b"} {
		if v := metric(t, srv.URL, `prefixlb_retries_total{reason="status",replica="`+r+`"}`); v > 0 {
			total += v
		}
	}
	if total != 1 {
		t.Errorf("prefixlb_retries_total = %v, want 1", total)
	}
	if n := strings.Count(logs.String(), "retrying on another replica"); n != 1 {
		t.Errorf("%d retry log lines, want 1:\n%s", n, logs.String())
	}
}

// TestAllowedPaths: by default a replica's administrative /v1 paths
// (vLLM's LoRA loading) and methods other than the API's get 404 at the
// router, counted, and never reach a replica; the configured list replaces
// the default; "*" forwards every /v1 request.
func TestAllowedPaths(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	var admin atomic.Int64
	rep.srv.Config.Handler.(*http.ServeMux).HandleFunc("/v1/load_lora_adapter", func(w http.ResponseWriter, r *http.Request) {
		admin.Add(1)
		io.WriteString(w, "Success: LoRA adapter loaded")
	})
	rep.srv.Config.Handler.(*http.ServeMux).HandleFunc("/v1/embeddings", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"data":[]}`)
	})
	do := func(url, method, path, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url+path, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(readAll(t, resp))
	}
	lora := `{"lora_name":"x","lora_path":"/tmp/evil"}`
	for _, tc := range []struct {
		name    string
		allowed []string // nil: the default
		method  string
		path    string
		body    string
		want    int
	}{
		{"default lora", nil, "POST", "/v1/load_lora_adapter", lora, 404},
		{"default unload", nil, "POST", "/v1/unload_lora_adapter", lora, 404},
		{"default completions", nil, "POST", "/v1/completions", plainBody, 200},
		{"default chat", nil, "POST", "/v1/chat/completions", chatBody, 200},
		{"default embeddings", nil, "POST", "/v1/embeddings", `{"model":"m","input":"hi"}`, 200},
		{"default models", nil, "GET", "/v1/models", "", 200},
		{"default GET completions", nil, "GET", "/v1/completions", "", 404},
		{"default DELETE models", nil, "DELETE", "/v1/models", "", 404},
		{"default trailing slash", nil, "POST", "/v1/completions/", plainBody, 404},
		{"list: chat refused", []string{"POST /v1/completions"}, "POST", "/v1/chat/completions", chatBody, 404},
		{"list: models refused", []string{"POST /v1/completions"}, "GET", "/v1/models", "", 404},
		{"list: completions", []string{"POST /v1/completions"}, "POST", "/v1/completions", plainBody, 200},
		{"prefix", []string{"* /v1/load_lora_adapter/*", "POST /v1/*"}, "POST", "/v1/load_lora_adapter", lora, 200},
		{"all", []string{"*"}, "POST", "/v1/load_lora_adapter", lora, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(rep)
			if tc.allowed != nil {
				cfg.AllowedPaths = tc.allowed
			}
			_, srv := startProxy(t, cfg)
			before := admin.Load()
			status, body := do(srv.URL, tc.method, tc.path, tc.body)
			if status != tc.want {
				t.Fatalf("%s %s: %d, want %d: %s", tc.method, tc.path, status, tc.want, body)
			}
			if tc.want == 404 {
				if e := openAIError(t, body); e.Type != "not_found_error" || !strings.Contains(e.Message, "allowed_paths") {
					t.Errorf("error %+v", e)
				}
				if admin.Load() != before {
					t.Errorf("the refused request reached the replica")
				}
				if got := metric(t, srv.URL, `prefixlb_refused_total{reason="path_not_allowed"}`); got != 1 {
					t.Errorf("refused path_not_allowed = %v, want 1", got)
				}
			}
		})
	}
}

func TestParseAllowRule(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want allowRule
		err  bool
	}{
		{in: "POST /v1/completions", want: allowRule{method: "POST", path: "/v1/completions"}},
		{in: "  GET   /v1/models ", want: allowRule{method: "GET", path: "/v1/models"}},
		{in: "* /v1/x", want: allowRule{path: "/v1/x"}},
		{in: "POST /v1/*", want: allowRule{method: "POST", path: "/v1/", prefix: true}},
		{in: "POST /v1/a/*", want: allowRule{method: "POST", path: "/v1/a/", prefix: true}},
		{in: "*", err: true}, // handled by newAllowlist, not a rule
		{in: "", err: true},
		{in: "POST", err: true},
		{in: "POST /v1/completions extra", err: true},
		{in: "POST /health", err: true},
		{in: "POST /v1", err: true},
		{in: "PO(ST /v1/x", err: true},
		{in: "POST /v1/../admin", err: true},
		{in: "POST /v1//x", err: true},
		{in: "POST /v1/*/x", err: true},
		{in: "POST /v1/x*", err: true},
	} {
		got, err := parseAllowRule(tc.in)
		if (err != nil) != tc.err || (err == nil && got != tc.want) {
			t.Errorf("parseAllowRule(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.err)
		}
	}
	a, err := newAllowlist([]string{"POST /v1/a/*", "GET /v1/models"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		method, path string
		want         bool
	}{
		{"POST", "/v1/a/b", true}, {"POST", "/v1/a/b/c", true}, {"POST", "/v1/a", false}, {"POST", "/v1/ab", false},
		{"GET", "/v1/a/b", false}, {"GET", "/v1/models", true}, {"HEAD", "/v1/models", true}, {"get", "/v1/models", false},
		{"POST", "/v1/models", false},
	} {
		if got := a.allows(tc.method, tc.path); got != tc.want {
			t.Errorf("allows(%s %s) = %v, want %v", tc.method, tc.path, got, tc.want)
		}
	}
}

// FuzzParseAllowRule: an entry is parsed without panicking; one accepted
// is a /v1 path without dot or empty segments, and allows the requests it
// names.
func FuzzParseAllowRule(f *testing.F) {
	for _, s := range []string{"POST /v1/completions", "* /v1/*", "GET /v1/models", "POST /v1/../x", "POST  /v1/a/*",
		"\tPOST\t/v1/x\n", "POST /v1/%2e%2e/x", "POST /v1/a/*/*", "", "*", "ü /v1/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := parseAllowRule(s)
		if err != nil {
			return
		}
		if !strings.HasPrefix(r.path, "/v1/") || hasDotSegment(r.path) || strings.Contains(r.path, "//") || strings.Contains(r.path, "*") {
			t.Fatalf("%q accepted as %+v", s, r)
		}
		a := allowlist{rules: []allowRule{r}}
		method := r.method
		if method == "" {
			method = "PATCH"
		}
		path := r.path
		if r.prefix {
			path += "x"
		}
		if !a.allows(method, path) {
			t.Fatalf("%q (%+v) does not allow %s %s", s, r, method, path)
		}
	})
}

// TestBreakerEjectsFailingReplica: a replica that answers 503 to every
// request while its /health is 200 is ejected by the circuit
// breaker after breaker_failures of its last breaker_window requests; no
// client request fails meanwhile (retries absorb them) and none goes to it
// while it is out; healed, it is re-admitted after breaker_ejection_time
// and its health checks, and serves again.
func TestBreakerEjectsFailingReplica(t *testing.T) {
	bad, good := newFakeReplica(t, "bad"), newFakeReplica(t, "good")
	bad.mode.Store(modeStatus)
	cfg := testConfig(bad, good)
	cfg.Policy = "round-robin"
	cfg.HealthInterval = 10 * time.Millisecond
	cfg.ReadmitAfter = 2
	cfg.BreakerFailures, cfg.BreakerWindow, cfg.BreakerEjectionTime = 3, 5, time.Second
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 64)
	p.hookState = func(name string, up bool) { events <- fmt.Sprintf("%s:%v", name, up) }
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(func() { srv.Close(); p.Close() })
	runLoops(t, p)

	send := func() string {
		t.Helper()
		resp := post(t, srv.URL, "/v1/completions", plainBody)
		if body := readAll(t, resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("a client request failed: %d %s", resp.StatusCode, body)
		}
		return resp.Header.Get(HeaderReplica)
	}
	ejected := false
	for i := 0; i < 40 && !ejected; i++ {
		send()
		select {
		case e := <-events:
			if e != "bad:false" {
				t.Fatalf("replica state %s, want bad:false", e)
			}
			ejected = true
		default:
		}
	}
	if !ejected {
		t.Fatalf("the failing replica was not ejected after 40 requests (it served %d)", bad.served.Load())
	}
	if n := bad.served.Load(); n != 3 {
		t.Errorf("the failing replica got %d requests before its ejection, want 3 (breaker_failures)", n)
	}
	if got := metric(t, srv.URL, `prefixlb_replica_ejections_total{reason="breaker",replica="bad"}`); got != 1 {
		t.Errorf("breaker ejections = %v, want 1", got)
	}
	// Out: no request goes to it (the ejection lasts 1 s; these few
	// requests take far less, unless the machine stalls, which the
	// re-admission event would show).
	served := bad.served.Load()
	for range 4 {
		send()
	}
	if got := bad.served.Load(); got != served && len(events) == 0 {
		t.Errorf("the ejected replica got %d requests", got-served)
	}
	bad.mode.Store(modeOK) // healed: back once its time is up and its checks pass
	select {
	case e := <-events:
		if e != "bad:true" {
			t.Fatalf("replica state %s, want bad:true", e)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the healed replica was not re-admitted")
	}
	for i := 0; ; i++ {
		if send() == "bad" {
			break
		}
		if i == 10 {
			t.Fatal("the re-admitted replica serves nothing")
		}
	}
}

// TestBreakerSparesLastReplica: with every replica failing, the breaker
// takes out at most half of them: one of two, none of one.
func TestBreakerSparesLastReplica(t *testing.T) {
	for _, n := range []int{1, 2} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			var reps []*fakeReplica
			for i := range n {
				r := newFakeReplica(t, fmt.Sprint("r", i))
				r.mode.Store(modeStatus)
				reps = append(reps, r)
			}
			cfg := testConfig(reps...)
			cfg.BreakerFailures, cfg.BreakerWindow = 2, 2
			p, srv := startProxy(t, cfg)
			for range 12 {
				resp := post(t, srv.URL, "/v1/completions", plainBody)
				if readAll(t, resp); resp.StatusCode != http.StatusServiceUnavailable {
					t.Fatalf("status %d, want the replayed 503", resp.StatusCode)
				}
			}
			up := 0
			for _, r := range p.Replicas() {
				if r.Up {
					up++
				}
			}
			if want := (n + 1) / 2; up != want {
				t.Errorf("%d of %d failing replicas up, want %d", up, n, want)
			}
		})
	}
}

func TestBreakerEjectionTimes(t *testing.T) {
	base := 30 * time.Second
	br := newBreaker(3, 5, base)
	for i, tc := range []struct {
		failed bool
		trip   bool
	}{{true, false}, {false, false}, {true, false}, {false, false}, {true, true}} {
		if got := br.record(tc.failed); got != tc.trip {
			t.Fatalf("verdict %d: trip %v, want %v", i, got, tc.trip)
		}
	}
	// The window slides: the oldest failure leaves as a sixth verdict comes.
	br.reset()
	for _, f := range []bool{true, true, false, false, false} {
		br.record(f)
	}
	if br.record(true) {
		t.Errorf("2 failures in the last 5 tripped a threshold of 3")
	}
	now := time.Unix(1000, 0)
	var got []time.Duration
	for range 12 {
		got = append(got, br.eject(now))
		if !br.ejected() || br.due(now.Add(got[len(got)-1]-time.Nanosecond)) || !br.due(now.Add(got[len(got)-1])) {
			t.Fatalf("ejected %v at %v: ejected %v", got[len(got)-1], now, br.ejected())
		}
		br.readmit(now)
	}
	for i, d := range got {
		if want := base * time.Duration(min(i+1, breakerMaxEjectionFactor)); d != want {
			t.Errorf("ejection %d: %v, want %v", i+1, d, want)
		}
	}
	// Three base times admitted forgive three ejections.
	if d := br.eject(now.Add(3 * base)); d != base*time.Duration(breakerMaxEjectionFactor-2) {
		t.Errorf("after 3 base times admitted: %v, want %v", d, base*time.Duration(breakerMaxEjectionFactor-2))
	}
	if newBreaker(0, 10, base) != nil {
		t.Errorf("breaker_failures 0 built a breaker")
	}
}

// largeReplica answers every request with size bytes of JSON, whole
// (declared) or cut after cut bytes (chunked, then the connection closed).
func largeReplica(t *testing.T, size, cut int) (*httptest.Server, []byte) {
	head, tail := `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"`, `","finish_reason":"length"}]}`
	body := make([]byte, 0, size)
	body = append(body, head...)
	for i := 0; len(body) < size-len(tail); i++ {
		body = append(body, "abcdefghijklmnopqrstuvwxyz"[i%26])
	}
	body = append(body, tail...)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		if cut == 0 {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			_, _ = w.Write(body)
			return
		}
		_, _ = w.Write(body[:cut])
		w.(http.Flusher).Flush()
		hijackClose(w)
	}))
	t.Cleanup(srv.Close)
	return srv, body
}

// TestLargeResponseStreamedThrough: a non-streamed answer over
// max_response_bytes (1 MiB) passes through as it arrives, byte for byte,
// with its Content-Length, and the proxy allocates about its head, not the
// whole answer (48 MiB); one cut short ends the client's response with an
// error, never as a short body that looks whole.
func TestLargeResponseStreamedThrough(t *testing.T) {
	const size = 48 << 20
	rep, want := largeReplica(t, size, 0)
	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: rep.URL}}
	_, srv := startProxy(t, cfg)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	resp := post(t, srv.URL, "/v1/completions", plainBody)
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	resp.Body.Close()
	runtime.ReadMemStats(&after)
	if err != nil || resp.StatusCode != http.StatusOK || n != size {
		t.Fatalf("status %d, %d bytes, err %v", resp.StatusCode, n, err)
	}
	if got, w := h.Sum(nil), sha256.Sum256(want); !bytes.Equal(got, w[:]) {
		t.Errorf("the body passed through differs from the replica's")
	}
	if resp.ContentLength != size {
		t.Errorf("Content-Length %d, want the replica's %d", resp.ContentLength, size)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 16<<20 {
		t.Errorf("the process allocated %d MiB to pass a %d MiB answer through; want under 16 MiB", alloc>>20, size>>20)
	}

	cutRep, full := largeReplica(t, 4<<20, 3<<20)
	cfg.Backends = []Backend{{Name: "r0", URL: cutRep.URL}}
	_, srv = startProxy(t, cfg)
	resp = post(t, srv.URL, "/v1/completions", plainBody)
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Errorf("a cut answer read as whole (%d of %d bytes)", len(got), len(full))
	}
	if !bytes.Equal(got, full[:len(got)]) {
		t.Errorf("the cut answer's bytes differ from the replica's")
	}
}

// TestWarnOpenAdmin: serve warns when it listens beyond loopback with no
// admin token, and only then.
func TestWarnOpenAdmin(t *testing.T) {
	for _, tc := range []struct {
		addr  net.Addr
		token string
		warn  bool
	}{
		{&net.TCPAddr{IP: net.IPv4zero, Port: 8080}, "", true},
		{&net.TCPAddr{IP: net.IPv6unspecified, Port: 8080}, "", true},
		{&net.TCPAddr{IP: net.ParseIP("10.0.0.5"), Port: 8080}, "", true},
		{&net.TCPAddr{IP: net.IPv4zero, Port: 8080}, "s3cret", false},
		{&net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 8080}, "", false},
		{&net.TCPAddr{IP: net.IPv6loopback, Port: 8080}, "", false},
	} {
		var logs bytes.Buffer
		p := &Proxy{cfg: Config{FrontDoor: FrontDoor{}}, log: slog.New(slog.NewTextHandler(&logs, nil))}
		p.cfg.AdminToken = tc.token
		p.warnOpenAdmin(tc.addr)
		if got := strings.Contains(logs.String(), "level=WARN") && strings.Contains(logs.String(), "/debug/*"); got != tc.warn {
			t.Errorf("%v token %q: warned %v, want %v: %s", tc.addr, tc.token, got, tc.warn, logs.String())
		}
	}
}

// TestFrontDoorConfig: the YAML keys, the defaults and the validation of the
// front door's settings.
func TestFrontDoorConfig(t *testing.T) {
	d := DefaultConfig()
	if d.MaxInflightBodyBytes != 128<<20 || d.ClientWriteTimeout != 30*time.Second || d.BreakerFailures != 5 ||
		d.BreakerWindow != 10 || d.BreakerEjectionTime != 30*time.Second || d.MaxResponseBytes != 1<<20 ||
		strings.Join(d.AllowedPaths, ",") != strings.Join(DefaultAllowedPaths(), ",") {
		t.Errorf("defaults %+v", d.FrontDoor)
	}
	c, err := ParseConfig([]byte("max_inflight_body_bytes: 0\nclient_write_timeout: 5s\nallowed_paths: ['POST /v1/completions', '*']\nbreaker_failures: 2\nbreaker_window: 4\nbreaker_ejection_time: 1m\n"), d)
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxInflightBodyBytes != 0 || c.ClientWriteTimeout != 5*time.Second || len(c.AllowedPaths) != 2 ||
		c.BreakerFailures != 2 || c.BreakerWindow != 4 || c.BreakerEjectionTime != time.Minute {
		t.Errorf("parsed %+v", c.FrontDoor)
	}
	for _, tc := range []struct {
		mutate func(*Config)
		field  string
	}{
		{func(c *Config) { c.MaxInflightBodyBytes = -1 }, "max_inflight_body_bytes"},
		{func(c *Config) { c.MaxInflightBodyBytes = c.MaxBodyBytes - 1 }, "max_inflight_body_bytes"},
		{func(c *Config) { c.ClientWriteTimeout = -time.Second }, "client_write_timeout"},
		{func(c *Config) { c.BreakerFailures = -1 }, "breaker_failures"},
		{func(c *Config) { c.BreakerWindow = 4 }, "breaker_window"},
		{func(c *Config) { c.BreakerWindow = maxBreakerWindow + 1 }, "breaker_window"},
		{func(c *Config) { c.BreakerEjectionTime = 0 }, "breaker_ejection_time"},
		{func(c *Config) { c.AllowedPaths = nil }, "allowed_paths"},
		{func(c *Config) { c.AllowedPaths = []string{"POST /v1/x", "DELETE /admin"} }, "allowed_paths[1]"},
	} {
		c := testConfig(newFakeReplica(t, "r0"))
		tc.mutate(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("want an error naming %s, got %v", tc.field, err)
		}
	}
	c = testConfig(newFakeReplica(t, "r0"))
	c.BreakerFailures, c.BreakerWindow, c.BreakerEjectionTime = 0, 0, 0 // off: the others unchecked
	c.MaxInflightBodyBytes = 0
	if err := c.Validate(); err != nil {
		t.Errorf("breaker off, no body bound: %v", err)
	}
}
