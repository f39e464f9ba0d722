package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// serveLoopback runs p.Serve for cfg on a loopback listener (so the
// http.Server limits apply) until the test ends, and returns its address.
func serveLoopback(t *testing.T, cfg Config) (*Proxy, string) {
	t.Helper()
	if cfg.DrainTimeout > time.Second {
		cfg.DrainTimeout = time.Second
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		<-done
		p.Close()
	})
	return p, ln.Addr().String()
}

// rawExchange writes raw to a new connection to addr and reads one response.
func rawExchange(t *testing.T, addr, raw string) (*http.Response, string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("response to %q: %v", raw, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// apiError is an OpenAI error object as a client reads it.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// openAIError decodes an OpenAI error body.
func openAIError(t *testing.T, body string) apiError {
	t.Helper()
	var e struct {
		Error apiError `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("error body %q is not JSON: %v", body, err)
	}
	return e.Error
}

func TestLimitBodyBytes(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.MaxBodyBytes = 1024
	_, addr := serveLoopback(t, cfg)
	big := `{"model":"m","prompt":"` + strings.Repeat("x", 2000) + `"}`
	for _, tc := range []struct{ name, raw string }{
		{"content-length", fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(big), big)},
		{"chunked", fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(big), big)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := rawExchange(t, addr, tc.raw)
			if resp.StatusCode != http.StatusRequestEntityTooLarge {
				t.Fatalf("status %d, want 413: %s", resp.StatusCode, body)
			}
			if e := openAIError(t, body); e.Type != "invalid_request_error" || e.Code != 413 {
				t.Errorf("error %+v", e)
			}
		})
	}
	if n := rep.served.Load(); n != 0 {
		t.Errorf("oversized bodies reached the replica %d times", n)
	}
}

func TestLimitPromptTokens(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.MaxPromptTokens = 100
	_, addr := serveLoopback(t, cfg)
	ids := func(n int) string {
		s := make([]string, n)
		for i := range s {
			s[i] = fmt.Sprint(i + 1)
		}
		return "[" + strings.Join(s, ",") + "]"
	}
	for _, tc := range []struct {
		name, path, body string
		status           int
	}{
		{"ids at the limit", "/v1/completions", `{"model":"m","max_tokens":2,"prompt":` + ids(100) + `}`, 200},
		{"ids over", "/v1/completions", `{"model":"m","prompt":` + ids(101) + `}`, 400},
		{"batch over", "/v1/completions", `{"model":"m","prompt":[` + ids(60) + `,` + ids(60) + `]}`, 400},
		{"text over (estimated)", "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("word ", 100) + `"}`, 400},
		{"chat over (estimated)", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", 100) + `"}]}`, 400},
		{"other path over", "/v1/embeddings", `{"model":"m","input":` + ids(101) + `}`, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := rep.served.Load()
			resp := post(t, "http://"+addr, tc.path, tc.body)
			body := string(readAll(t, resp))
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if tc.status == 200 {
				return
			}
			if e := openAIError(t, body); e.Type != "invalid_request_error" || !strings.Contains(e.Message, "max_prompt_tokens") {
				t.Errorf("error %+v", e)
			}
			if n := rep.served.Load() - before; n != 0 {
				t.Errorf("a prompt over the limit reached the replica")
			}
		})
	}
}

func TestLimitHeaderBytes(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.MaxHeaderBytes = 4096
	_, addr := serveLoopback(t, cfg)
	// net/http allows 4096 bytes of slack over MaxHeaderBytes.
	resp, body := rawExchange(t, addr, "GET /health HTTP/1.1\r\nHost: r\r\nX-Big: "+strings.Repeat("a", 16<<10)+"\r\n\r\n")
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("status %d, want 431: %s", resp.StatusCode, body)
	}
	resp, body = rawExchange(t, addr, "GET /health HTTP/1.1\r\nHost: r\r\nX-Small: "+strings.Repeat("a", 1<<10)+"\r\n\r\n")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d under the limit: %s", resp.StatusCode, body)
	}
}

// blockingReplica answers completions at once, except prompts containing
// "hold", which wait for release (or the request's end).
type blockingReplica struct {
	srv     *httptest.Server
	arrived chan struct{} // one send per held request
	release chan struct{}
	once    sync.Once
	served  atomic.Int64
}

// open releases the held requests (and any later ones).
func (b *blockingReplica) open() { b.once.Do(func() { close(b.release) }) }

func newBlockingReplica(t *testing.T) *blockingReplica {
	b := &blockingReplica{arrived: make(chan struct{}, 64), release: make(chan struct{})}
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), "hold") {
			b.arrived <- struct{}{}
			select {
			case <-b.release:
			case <-r.Context().Done():
				return
			}
		}
		b.served.Add(1)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	}))
	t.Cleanup(b.srv.Close)
	t.Cleanup(b.open) // runs before Close
	return b
}

func TestLimitConcurrent(t *testing.T) {
	rep := newBlockingReplica(t)
	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: rep.srv.URL}}
	cfg.MaxConcurrent = 3
	_, addr := serveLoopback(t, cfg)
	url := "http://" + addr

	// Two held requests: the third slot is still free.
	results := make(chan int, 3)
	hold := func() {
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hold me"}`))
		if err != nil {
			results <- -1
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		results <- resp.StatusCode
	}
	for range 2 {
		go hold()
		<-rep.arrived
	}
	resp := post(t, url, "/v1/completions", `{"model":"m","prompt":"quick"}`)
	if body := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("request under the cap: %d %s", resp.StatusCode, body)
	}

	// A third held request fills the cap: the next is refused at once.
	go hold()
	<-rep.arrived
	for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/v1/embeddings"} {
		resp = post(t, url, path, `{"model":"m","prompt":"quick"}`)
		body := string(readAll(t, resp))
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("%s over the cap: %d %s", path, resp.StatusCode, body)
		}
		if resp.Header.Get("Retry-After") == "" {
			t.Errorf("429 without Retry-After")
		}
		if e := openAIError(t, body); e.Type != "rate_limit_error" || e.Code != 429 || !strings.Contains(e.Message, "max_concurrent") {
			t.Errorf("error %+v", e)
		}
	}
	// Endpoints other than inference are not counted.
	if resp := mustGet(t, url+"/health"); resp.StatusCode != 200 {
		t.Errorf("health under a full cap: %d", resp.StatusCode)
	}

	rep.open()
	for range 3 {
		if code := <-results; code != 200 {
			t.Errorf("held request ended %d", code)
		}
	}
	resp = post(t, url, "/v1/completions", `{"model":"m","prompt":"quick"}`)
	if body := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("after the held requests ended: %d %s", resp.StatusCode, body)
	}
	if n := rep.served.Load(); n != 5 {
		t.Errorf("replica served %d requests, want 5 (3 held, 2 quick)", n)
	}
}

// TestSlowloris: clients that send their headers a byte at a time, or their
// headers and part of a body and then stall, neither delay a normal request
// (served while they are all still connected) nor keep their connections
// past the read timeouts.
func TestSlowloris(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	const timeout = 1500 * time.Millisecond
	cfg.ReadHeaderTimeout = timeout
	cfg.BodyReadTimeout = timeout
	_, addr := serveLoopback(t, cfg)

	const n = 16
	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer func() {
		close(stop)
		wg.Wait()
	}()
	type slow struct {
		conn  net.Conn
		body  bool // stalls in the body (else in the headers)
		start time.Time
	}
	var slows []slow
	for i := range n {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		s := slow{conn: conn, body: i%2 == 1, start: time.Now()}
		slows = append(slows, s)
		if s.body {
			// Complete headers, 10 of 1000 body bytes, then nothing.
			fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 1000\r\n\r\n{\"model\":")
			continue
		}
		wg.Add(1)
		go func() { // the slowloris: a header byte every 20ms, never done
			defer wg.Done()
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			line := []byte("POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: " + strings.Repeat("z", 4096))
			for _, c := range line {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				if _, err := conn.Write([]byte{c}); err != nil {
					return // closed by the server
				}
			}
		}()
	}

	t0 := time.Now()
	resp := post(t, "http://"+addr, "/v1/completions", streamBody)
	body := readAll(t, resp)
	if resp.StatusCode != 200 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("normal request among slow clients: %d %s", resp.StatusCode, body)
	}
	took := time.Since(t0)
	for i, s := range slows { // all still connected: the request did not wait for them
		_ = s.conn.SetReadDeadline(time.Now().Add(time.Millisecond))
		var b [1]byte
		if _, err := s.conn.Read(b[:]); !isTimeout(err) {
			t.Fatalf("slow client %d gone (%v) by the time the normal request was served, after %v", i, err, took)
		}
	}

	for i, s := range slows {
		_ = s.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, err := io.ReadAll(s.conn) // until the server closes (or resets) it
		held := time.Since(s.start)
		if isTimeout(err) {
			t.Fatalf("slow client %d: not closed by the server: %v (got %q after %v)", i, err, got, held)
		}
		if held < timeout-100*time.Millisecond {
			t.Errorf("slow client %d closed after %v, before its timeout", i, held)
		}
		if s.body && !strings.HasPrefix(string(got), "HTTP/1.1 408") {
			t.Errorf("slow body %d answered %q, want 408", i, got)
		}
	}
	if n := rep.served.Load(); n != 1 {
		t.Errorf("replica served %d requests, want 1", n)
	}
}

// isTimeout reports whether err is a network timeout.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestBodyTimeoutSparesStreams: the body deadline is lifted once the body
// is read, so a stream that lasts longer than BodyReadTimeout completes, and
// its connection serves the next request.
func TestBodyTimeoutSparesStreams(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	rep.mode.Store(modeHold)
	cfg := testConfig(rep)
	cfg.BodyReadTimeout = 100 * time.Millisecond
	_, addr := serveLoopback(t, cfg)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	send := func() *http.Response {
		req, _ := http.NewRequest("POST", "http://"+addr+"/v1/completions", strings.NewReader(streamBody))
		if err := req.Write(conn); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	resp := send()
	held, release, _ := rep.holdChans()
	<-held
	// The duration under test: five body timeouts with the stream open.
	<-time.After(5 * cfg.BodyReadTimeout)
	close(release)
	if body := readAll(t, resp); !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("stream longer than the body timeout ended %q", body)
	}
	rep.mode.Store(modeOK)
	resp = send()
	if body := readAll(t, resp); resp.StatusCode != 200 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("next request on the connection: %d %q", resp.StatusCode, body)
	}
}

func TestClientIdleTimeout(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.ClientIdleTimeout = 200 * time.Millisecond
	_, addr := serveLoopback(t, cfg)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	io.WriteString(conn, "GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp.Close {
		t.Fatal("server did not keep the connection alive")
	}
	idle := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("idle connection: read %v, want EOF (closed by the server)", err)
	}
	if d := time.Since(idle); d < 150*time.Millisecond {
		t.Errorf("idle connection closed after %v, before the idle timeout", d)
	}
}

func TestAdminTokenRejected(t *testing.T) {
	rep := newFakeReplica(t, "r0")
	cfg := testConfig(rep)
	cfg.AdminToken = "s3cret-token"
	_, addr := serveLoopback(t, cfg)
	for _, ep := range []struct{ method, path, body string }{
		{"POST", "/debug/route", chatBody},
		{"GET", "/debug/replicas", ""},
		{"GET", "/debug/cache", ""},
		{"GET", "/ui/state.json", ""},
	} {
		for _, tc := range []struct {
			name, auth string
			status     int
		}{
			{"missing", "", 401},
			{"not bearer", "Basic czNjcmV0LXRva2Vu", 401},
			{"wrong, same length", "Bearer s3cret-tokeN", 401},
			{"wrong, shorter", "Bearer s3cret", 401},
			{"wrong, longer", "Bearer s3cret-token-and-more", 401},
			{"prefix of the header only", "Bearer ", 401},
			{"right", "Bearer s3cret-token", 200},
		} {
			req, _ := http.NewRequest(ep.method, "http://"+addr+ep.path, strings.NewReader(ep.body))
			if tc.auth != "" {
				req.Header.Set("Authorization", tc.auth)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body := string(readAll(t, resp))
			if resp.StatusCode != tc.status {
				t.Errorf("%s %s, token %s: %d, want %d: %s", ep.method, ep.path, tc.name, resp.StatusCode, tc.status, body)
				continue
			}
			if tc.status == 401 {
				if e := openAIError(t, body); e.Type != "authentication_error" || resp.Header.Get("WWW-Authenticate") == "" {
					t.Errorf("%s %s, token %s: %+v", ep.method, ep.path, tc.name, e)
				}
			}
		}
	}
}

// TestTokenMatches checks the comparison the admin check uses: equal-length
// digests through crypto/subtle, so neither the configured token's content
// nor its length shows in the time a wrong guess takes (which a test cannot
// measure reliably; the code path is what is checked).
func TestTokenMatches(t *testing.T) {
	want := digestToken("s3cret-token")
	for _, tc := range []struct {
		got  string
		want bool
	}{
		{"s3cret-token", true},
		{"s3cret-tokeN", false},
		{"s3cret", false},
		{"s3cret-token ", false},
		{"", false},
		{strings.Repeat("s3cret-token", 100), false},
	} {
		if got := tokenMatches(tc.got, want); got != tc.want {
			t.Errorf("tokenMatches(%q) = %v, want %v", tc.got, got, tc.want)
		}
	}
	if d := digestToken("x"); len(d) != len(want) {
		t.Errorf("digests of different lengths: %d, %d", len(d), len(want))
	}
}

// countingReplica records every request it gets: the Host it was sent to
// and the path.
type countingReplica struct {
	srv  *httptest.Server
	mu   sync.Mutex // guards reqs
	reqs []string   // "HOST METHOD PATH"
}

func newCountingReplica(t *testing.T) *countingReplica {
	c := &countingReplica{}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		c.reqs = append(c.reqs, r.Host+" "+r.Method+" "+r.URL.EscapedPath())
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/models":
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
		default:
			io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
		}
	}))
	t.Cleanup(c.srv.Close)
	return c
}

func (c *countingReplica) requests() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.reqs...)
}

// TestNoUpstreamFromRequest: whatever a request says — an absolute URI in
// its request line, its Host header, routing headers of other gateways or of
// prefixlb's own responses, dot segments or encoded slashes in its path — it
// reaches only configured backends, which see their own host.
func TestNoUpstreamFromRequest(t *testing.T) {
	a, b := newCountingReplica(t), newCountingReplica(t)
	evil := newCountingReplica(t)
	evilHost := strings.TrimPrefix(evil.srv.URL, "http://")
	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "a", URL: a.srv.URL}, {Name: "b", URL: b.srv.URL}}
	// Every /v1 path forwarded, as before allowed_paths: what is tested
	// here is where a forwarded request goes (TestAllowedPaths tests what
	// the default refuses).
	cfg.AllowedPaths = []string{"*"}
	_, addr := serveLoopback(t, cfg)

	body := `{"model":"m","prompt":"hello there"}`
	post := func(target, extra string) string {
		return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s",
			target, evilHost, len(body), extra, body)
	}
	get := func(target, extra string) string {
		return fmt.Sprintf("GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", target, evilHost, extra)
	}
	for _, tc := range []struct {
		raw    string
		status int // 0: any but 5xx
	}{
		{get("http://"+evilHost+"/v1/models", ""), 200},
		{post("http://"+evilHost+"/v1/completions", ""), 200},
		{post("/v1/completions", ""), 200},
		{post("/v1/completions", "x-gateway-destination-endpoint: "+evilHost+"\r\n"), 200},
		{post("/v1/completions", "x-prefixlb-replica: evil\r\nx-prefixlb-route: replica="+evilHost+"\r\n"), 200},
		{post("/v1/completions", "Forwarded: host="+evilHost+"\r\nX-Forwarded-Host: "+evilHost+"\r\n"), 200},
		{post("/v1/chat/completions", "X-Original-URL: http://"+evilHost+"/\r\nX-Rewrite-URL: http://"+evilHost+"/\r\n"), 400}, // no messages
		{get("/v1/../v1/models", ""), http.StatusTemporaryRedirect},
		{get("/v1/%2e%2e/%2e%2e/v1/models", ""), 400},
		{get("/v1/..%2F..%2Fv1%2Fmodels", ""), 400},
		{get("/v1/./models", ""), 0},
		{get("//"+evilHost+"/v1/models", ""), 0},
		{get("/v1/models?url=http://"+evilHost+"/", ""), 200},
		{get("/v1/files/http:%2F%2F"+evilHost+"%2Fv1", ""), 200},
		{"CONNECT " + evilHost + " HTTP/1.1\r\nHost: " + evilHost + "\r\n\r\n", 0},
		{"OPTIONS * HTTP/1.1\r\nHost: " + evilHost + "\r\n\r\n", 0},
	} {
		resp, rbody := rawExchange(t, addr, tc.raw)
		line := strings.SplitN(tc.raw, "\r\n", 2)[0]
		if resp.StatusCode >= 500 || (tc.status != 0 && resp.StatusCode != tc.status) {
			t.Errorf("%q: %d, want %d: %s", line, resp.StatusCode, tc.status, rbody)
		}
	}
	if got := evil.requests(); len(got) != 0 {
		t.Fatalf("the unconfigured server got requests: %q", got)
	}
	total := 0
	for _, r := range []*countingReplica{a, b} {
		host := strings.TrimPrefix(r.srv.URL, "http://")
		for _, req := range r.requests() {
			total++
			if !strings.HasPrefix(req, host+" ") {
				t.Errorf("backend %s got a request for another host: %q", host, req)
			}
			if strings.Contains(req, "/../") || strings.Contains(req, "/./") {
				t.Errorf("backend %s got a path with dot segments: %q", host, req)
			}
		}
	}
	if total < 8 {
		t.Errorf("backends got %d requests; the requests above should mostly reach them", total)
	}
}

func TestLimitsConfig(t *testing.T) {
	d := DefaultConfig()
	if d.MaxPromptTokens != 1<<20 || d.MaxHeaderBytes != 64<<10 || d.MaxConcurrent != 4096 ||
		d.BodyReadTimeout != 30*time.Second || d.ClientIdleTimeout != 2*time.Minute {
		t.Errorf("defaults %+v", d)
	}
	c, err := ParseConfig([]byte("max_prompt_tokens: 10\nmax_header_bytes: 2048\nmax_concurrent: 0\nbody_read_timeout: 1s\nclient_idle_timeout: 3s\n"), d)
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxPromptTokens != 10 || c.MaxHeaderBytes != 2048 || c.MaxConcurrent != 0 || c.BodyReadTimeout != time.Second || c.ClientIdleTimeout != 3*time.Second {
		t.Errorf("parsed %+v", c)
	}
	for _, tc := range []struct {
		set   func(*Config)
		field string
	}{
		{func(c *Config) { c.MaxPromptTokens = 0 }, "max_prompt_tokens"},
		{func(c *Config) { c.MaxHeaderBytes = -1 }, "max_header_bytes"},
		{func(c *Config) { c.MaxConcurrent = -1 }, "max_concurrent"},
		{func(c *Config) { c.BodyReadTimeout = -time.Second }, "body_read_timeout"},
		{func(c *Config) { c.ClientIdleTimeout = -time.Second }, "client_idle_timeout"},
	} {
		c := DefaultConfig()
		c.Backends = []Backend{{URL: "http://127.0.0.1:1"}}
		tc.set(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: Validate = %v", tc.field, err)
		}
	}
}
