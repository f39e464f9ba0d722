package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/promtest"
)

// startPools serves two pools on loopback, two engines each: "alpha"
// serves model-a (and is the default), "beta" serves model-b.
func startPools(t *testing.T) (*Pools, *httptest.Server) {
	t.Helper()
	var pcs []PoolConfig
	for _, p := range []struct{ name, model string }{{"alpha", "model-a"}, {"beta", "model-b"}} {
		model := p.model
		cfg := testConfig()
		cfg.Policy = "round-robin"
		for i, b := range startEngines(t, 2, func(c *engine.Config) { c.Model = model }) {
			b.Name = fmt.Sprintf("%s-%d", p.name, i)
			cfg.Backends = append(cfg.Backends, b)
		}
		pcs = append(pcs, PoolConfig{Name: p.name, Models: []string{p.model}, Default: p.name == "alpha", Config: cfg})
	}
	ps, err := NewPools(pcs, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(ps.Handler())
	t.Cleanup(func() { srv.Close(); ps.Close() })
	return ps, srv
}

// TestPools: each model's requests reach only its pool's replicas;
// /v1/models lists both pools' models; an unknown model is 404
// model_not_found; a request without a model goes to the default pool;
// metrics carry the pool; each pool's dashboard is under /pools/NAME/.
func TestPools(t *testing.T) {
	_, srv := startPools(t)
	for _, tc := range []struct{ model, prefix string }{{"model-a", "alpha-"}, {"model-b", "beta-"}} {
		for i := range 6 {
			path, body := "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"request %d for the pool","max_tokens":2}`, tc.model, i)
			if i%2 == 1 {
				path, body = "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi %d"}],"max_tokens":2,"stream":true}`, tc.model, i)
			}
			resp := post(t, srv.URL, path, body)
			got := readAll(t, resp)
			if resp.StatusCode != 200 {
				t.Fatalf("%s: status %d: %s", tc.model, resp.StatusCode, got)
			}
			if r := resp.Header.Get(HeaderReplica); !strings.HasPrefix(r, tc.prefix) {
				t.Errorf("%s went to %q, outside its pool", tc.model, r)
			}
		}
	}
	resp := post(t, srv.URL, "/v1/completions", `{"model":"model-z","prompt":"x","max_tokens":2}`)
	var e struct {
		Error struct{ Type, Code, Message, Param string }
	}
	if err := json.Unmarshal(readAll(t, resp), &e); err != nil || resp.StatusCode != http.StatusNotFound ||
		e.Error.Code != "model_not_found" || e.Error.Type != "invalid_request_error" || e.Error.Param != "model" ||
		!strings.Contains(e.Error.Message, "known: model-a, model-b") {
		t.Errorf("unknown model: status %d, %+v (%v)", resp.StatusCode, e, err)
	}
	resp = post(t, srv.URL, "/v1/completions", `{"prompt":"no model","max_tokens":2}`)
	readAll(t, resp)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get(HeaderReplica), "alpha-") {
		t.Errorf("no model: status %d from %q, want the default pool", resp.StatusCode, resp.Header.Get(HeaderReplica))
	}

	var list struct {
		Object string
		Data   []struct{ ID string }
	}
	if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/v1/models")), &list); err != nil {
		t.Fatal(err)
	}
	ids := map[string]int{}
	for _, d := range list.Data {
		ids[d.ID]++
	}
	if list.Object != "list" || ids["model-a"] != 1 || ids["model-b"] != 1 {
		t.Errorf("/v1/models %+v", list)
	}

	m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
	if v, ok := promtest.Sum(m, "prefixlb_requests_total", "pool", "beta"); !ok || v != 6 {
		t.Errorf(`prefixlb_requests_total{pool="beta"} = %v, want 6`, v)
	}
	if v, _ := promtest.Sum(m, "prefixlb_requests_total", "pool", "alpha"); v != 7 {
		t.Errorf(`prefixlb_requests_total{pool="alpha"} = %v, want 7`, v)
	}
	if _, ok := promtest.Sum(m, "go_goroutines"); !ok {
		t.Error("no process metrics")
	}
	var st struct{ Replicas []struct{ Name string } }
	if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/pools/beta/ui/state.json")), &st); err != nil ||
		len(st.Replicas) != 2 || !strings.HasPrefix(st.Replicas[0].Name, "beta-") {
		t.Errorf("beta's dashboard state %+v (%v)", st, err)
	}
}

// TestPoolsConfig: pools in YAML inherit the top level's settings and
// override them; bad pools are refused with the field at fault.
func TestPoolsConfig(t *testing.T) {
	y := `
policy: e2
block_tokens: 32
pools:
  - name: chat
    models: [llama-3.1-8b, llama-3.1-8b-lora-a]
    default: true
    backends: [{url: "http://10.0.0.1:8000"}, {url: "http://10.0.0.2:8000"}]
  - name: code
    models: [qwen3-coder]
    policy: round-robin
    backends: [{url: "http://10.0.1.1:8000"}]
`
	c, err := ParseConfig([]byte(y), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Pools) != 2 || c.Pools[0].Name != "chat" || !c.Pools[0].Default || len(c.Pools[0].Models) != 2 ||
		c.Pools[0].Config.Policy != "e2" || c.Pools[0].Config.BlockTokens != 32 || len(c.Pools[0].Config.Backends) != 2 ||
		c.Pools[1].Config.Policy != "round-robin" || c.Pools[1].Config.BlockTokens != 32 {
		t.Fatalf("parsed %+v", c.Pools)
	}
	if _, err := NewPools(c.Pools, slog.New(slog.DiscardHandler)); err != nil {
		t.Errorf("NewPools: %v", err)
	}
	for _, tc := range []struct{ yaml, want string }{
		{"pools:\n  - name: a\n    models: [m]\n    backends: [{url: http://x:1}]\n    polcy: e2\n", "unknown field"},
		{"backends: [{url: http://x:1}]\npools:\n  - name: a\n    models: [m]\n", "belong to each pool"},
	} {
		if _, err := ParseConfig([]byte(tc.yaml), DefaultConfig()); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.yaml, err, tc.want)
		}
	}
	base := func() []PoolConfig {
		cfg := testConfig()
		cfg.Backends = []Backend{{URL: "http://127.0.0.1:1"}}
		return []PoolConfig{{Name: "a", Models: []string{"m"}, Config: cfg}, {Name: "b", Models: []string{"n"}, Config: cfg}}
	}
	for _, tc := range []struct {
		edit func([]PoolConfig)
		want string
	}{
		{func(p []PoolConfig) { p[1].Name = "a" }, "duplicate pool"},
		{func(p []PoolConfig) { p[1].Models = []string{"m"} }, `model "m" is pool a's already`},
		{func(p []PoolConfig) { p[0].Default, p[1].Default = true, true }, "both the default"},
		{func(p []PoolConfig) { p[1].Models = nil }, "serves no model"},
		{func(p []PoolConfig) { p[1].Config.Backends = nil }, "pool b: proxy: config: backends"},
	} {
		p := base()
		tc.edit(p)
		if _, err := NewPools(p, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v, want %q", err, tc.want)
		}
	}
}

// TestLoRAKeys: a LoRA adapter's request never matches the base model's
// cached prompt (vLLM folds the adapter into each block's hash), nor
// another adapter's; the same adapter's does.
func TestLoRAKeys(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	cfg := testConfig(a, b)
	cfg.LoRAAdapters = []string{"sql-lora", "chat-lora"}
	_, srv := startProxy(t, cfg)
	prompt := strings.Repeat("a long system prompt shared by every request of the service ", 20)
	matched := func(model string) int {
		t.Helper()
		var ex RouteExplanation
		resp := post(t, srv.URL, "/debug/route", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, model, prompt+"q"))
		if err := json.Unmarshal(readAll(t, resp), &ex); err != nil {
			t.Fatal(err)
		}
		return ex.MatchedTokens
	}
	readAll(t, post(t, srv.URL, "/v1/completions", fmt.Sprintf(`{"model":"base","prompt":%q,"max_tokens":2}`, prompt)))
	if n := matched("base"); n == 0 {
		t.Fatal("the base model's prompt is not cached after it was served")
	}
	if n := matched("sql-lora"); n != 0 {
		t.Errorf("an adapter's request matched %d tokens of the base model's prompt", n)
	}
	readAll(t, post(t, srv.URL, "/v1/completions", fmt.Sprintf(`{"model":"sql-lora","prompt":%q,"max_tokens":2}`, prompt)))
	if n := matched("sql-lora"); n == 0 {
		t.Error("the adapter's own prompt is not matched after it was served")
	}
	if n := matched("chat-lora"); n != 0 {
		t.Errorf("adapter chat-lora matched %d tokens of sql-lora's prompt", n)
	}
}

// TestPoolsSlowBody: a body sent too slowly is cut off with 408 before a
// pool is chosen, as a single pool's serve cuts it off.
func TestPoolsSlowBody(t *testing.T) {
	cfg := testConfig(newFakeReplica(t, "a"))
	cfg.BodyReadTimeout = 200 * time.Millisecond
	ps, err := NewPools([]PoolConfig{{Name: "p", Models: []string{"m"}, Config: cfg}}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(ps.Handler())
	defer srv.Close()
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Errorf("status %d, want 408", resp.StatusCode)
	}
}
