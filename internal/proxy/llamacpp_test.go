package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"
	"github.com/prefixlb/prefixlb/internal/upstream/upstreamtest"

	"github.com/prefixlb/prefixlb/internal/tenancy"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// route is one canned answer of a fixture server.
type route struct {
	status int    // 0: 200
	body   string // JSON unless ctype says otherwise
	ctype  string
}

// vLLM's and SGLang's pages and model lists, for the engines that are not
// llama.cpp.
const (
	vllmMetrics   = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 2\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 1\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
	sglangMetrics = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank=\"0\"} 3\n# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank=\"0\"} 0\n# TYPE sglang:token_usage gauge\nsglang:token_usage{tp_rank=\"0\"} 0.5\n"
	vllmModels    = `{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"vllm","root":"m","parent":null}]}`
	sglangModels  = `{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"sglang","root":"m"}]}`
	plainModels   = `{"object":"list","data":[{"id":"m","object":"model"}]}`
	llamaNotFound = `{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}`
	llamaNoMetric = `{"error":{"code":501,"message":"This server does not support metrics endpoint. Start it with ` + "`--metrics`" + `","type":"not_supported_error"}}`
)

// fixtureServer is a fake replica answering GETs from routes (404 for the
// rest), with llama.cpp's Server header when llamaHeader is set. It counts
// the requests of each path.
type fixtureServer struct {
	srv         *httptest.Server
	routes      atomic.Pointer[map[string]route]
	llamaHeader atomic.Bool
	healthy     atomic.Bool
	mu          sync.Mutex // guards hits
	hits        map[string]int
}

func newFixtureServer(t testing.TB, routes map[string]route, llamaHeader bool) *fixtureServer {
	t.Helper()
	f := &fixtureServer{hits: map[string]int{}}
	f.set(routes, llamaHeader)
	f.healthy.Store(true)
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// set replaces the server's answers: another engine now runs there.
func (f *fixtureServer) set(routes map[string]route, llamaHeader bool) {
	f.routes.Store(&routes)
	f.llamaHeader.Store(llamaHeader)
}

func (f *fixtureServer) count(path string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hits[path]
}

func (f *fixtureServer) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.hits[r.URL.Path]++
	f.mu.Unlock()
	if f.llamaHeader.Load() {
		w.Header().Set("Server", "llama.cpp")
	}
	if r.URL.Path == "/health" {
		if !f.healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, `{"status":"ok"}`)
		return
	}
	rt, ok := (*f.routes.Load())[r.URL.Path]
	if !ok {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, llamaNotFound)
		return
	}
	ct := rt.ctype
	if ct == "" {
		ct = "application/json; charset=utf-8"
	}
	w.Header().Set("Content-Type", ct)
	if rt.status != 0 {
		w.WriteHeader(rt.status)
	}
	io.WriteString(w, rt.body)
}

// llamaRoutes are a llama-server's GET endpoints (run with --metrics
// --slots), from the captured fixtures.
func llamaRoutes(t testing.TB) map[string]route {
	return map[string]route{
		"/metrics":   {body: upstreamtest.LlamaCpp(t, "metrics.txt"), ctype: "text/plain; version=0.0.4"},
		"/props":     {body: upstreamtest.LlamaCpp(t, "props.json")},
		"/slots":     {body: upstreamtest.LlamaCpp(t, "slots.json")},
		"/v1/models": {body: upstreamtest.LlamaCpp(t, "models.json")},
	}
}

func TestDetectBackend(t *testing.T) {
	llama := llamaRoutes(t)
	without := func(m map[string]route, paths ...string) map[string]route {
		out := map[string]route{}
		for k, v := range m {
			out[k] = v
		}
		for _, p := range paths {
			delete(out, p)
		}
		return out
	}
	withMetrics501 := without(llama, "/metrics")
	withMetrics501["/metrics"] = route{status: http.StatusNotImplemented, body: llamaNoMetric}
	tests := []struct {
		name      string
		routes    map[string]route
		header    bool
		kind      upstream.Kind // configured
		want      upstream.Detection
		wantNoAns bool
		noGets    bool // a configured vLLM or SGLang needs no request
	}{
		{"llama.cpp by its metrics", llama, true, upstream.Auto, upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "metrics"}, false, false},
		{"llama.cpp without --metrics, by /props", withMetrics501, true, upstream.Auto, upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "props"}, false, false},
		{"llama.cpp by owned_by, slots from /slots", without(llama, "/metrics", "/props"), false, upstream.Auto,
			upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "models"}, false, false},
		{"llama.cpp by its Server header", map[string]route{"/slots": llama["/slots"], "/v1/models": {body: plainModels}}, true, upstream.Auto,
			upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "header"}, false, false},
		{"llama.cpp without --slots nor /props: slots unknown", map[string]route{"/v1/models": llama["/v1/models"]}, true, upstream.Auto,
			upstream.Detection{Kind: upstream.LlamaCpp, Slots: 0, Via: "models"}, false, false},
		{"vllm by its metrics", map[string]route{"/metrics": {body: vllmMetrics}, "/v1/models": {body: vllmModels}}, false, upstream.Auto,
			upstream.Detection{Kind: upstream.VLLM, Slots: 0, Via: "metrics"}, false, false},
		{"vllm by owned_by", map[string]route{"/v1/models": {body: vllmModels}}, false, upstream.Auto, upstream.Detection{Kind: upstream.VLLM, Slots: 0, Via: "models"}, false, false},
		{"sglang by its metrics", map[string]route{"/metrics": {body: sglangMetrics}}, false, upstream.Auto, upstream.Detection{Kind: upstream.SGLang, Slots: 0, Via: "metrics"}, false, false},
		{"sglang by owned_by", map[string]route{"/v1/models": {body: sglangModels}}, false, upstream.Auto, upstream.Detection{Kind: upstream.SGLang, Slots: 0, Via: "models"}, false, false},
		{"nothing says", map[string]route{"/v1/models": {body: plainModels}}, false, upstream.Auto, upstream.Detection{Kind: upstream.Unknown, Slots: 0, Via: ""}, false, false},
		{"configured llama.cpp reads its slots", llama, true, upstream.LlamaCpp, upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "configured"}, false, false},
		{"configured vllm", llama, true, upstream.VLLM, upstream.Detection{Kind: upstream.VLLM, Slots: 0, Via: "configured"}, false, true},
		{"configured sglang", llama, true, upstream.SGLang, upstream.Detection{Kind: upstream.SGLang, Slots: 0, Via: "configured"}, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixtureServer(t, tt.routes, tt.header)
			got, err := upstream.Detect(context.Background(), nil, f.srv.URL, f.srv.URL+"/metrics", tt.kind)
			if err != nil {
				t.Fatalf("DetectBackend: %v", err)
			}
			// A llama.cpp replica's KV capacity comes with its detection:
			// the captured /props (n_ctx 8192 a slot × 2), else /slots.
			wantCap := map[string]upstream.Capacity{
				"llama.cpp by its metrics":                 {Tokens: 16384, Source: upstream.SourceLlamaCppProps},
				"llama.cpp without --metrics, by /props":   {Tokens: 16384, Source: upstream.SourceLlamaCppProps},
				"llama.cpp by owned_by, slots from /slots": {Tokens: 16384, Source: upstream.SourceLlamaCppSlots},
				"llama.cpp by its Server header":           {Tokens: 16384, Source: upstream.SourceLlamaCppSlots},
				"configured llama.cpp reads its slots":     {Tokens: 16384, Source: upstream.SourceLlamaCppProps},
			}[tt.name]
			if got.Capacity != wantCap {
				t.Errorf("capacity %+v, want %+v", got.Capacity, wantCap)
			}
			got.Capacity = upstream.Capacity{}
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			if tt.noGets {
				for _, p := range []string{"/metrics", "/props", "/slots", "/v1/models"} {
					if n := f.count(p); n != 0 {
						t.Errorf("GET %s %d times for a configured kind", p, n)
					}
				}
			}
		})
	}
	t.Run("no answer", func(t *testing.T) {
		url := deadURL(t)
		for _, kind := range []upstream.Kind{upstream.Auto, upstream.LlamaCpp} {
			got, err := upstream.Detect(context.Background(), nil, url, url+"/metrics", kind)
			if !errors.Is(err, upstream.ErrNoAnswer) {
				t.Errorf("%s: error %v, want ErrNoAnswer", kind, err)
			}
			if want := map[upstream.Kind]upstream.Kind{upstream.Auto: upstream.Unknown, upstream.LlamaCpp: upstream.LlamaCpp}[kind]; got.Kind != want {
				t.Errorf("%s: kind %s, want %s", kind, got.Kind, want)
			}
		}
	})
}

// llamaEngine is a fixture server that also answers llama-server's
// completion endpoints with the captured answers, streamed or not as the
// body asks.
type llamaEngine struct {
	*fixtureServer
}

func newLlamaEngine(t testing.TB) *llamaEngine {
	t.Helper()
	e := &llamaEngine{&fixtureServer{hits: map[string]int{}}}
	e.set(llamaRoutes(t), true)
	e.healthy.Store(true)
	answers := map[string]string{
		"/v1/completions false":      upstreamtest.LlamaCpp(t, "completion.json"),
		"/v1/completions true":       upstreamtest.LlamaCpp(t, "completion-stream.txt"),
		"/v1/chat/completions false": upstreamtest.LlamaCpp(t, "chat.json"),
		"/v1/chat/completions true":  upstreamtest.LlamaCpp(t, "chat-stream.txt"),
	}
	mux := http.NewServeMux()
	complete := func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.hits[r.URL.Path]++
		e.mu.Unlock()
		var b struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&b)
		w.Header().Set("Server", "llama.cpp")
		if b.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
		} else {
			w.Header().Set("Content-Type", "application/json; charset=utf-8")
		}
		io.WriteString(w, answers[r.URL.Path+" "+strconv.FormatBool(b.Stream)])
	}
	mux.HandleFunc("POST /v1/completions", complete)
	mux.HandleFunc("POST /v1/chat/completions", complete)
	mux.HandleFunc("/", e.serve)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

// startDetected starts p's loops and waits for the detection of n replicas.
func startDetected(t *testing.T, p *Proxy, n int) map[string]upstream.Detection {
	t.Helper()
	got := make(chan [2]any, 16)
	p.pool.Hooks.Detected = func(name string, d upstream.Detection) { got <- [2]any{name, d} }
	runLoops(t, p)
	out := map[string]upstream.Detection{}
	timeout := time.After(10 * time.Second)
	for len(out) < n {
		select {
		case r := <-got:
			out[r[0].(string)] = r[1].(upstream.Detection)
		case <-timeout:
			t.Fatalf("detections: got %v, want %d replicas", out, n)
		}
	}
	return out
}

var matchedRe = regexp.MustCompile(`matched=(\d+)`)

// TestLlamaCppCachedTokens sends completions and chats, streamed and not,
// through the proxy to a llama-server answering with its captured
// responses: the cached tokens the router is told are usage.prompt_tokens
// − timings.prompt_n, so its cache view checks the prediction against them.
func TestLlamaCppCachedTokens(t *testing.T) {
	prompt := make([]string, 64)
	for i := range prompt {
		prompt[i] = strconv.Itoa(i + 1)
	}
	ids := "[" + strings.Join(prompt, ",") + "]"
	tests := []struct {
		name, path, body, fixture string
		wantCached                int
	}{
		{"completion", "/v1/completions", `{"model":"m","prompt":` + ids + `,"max_tokens":3}`, "completion.json", 601 - 1},
		{"completion stream", "/v1/completions", `{"model":"m","prompt":` + ids + `,"max_tokens":3,"stream":true}`, "completion-stream.txt", 602 - 1},
		{"chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi there"}],"max_tokens":2}`, "chat.json", 10 - 1},
		{"chat stream", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi there"}],"max_tokens":2,"stream":true}`, "chat-stream.txt", 10 - 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newLlamaEngine(t)
			cfg := DefaultConfig()
			cfg.Backends = []Backend{{Name: "l0", URL: e.srv.URL}}
			cfg.HealthInterval, cfg.ScrapeInterval = time.Hour, 0
			cfg.Logger = slog.New(slog.DiscardHandler)
			cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
			p, srv := startProxy(t, cfg)
			if d := startDetected(t, p, 1)["l0"]; d.Kind != upstream.LlamaCpp || d.Slots != 2 {
				t.Fatalf("detected %+v, want llamacpp with 2 slots", d)
			}
			resp := post(t, srv.URL, tt.path, tt.body)
			got := readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if want := upstreamtest.LlamaCpp(t, tt.fixture); string(got) != want {
				t.Errorf("body changed on the way:\n got %q\nwant %q", got, want)
			}
			m := matchedRe.FindStringSubmatch(resp.Header.Get(HeaderRoute))
			if m == nil {
				t.Fatalf("route header %q", resp.Header.Get(HeaderRoute))
			}
			matched, _ := strconv.Atoi(m[1])
			p.mu.Lock()
			v, err := p.rt.CacheView(0)
			stats := p.rt.Stats()
			p.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			// A chat's text is keyed by chunks (no tokenizer here): the
			// report is compared in the router's units, the engine's
			// count times UnitsPerToken (router.Finish.PromptTokens).
			reported := tt.wantCached
			if v.UnitsPerToken > 0 {
				reported = int(math.Floor(float64(tt.wantCached)*v.UnitsPerToken + 1e-9))
			}
			if est := strings.Contains(tt.path, "chat"); est != (v.UnitsPerToken > 0) {
				t.Errorf("units per token %v: want them learnt only from the chat's estimated count", v.UnitsPerToken)
			}
			wantErr := matched - reported
			if v.Checked != 1 || v.LastErrorTokens != wantErr || v.ErrorTokens != float64(wantErr) || v.Slots != 2 {
				t.Errorf("cache view %+v, want 1 checked with error %d tokens on 2 slots", v, wantErr)
			}
			if stats.PredictionsChecked != 1 || stats.ReportedTokens != int64(tt.wantCached) {
				t.Errorf("stats: %d checked, %d tokens reported; want 1, %d", stats.PredictionsChecked, stats.ReportedTokens, tt.wantCached)
			}
		})
	}
}

// TestLlamaCppMetricsAndDebug checks the replica's kind, load and cache
// view in /metrics, /debug/replicas and the dashboard.
func TestLlamaCppMetricsAndDebug(t *testing.T) {
	e := newLlamaEngine(t)
	v := newFakeReplica(t, "v0")
	cfg := DefaultConfig()
	cfg.Backends = []Backend{{Name: "l0", URL: e.srv.URL}, v.backend()}
	cfg.HealthInterval, cfg.ScrapeInterval = time.Hour, 0
	cfg.Policy = "round-robin"
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, srv := startProxy(t, cfg)
	startDetected(t, p, 2)
	for range 2 { // one each; token ids, so the fixture's counts are compared as they are
		readAll(t, post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":[1,2,3],"max_tokens":3}`))
	}
	for id := range 2 {
		p.pool.Scrape(context.Background(), p.backendAt(id).Member)
	}
	metrics := string(readAll(t, mustGet(t, srv.URL+"/metrics")))
	for _, want := range []string{
		`prefixlb_replica_info{kind="llamacpp",replica="l0"} 1`,
		`prefixlb_replica_info{kind="vllm",replica="v0"} 1`, // by its metric names
		`prefixlb_cache_prediction_error_tokens{replica="l0"} -600`,
		`prefixlb_cache_capacity_tokens{replica="l0"} `,
		`prefixlb_cache_corrections_total{replica="l0"} `,
		`prefixlb_cached_tokens_reported_total 600`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q:\n%s", want, grep(metrics, "prefixlb_"))
		}
	}
	var dbg struct {
		Replicas []ReplicaStatus `json:"replicas"`
	}
	if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/debug/replicas")), &dbg); err != nil {
		t.Fatal(err)
	}
	l := dbg.Replicas[0]
	if l.Kind != upstream.LlamaCpp || l.Slots != 2 || l.Cache.Slots != 2 || l.Cache.Checked != 1 || l.Cache.LastErrorTokens != -600 ||
		l.KVTokens != 615 || l.Running != 0 || l.Waiting != 0 || abs(l.KVUsage-0.0375366) > 1e-9 {
		t.Errorf("llama.cpp replica in /debug/replicas: %+v", l)
	}
	if vr := dbg.Replicas[1]; vr.Kind != upstream.VLLM || vr.Slots != 0 || vr.KVTokens != -1 || vr.Running != 2 {
		t.Errorf("vLLM replica in /debug/replicas: %+v", vr)
	}
	s := p.Snapshot()
	if r := s.Replicas[0]; r.Kind != "llamacpp" || r.Slots != 2 || r.PredictionErrorTokens != -600 || r.CapacityTokens <= 0 {
		t.Errorf("dashboard replica %+v", r)
	}
	if r := s.Replicas[1]; r.Kind != "vllm" || r.Slots != 0 {
		t.Errorf("dashboard replica %+v", r)
	}
}

// TestBackendKindReDetected: a replica ejected as llama.cpp and re-admitted
// as vLLM (another engine deployed behind its address) is detected again,
// and the router's model of its cache follows.
func TestBackendKindReDetected(t *testing.T) {
	f := newFixtureServer(t, llamaRoutes(t), true)
	cfg := DefaultConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: f.srv.URL}}
	cfg.HealthInterval, cfg.ScrapeInterval = 5*time.Millisecond, 0
	cfg.EjectAfter, cfg.ReadmitAfter = 1, 1
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	detected := make(chan upstream.Detection, 16)
	states := make(chan bool, 16)
	p.pool.Hooks.Detected = func(_ string, d upstream.Detection) { detected <- d }
	p.hookState = func(_ string, up bool) { states <- up }
	runLoops(t, p)
	wait := func(what string, ch any) any {
		t.Helper()
		timeout := time.After(10 * time.Second)
		switch c := ch.(type) {
		case chan upstream.Detection:
			select {
			case v := <-c:
				return v
			case <-timeout:
			}
		case chan bool:
			select {
			case v := <-c:
				return v
			case <-timeout:
			}
		}
		t.Fatalf("no %s", what)
		return nil
	}
	slots := func() int {
		p.mu.Lock()
		defer p.mu.Unlock()
		v, _ := p.rt.CacheView(0)
		return v.Slots
	}
	if d := wait("detection", detected).(upstream.Detection); d.Kind != upstream.LlamaCpp || d.Slots != 2 || slots() != 2 {
		t.Fatalf("first detection %+v, router slots %d", d, slots())
	}
	f.healthy.Store(false)
	if up := wait("ejection", states).(bool); up {
		t.Fatal("re-admitted, want ejected")
	}
	f.set(map[string]route{"/metrics": {body: vllmMetrics}, "/v1/models": {body: vllmModels}}, false)
	f.healthy.Store(true)
	if up := wait("re-admission", states).(bool); !up {
		t.Fatal("ejected, want re-admitted")
	}
	if d := wait("detection after re-admission", detected).(upstream.Detection); d.Kind != upstream.VLLM || slots() != 0 {
		t.Fatalf("after re-admission %+v, router slots %d", d, slots())
	}
	p.mu.Lock()
	e := p.pool.StateOf(p.pool.Member(0))
	p.mu.Unlock()
	if e.Kind != upstream.VLLM || e.KindDue {
		t.Errorf("engine state %+v", e)
	}
}

func TestParseLoadLlamaCpp(t *testing.T) {
	l, err := upstream.ParseLoad(strings.NewReader(upstreamtest.LlamaCpp(t, "metrics.txt")))
	if err != nil {
		t.Fatal(err)
	}
	if want := (upstream.Load{Waiting: 0, Running: 0, KVUsage: 0.0375366, KVTokens: 615, Kind: upstream.LlamaCpp}); l != want {
		t.Errorf("got %+v, want %+v", l, want)
	}
	busy := strings.NewReplacer("llamacpp:requests_processing 0", "llamacpp:requests_processing 2",
		"llamacpp:requests_deferred 0", "llamacpp:requests_deferred 5").Replace(upstreamtest.LlamaCpp(t, "metrics.txt"))
	if l, _ := upstream.ParseLoad(strings.NewReader(busy)); l.Running != 2 || l.Waiting != 5 {
		t.Errorf("busy replica: %+v", l)
	}
	for _, tc := range []struct {
		text string
		want upstream.Kind
	}{
		{vllmMetrics, upstream.VLLM},
		{sglangMetrics, upstream.SGLang},
		{"# TYPE up gauge\nup 1\n", ""},
		{"vllm:a 1\nllamacpp:b 1\nllamacpp:c 1\n", upstream.LlamaCpp},
	} {
		if l, _ := upstream.ParseLoad(strings.NewReader(tc.text)); l.Kind != tc.want {
			t.Errorf("kind of %q: %q, want %q", tc.text, l.Kind, tc.want)
		}
	}
}

func TestReadChunkCachedTokens(t *testing.T) {
	lastEvent := func(stream string) string {
		var last string
		for _, ev := range strings.Split(stream, "\n\n") {
			if d, ok := strings.CutPrefix(strings.TrimSpace(ev), "data: "); ok && d != "[DONE]" {
				last = d
			}
		}
		return last
	}
	tests := []struct {
		name        string
		data        string
		wantUsage   bool
		wantCached  int
		wantPromptN int // -1: no timings
	}{
		{"llama.cpp completion", upstreamtest.LlamaCpp(t, "completion.json"), true, 600, 1},
		{"llama.cpp chat", upstreamtest.LlamaCpp(t, "chat.json"), true, 9, 1},
		{"llama.cpp stream's final chunk", lastEvent(upstreamtest.LlamaCpp(t, "completion-stream.txt")), true, 601, 1},
		{"llama.cpp chat stream's final chunk", lastEvent(upstreamtest.LlamaCpp(t, "chat-stream.txt")), true, 9, 1},
		{"vLLM", `{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`, true, 8, -1},
		{"details beat timings", `{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}},"timings":{"prompt_n":1}}`, true, 4, 1},
		{"no details, no timings", `{"usage":{"prompt_tokens":10,"completion_tokens":2}}`, true, -1, -1},
		{"timings without usage", `{"choices":[{"text":"a"}],"timings":{"prompt_n":3,"prompt_ms":1.5}}`, false, 0, 3},
		{"more computed than sent", `{"usage":{"prompt_tokens":5},"timings":{"prompt_n":9}}`, true, 0, 9},
		{"timings of another shape", `{"usage":{"prompt_tokens":5},"timings":"fast"}`, true, -1, -1},
		{"timings not measured", `{"usage":{"prompt_tokens":5},"timings":{"prompt_n":-1}}`, true, -1, -1},
		{"usage without prompt_tokens", `{"usage":{"completion_tokens":2},"timings":{"prompt_n":1}}`, true, -1, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, ok := openai.ReadChunk([]byte(tt.data))
			if !ok {
				t.Fatalf("ReadChunk(%q) not ok", tt.data)
			}
			if c.HasUsage != tt.wantUsage || c.CachedTokens != tt.wantCached {
				t.Errorf("usage %v, cached %d; want %v, %d", c.HasUsage, c.CachedTokens, tt.wantUsage, tt.wantCached)
			}
			if (c.Timings == nil) != (tt.wantPromptN < 0) || (c.Timings != nil && c.Timings.PromptN != tt.wantPromptN) {
				t.Errorf("timings %+v, want prompt_n %d", c.Timings, tt.wantPromptN)
			}
		})
	}
	c, _ := openai.ReadChunk([]byte(upstreamtest.LlamaCpp(t, "completion.json")))
	if want := (openai.Timings{PromptN: 1, PromptMs: 11.397, PromptPerTokenMs: 11.397, PredictedN: 3, PredictedMs: 14.907, PredictedPerTokenMs: 4.969}); *c.Timings != want {
		t.Errorf("timings %+v, want %+v", *c.Timings, want)
	}
	// A stream: the timings and usage of the final chunk.
	var s openai.Stream
	fr := openai.NewFramer(strings.NewReader(upstreamtest.LlamaCpp(t, "completion-stream.txt")), 0)
	for {
		ev, err := fr.Next()
		if err != nil {
			break
		}
		if _, err := s.Observe(&ev); err != nil {
			t.Fatal(err)
		}
	}
	if s.Tokens != 3 || !s.SawDone || s.Cached() != 601 || s.Timings == nil || s.Timings.PromptMs != 6.524 {
		t.Errorf("stream state %+v, cached %d", s, s.Cached())
	}
}

func TestConfigBackendKind(t *testing.T) {
	y := `
backend_kind: llamacpp
backends:
  - url: http://10.0.0.1:8080
  - url: http://10.0.0.2:8000
    kind: vllm
  - url: http://10.0.0.3:8000
    kind: auto
`
	c, err := ParseConfig([]byte(y), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	var got []upstream.Kind
	for _, b := range c.Backends {
		got = append(got, backendKind(b, c.BackendKind))
	}
	if want := []upstream.Kind{upstream.LlamaCpp, upstream.VLLM, upstream.Auto}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("kinds %v, want %v", got, want)
	}
	if d := DefaultConfig(); d.BackendKind != upstream.Auto {
		t.Errorf("default kind %q", d.BackendKind)
	}
	for _, tc := range []struct {
		yaml, want string
	}{
		{"backends:\n  - url: http://a:1\n    kind: llama\n", `proxy: config: backends[0].kind: unknown backend kind "llama" (want auto, vllm, sglang or llamacpp)`},
		{"backend_kind: tgi\nbackends:\n  - url: http://a:1\n", `proxy: config: backend_kind: unknown backend kind "tgi" (want auto, vllm, sglang or llamacpp)`},
	} {
		c, err := ParseConfig([]byte(tc.yaml), DefaultConfig())
		if err != nil {
			t.Fatal(err)
		}
		err = c.Validate()
		if err == nil || err.Error() != tc.want || !errors.Is(err, upstream.ErrKind) {
			t.Errorf("%q: Validate = %v, want %q", tc.yaml, err, tc.want)
		}
		if _, err := New(c); err == nil || !strings.Contains(err.Error(), "unknown backend kind") {
			t.Errorf("%q: New = %v", tc.yaml, err)
		}
	}
	for _, s := range []string{"", "auto", "vllm", "sglang", "llamacpp", " llamacpp "} {
		if _, err := upstream.ParseKind(s); err != nil {
			t.Errorf("ParseBackendKind(%q): %v", s, err)
		}
	}
	for _, s := range []string{"llama.cpp", "VLLM", "unknown", "x"} {
		if _, err := upstream.ParseKind(s); !errors.Is(err, upstream.ErrKind) {
			t.Errorf("ParseBackendKind(%q) = %v, want ErrBackendKind", s, err)
		}
	}
}

// llamaTokenizer is a fake llama-server's /tokenize and /apply-template,
// answering with tok as llama.cpp would with the same vocabulary: content
// tokenized with special tokens parsed (tok.Encode does) and, the model
// adding no BOS, add_special changing nothing. alter, when set, alters
// the answer.
func llamaTokenizer(t *testing.T, tok *tokenize.Tokenizer, template bool, alter func(content string, ids []uint32) []uint32) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"status":"ok"}`) })
	mux.HandleFunc("GET /props", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, upstreamtest.LlamaCpp(t, "props.json"))
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]json.RawMessage
		_ = json.NewDecoder(r.Body).Decode(&body)
		var content string
		ids := []uint32{} // llama.cpp's answer to a body without "content"
		if c, ok := body["content"]; ok {
			if string(body["add_special"]) != "true" {
				t.Errorf("/tokenize without add_special true: %v", body)
			}
			_ = json.Unmarshal(c, &content)
			ids = tok.Encode(content)
			if alter != nil {
				ids = alter(content, ids)
			}
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids})
	})
	if template {
		mux.HandleFunc("POST /apply-template", func(w http.ResponseWriter, r *http.Request) {
			var body struct {
				Messages []tokenize.Message `json:"messages"`
			}
			_ = json.NewDecoder(r.Body).Decode(&body)
			s, err := tok.ApplyChatTemplate(body.Messages, tokenize.ChatOptions{AddGenerationPrompt: true})
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"prompt": s})
		})
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func TestTokenizerCheckLlamaCpp(t *testing.T) {
	tok := testTokenizer(t)
	c := keying.NewTokenizerCheck(tok)
	c.Timeout = 5 * time.Second
	chatDiffers := func(content string, ids []uint32) []uint32 {
		if strings.Contains(content, "<|im_start|>") {
			return append([]uint32{1}, ids...) // a BOS before the chat, say
		}
		return ids
	}
	tests := []struct {
		name    string
		srv     *httptest.Server
		kind    upstream.Kind
		want    keying.TokenizerState
		wantErr string
	}{
		{"match", llamaTokenizer(t, tok, true, nil), upstream.LlamaCpp, keying.TokenizerMatch, ""},
		{"chat differs", llamaTokenizer(t, tok, true, chatDiffers), upstream.LlamaCpp, keying.TokenizerMismatch, "probe chat"},
		{"no /apply-template: the prompt alone", llamaTokenizer(t, tok, false, chatDiffers), upstream.LlamaCpp, keying.TokenizerMatch, ""},
		{"prompt differs", llamaTokenizer(t, tok, true, func(_ string, ids []uint32) []uint32 { return ids[1:] }), upstream.LlamaCpp,
			keying.TokenizerMismatch, "probe prompt"},
		{"vLLM's request to llama.cpp", llamaTokenizer(t, tok, true, nil), upstream.VLLM, keying.TokenizerUnknown, "holds no ids"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.CompareKind(context.Background(), nil, tt.srv.URL, tt.kind)
			if got != tt.want || (err == nil) != (tt.wantErr == "") || (err != nil && !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("CompareKind = %v, %v; want %v, error with %q", got, err, tt.want, tt.wantErr)
			}
		})
	}
	// Through the proxy: a configured llama.cpp is probed in its shape, a
	// detected one too.
	for _, kind := range []upstream.Kind{upstream.LlamaCpp, upstream.Auto} {
		t.Run("proxy "+string(kind), func(t *testing.T) {
			srv := llamaTokenizer(t, tok, true, nil)
			cfg := DefaultConfig()
			cfg.Backends = []Backend{{Name: "l0", URL: srv.URL, Kind: kind}}
			cfg.HealthInterval, cfg.ScrapeInterval = time.Hour, 0
			cfg.Logger = slog.New(slog.DiscardHandler)
			cfg.Keyer = keying.NewTokenizerKeyer(tok, cfg.BlockTokens)
			p, _ := startProxy(t, cfg)
			if got := probeAll(t, p, 1)["l0"]; got != int(keying.TokenizerMatch) {
				t.Errorf("probe state %d, want match", got)
			}
		})
	}
}

// TestLlamaCppFixturesDecode pins the captured answers the fakes replay:
// the 404 page carries llama.cpp's Server header, the /tokenize answer is
// a plain id list.
func TestLlamaCppFixturesDecode(t *testing.T) {
	if raw := upstreamtest.LlamaCpp(t, "404.txt"); !strings.Contains(raw, "Server: llama.cpp") || !strings.Contains(raw, llamaNotFound) {
		t.Errorf("404 fixture %q", raw)
	}
	var tk struct{ Tokens []uint32 }
	if err := json.Unmarshal([]byte(upstreamtest.LlamaCpp(t, "tokenize.json")), &tk); err != nil || len(tk.Tokens) != 2 {
		t.Errorf("tokenize fixture: %v %v", tk, err)
	}
	var props map[string]json.RawMessage
	if err := json.Unmarshal([]byte(upstreamtest.LlamaCpp(t, "props.json")), &props); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := json.Unmarshal(props["total_slots"], &n); err != nil || n != 2 {
		t.Errorf("total_slots %d %v", n, err)
	}
	if !bytes.Contains([]byte(upstreamtest.LlamaCpp(t, "models.json")), []byte(`"owned_by":"llamacpp"`)) {
		t.Error("models fixture is not llama.cpp's")
	}
}

// TestLlamaCppSlotsLate: a llama-server that answers its kind but not yet
// its slot count (GET /props and GET /slots 503 while it loads, or too
// slow) is asked again, and its slots reach the router once it says them;
// before, the first detection settled for a block cache until the replica
// was re-admitted.
func TestLlamaCppSlotsLate(t *testing.T) {
	routes := llamaRoutes(t)
	loading := map[string]route{}
	for k, v := range routes {
		loading[k] = v
	}
	loading["/props"] = route{status: http.StatusServiceUnavailable, body: `{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}`}
	loading["/slots"] = loading["/props"]
	f := newFixtureServer(t, loading, true)
	cfg := DefaultConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: f.srv.URL}}
	cfg.HealthInterval, cfg.ScrapeInterval = 5*time.Millisecond, 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	detected := make(chan upstream.Detection, 64)
	p.pool.Hooks.Detected = func(_ string, d upstream.Detection) { detected <- d }
	runLoops(t, p)
	select {
	case d := <-detected:
		if d.Kind != upstream.LlamaCpp || d.Slots != 0 {
			t.Fatalf("first detection %+v, want llama.cpp without slots", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no detection")
	}
	f.set(routes, true)
	deadline := time.After(10 * time.Second)
	for {
		select {
		case d := <-detected:
			if d.Slots == 0 {
				continue
			}
			p.mu.Lock()
			v, _ := p.rt.CacheView(0)
			e := p.pool.StateOf(p.pool.Member(0))
			p.mu.Unlock()
			if d.Slots != 2 || v.Slots != 2 || e.KindDue {
				t.Fatalf("detection %+v, router slots %d, state %+v", d, v.Slots, e)
			}
			return
		case <-deadline:
			t.Fatal("slots never detected after /props answered")
		}
	}
}
