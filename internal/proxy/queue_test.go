package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
)

// gatedReplica is an engine that answers each completion only when the
// test releases it, and records the prompts in the order they arrived.
type gatedReplica struct {
	srv     *httptest.Server
	release chan struct{}
	mu      sync.Mutex // guards order
	order   []string
	arrived chan string
}

func newGatedReplica(t *testing.T) *gatedReplica {
	g := &gatedReplica{release: make(chan struct{}, 64), arrived: make(chan string, 64)}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		var b struct{ Prompt string }
		_ = json.NewDecoder(r.Body).Decode(&b)
		g.mu.Lock()
		g.order = append(g.order, b.Prompt)
		g.mu.Unlock()
		g.arrived <- b.Prompt
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`)
	})
	g.srv = httptest.NewServer(mux)
	t.Cleanup(g.srv.Close)
	return g
}

func (g *gatedReplica) served() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.order...)
}

// queueProxy is a proxy over one gated replica that is saturated with one
// request in flight.
func queueProxy(t *testing.T, mod func(*Config)) (*Proxy, *httptest.Server, *gatedReplica) {
	g := newGatedReplica(t)
	c := testConfig()
	c.Backends = []Backend{{Name: "g", URL: g.srv.URL, Kind: "vllm"}}
	c.Queue.Admission.MaxInFlight = 1
	// Engage at the first saturated arrival: these tests saturate the
	// pool and send the next request at once.
	c.Queue.Admission.EngageAfter = 0
	c.Queue.Interval = 5 * time.Millisecond
	// The tests' clients stand for a trusted gateway on loopback: their
	// class headers (priority, tenant, TTFT SLO) are believed.
	c.Tenants.TrustedProxies = []string{"127.0.0.0/8", "::1"}
	if mod != nil {
		mod(&c)
	}
	p, srv := startProxy(t, c)
	runLoops(t, p)
	return p, srv, g
}

type answer struct {
	status int
	header http.Header
	body   string
	err    error
}

// send posts a completion with prompt and headers, answering on the
// returned channel.
func send(ctx context.Context, url, prompt string, hdr map[string]string) <-chan answer {
	out := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/completions",
			strings.NewReader(fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt)))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			out <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out <- answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
	}()
	return out
}

// waitQueued waits until n requests wait in p's queue.
func waitQueued(t *testing.T, p *Proxy, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for p.gate.Len() != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue holds %d, want %d", p.gate.Len(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func queueStats(p *Proxy) admission.Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.gate.StateLocked().Stats
}

// checkAccounting checks that every request that reached the queue ended
// in exactly one outcome.
func checkAccounting(t *testing.T, p *Proxy) {
	t.Helper()
	st := queueStats(p)
	if got := st.Passed + st.Dispatched + st.ShedTotal() + st.Cancelled + int64(p.gate.Len()); got != st.Arrived {
		t.Errorf("accounting: %+v, %d waiting: %d of %d arrived", st, p.gate.Len(), got, st.Arrived)
	}
}

func TestQueuePassThrough(t *testing.T) {
	p, srv, g := queueProxy(t, func(c *Config) { c.Queue.Admission.MaxInFlight = 0 })
	ctx := context.Background()
	var answers []<-chan answer
	for i := 0; i < 4; i++ {
		answers = append(answers, send(ctx, srv.URL, fmt.Sprint("p", i), nil))
		<-g.arrived // below saturation each reaches the engine at once
	}
	for range answers {
		g.release <- struct{}{}
	}
	for _, a := range answers {
		if r := <-a; r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
	}
	if st := queueStats(p); st.Passed != 4 || st.Queued != 0 {
		t.Errorf("stats %+v, want 4 passed, none queued", st)
	}
	checkAccounting(t, p)
}

func TestQueuePriorityOrder(t *testing.T) {
	p, srv, g := queueProxy(t, nil)
	ctx := context.Background()
	first := send(ctx, srv.URL, "first", nil)
	<-g.arrived
	var answers []<-chan answer
	for i, prio := range []string{"0", "5", "10", "-1"} {
		answers = append(answers, send(ctx, srv.URL, "prio"+prio, map[string]string{"x-prefixlb-priority": prio}))
		waitQueued(t, p, i+1)
	}
	for i := 0; i < 5; i++ {
		g.release <- struct{}{}
		if i < 4 {
			<-g.arrived
		}
	}
	<-first
	for _, a := range answers {
		if r := <-a; r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
	}
	want := "[first prio10 prio5 prio0 prio-1]"
	if got := fmt.Sprint(g.served()); got != want {
		t.Errorf("served %s, want %s", got, want)
	}
	checkAccounting(t, p)
}

func TestQueueFairShare(t *testing.T) {
	p, srv, g := queueProxy(t, nil)
	ctx := context.Background()
	first := send(ctx, srv.URL, "first", nil)
	<-g.arrived
	var answers []<-chan answer
	n := 0
	for i := 0; i < 6; i++ {
		answers = append(answers, send(ctx, srv.URL, fmt.Sprint("heavy", i), map[string]string{"x-prefixlb-tenant": "heavy"}))
		n++
		waitQueued(t, p, n)
	}
	for i := 0; i < 2; i++ {
		// The light tenant is told by its API key.
		answers = append(answers, send(ctx, srv.URL, fmt.Sprint("light", i), map[string]string{"Authorization": "Bearer sk-light"}))
		n++
		waitQueued(t, p, n)
	}
	for i := 0; i <= n; i++ {
		g.release <- struct{}{}
		if i < n {
			<-g.arrived
		}
	}
	<-first
	for _, a := range answers {
		<-a
	}
	served := g.served()
	light := 0
	for _, s := range served[1:5] {
		if strings.HasPrefix(s, "light") {
			light++
		}
	}
	if light != 2 {
		t.Errorf("the light tenant got %d of the first 4 dispatched (%v), want 2", light, served)
	}
	checkAccounting(t, p)
}

func TestQueueShed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(*Config)
		hdr    map[string]string
		reason string
	}{
		{"timeout", func(c *Config) { c.Queue.Admission.Timeout = 50 * time.Millisecond }, nil, "timeout"},
		{"deadline", nil, map[string]string{"x-prefixlb-ttft-slo": "50ms"}, "deadline"},
		{"queue full", func(c *Config) { c.Queue.Admission.MaxQueue = 1 }, nil, "queue_full"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, srv, g := queueProxy(t, tc.mod)
			ctx := context.Background()
			first := send(ctx, srv.URL, "first", nil)
			<-g.arrived
			if tc.reason == "queue_full" {
				defer func(a <-chan answer) { <-a }(send(ctx, srv.URL, "waits", nil))
				waitQueued(t, p, 1)
			}
			r := <-send(ctx, srv.URL, "shed", tc.hdr)
			if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") == "" {
				t.Fatalf("status %d, Retry-After %q: %s", r.status, r.header.Get("Retry-After"), r.body)
			}
			var body struct {
				Error struct{ Message, Type string }
			}
			if err := json.Unmarshal([]byte(r.body), &body); err != nil || !strings.Contains(body.Error.Message, tc.reason) {
				t.Errorf("body %s, want an OpenAI error naming %s", r.body, tc.reason)
			}
			if st := queueStats(p); st.ShedTotal() != 1 {
				t.Errorf("stats %+v, want one shed", st)
			}
			metrics := get(t, srv.URL+"/metrics")
			if !strings.Contains(metrics, fmt.Sprintf(`prefixlb_queue_shed_total{reason=%q} 1`, tc.reason)) {
				t.Errorf("metrics lack the shed %s", tc.reason)
			}
			g.release <- struct{}{}
			if tc.reason == "queue_full" {
				<-g.arrived
				g.release <- struct{}{}
			}
			<-first
			checkAccounting(t, p)
		})
	}
}

func TestQueueDisconnect(t *testing.T) {
	p, srv, g := queueProxy(t, nil)
	first := send(context.Background(), srv.URL, "first", nil)
	<-g.arrived
	ctx, cancel := context.WithCancel(context.Background())
	gone := send(ctx, srv.URL, "gone", nil)
	waitQueued(t, p, 1)
	cancel()
	if r := <-gone; r.err == nil {
		t.Fatalf("the cancelled client got %d", r.status)
	}
	waitQueued(t, p, 0)
	if st := queueStats(p); st.Cancelled != 1 {
		t.Errorf("stats %+v, want one cancelled", st)
	}
	g.release <- struct{}{}
	<-first
	if got := fmt.Sprint(g.served()); got != "[first]" {
		t.Errorf("served %s: the cancelled request reached the engine", got)
	}
	checkAccounting(t, p)
	dbg := get(t, srv.URL+"/debug/queue")
	if !strings.Contains(dbg, `"Cancelled":1`) {
		t.Errorf("/debug/queue: %s", dbg)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
