package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/decisiontest"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// saltStack is serve in front of two engines that publish KV events, with
// the bodies and headers each engine received recorded.
type saltStack struct {
	p       *Proxy
	url     string
	engines []*kvEngine
	mu      sync.Mutex
	got     []*http.Request // the completions the engines received, bodies in bodies
	bodies  [][]byte
}

const saltToken = "admin-s3cret"

// startSaltStack runs two KV-event engines and a proxy over them, with
// no speculative entries (the router learns the engines' caches from
// their events alone), no calibration and a fixed seed, so that two
// stacks fed the same requests decide alike; mod changes the config.
func startSaltStack(t *testing.T, mod func(*Config)) *saltStack {
	t.Helper()
	st := &saltStack{}
	cfg := DefaultConfig()
	for i := range 2 {
		k := &kvEngine{t: t, name: fmt.Sprintf("engine-%d", i)}
		k.start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
		k.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/completions" {
				body, _ := io.ReadAll(r.Body)
				st.mu.Lock()
				st.got, st.bodies = append(st.got, r.Clone(context.Background())), append(st.bodies, body)
				st.mu.Unlock()
				r.Body = io.NopCloser(bytes.NewReader(body))
			}
			(*k.handler.Load()).ServeHTTP(w, r)
		}))
		t.Cleanup(func() {
			k.srv.Close()
			k.stop()
		})
		st.engines = append(st.engines, k)
		cfg.Backends = append(cfg.Backends, k.backend())
	}
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.HealthInterval = time.Hour
	cfg.ScrapeInterval = 0
	cfg.SpeculativeTTL = -1
	cfg.Calibrate = false
	cfg.AdminToken = saltToken
	if mod != nil {
		mod(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(func() {
		cancel()
		<-done
		srv.Close()
		p.Close()
	})
	st.p, st.url = p, srv.URL
	return st
}

// saltAnswer is what a client got: status, headers, cached tokens.
type saltAnswer struct {
	status int
	header http.Header
	cached int
	body   []byte
}

// send posts a completion of prompt with cache_salt salt ("" none) and
// headers kv (name, value, ...).
func (st *saltStack) send(t *testing.T, prompt []uint32, salt string, kv ...string) saltAnswer {
	t.Helper()
	b := map[string]any{"model": "prefixlb-sim", "prompt": prompt, "max_tokens": 2}
	if salt != "" {
		b["cache_salt"] = salt
	}
	js, _ := json.Marshal(b)
	req, err := http.NewRequest(http.MethodPost, st.url+"/v1/completions", bytes.NewReader(js))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(kv); i += 2 {
		req.Header.Set(kv[i], kv[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	a := saltAnswer{status: resp.StatusCode, header: resp.Header, body: body, cached: -1}
	var out struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &out) == nil {
		a.cached = out.Usage.Details.Cached
	}
	return a
}

// predicted is POST /debug/route's matched tokens for the request send
// would make (as the admin, with the client's headers kv).
func (st *saltStack) predicted(t *testing.T, prompt []uint32, salt string, kv ...string) int {
	t.Helper()
	b := map[string]any{"model": "prefixlb-sim", "prompt": prompt, "max_tokens": 2}
	if salt != "" {
		b["cache_salt"] = salt
	}
	js, _ := json.Marshal(b)
	req, _ := http.NewRequest(http.MethodPost, st.url+"/debug/route", bytes.NewReader(js))
	req.Header.Set(tenancy.TokenHeader, saltToken)
	for i := 0; i+1 < len(kv); i += 2 {
		req.Header.Set(kv[i], kv[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out RouteExplanation
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/debug/route: status %d, %v", resp.StatusCode, err)
	}
	return out.MatchedTokens
}

// settle waits until the router holds, per replica, the blocks the engine
// caches: every KV event so far is applied.
func (st *saltStack) settle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond) // polls the router's view, as waitAgree does
	defer tick.Stop()
	for {
		ok := true
		for i, k := range st.engines {
			want := k.eng.Stats().CachedBlocks
			st.p.mu.Lock()
			got := st.p.rt.Tree().CachedBlocks(i)
			st.p.mu.Unlock()
			ok = ok && got == want && want >= 0
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the router never caught up with the engines' KV events")
		}
		<-tick.C
	}
}

// saltPrompt is 96 distinct token ids (6 blocks of 16) from base.
func saltPrompt(base uint32) []uint32 {
	out := make([]uint32, 96)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// TestCrossSaltProbe: with the explanation on for everyone, tenant A's
// salted prompt shows as cached to A only. B probing the same prompt with
// another salt, or with none, is routed as a miss (matched=0) and the
// engine serves it as one, though A's blocks reached the router through
// KV events (salt in extra_keys); A's own repeat still hits.
func TestCrossSaltProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("real sockets and engines")
	}
	st := startSaltStack(t, func(c *Config) { c.Explain = tenancy.ExplainAlways })
	p := saltPrompt(5000)
	warm := st.send(t, p, "salt-a")
	if warm.status != http.StatusOK || warm.cached != 0 {
		t.Fatalf("warm-up: %d, cached %d: %s", warm.status, warm.cached, warm.body)
	}
	st.settle(t)
	if n := st.predicted(t, p, "salt-a"); n != 96 {
		t.Fatalf("the router predicts %d tokens of A's prompt for A, want 96 (6 blocks from KV events)", n)
	}
	for _, salt := range []string{"salt-b", ""} {
		a := st.send(t, p, salt)
		_, matched, err := decisiontest.ParseRoute(a.header.Get(HeaderRoute))
		if err != nil || matched != 0 {
			t.Errorf("B with salt %q: route %q (%v), want matched=0", salt, a.header.Get(HeaderRoute), err)
		}
		if a.cached != 0 {
			t.Errorf("B with salt %q: the engine served %d cached tokens, want 0", salt, a.cached)
		}
	}
	again := st.send(t, p, "salt-a")
	_, matched, err := decisiontest.ParseRoute(again.header.Get(HeaderRoute))
	if err != nil || matched != 96 || again.cached != 80 {
		t.Errorf("A again: route %q (%v), cached %d; want matched=96 and 80 cached (the last block recomputed)", again.header.Get(HeaderRoute), err, again.cached)
	}
	if r0, r1 := warm.header.Get(HeaderReplica), again.header.Get(HeaderReplica); r0 != r1 {
		t.Errorf("A's repeat went to %s, its blocks are on %s", r1, r0)
	}
}

// TestCrossTenantZeroBits: with the defaults (explanation for trusted
// clients only) and tenant isolation, tenant B learns nothing of tenant A's
// cache: B's answers — status, every header but Date, cached tokens — are
// byte for byte the same whether A warmed the prompt B probes or another
// of the same length, in two fresh stacks fed the same requests. The
// router predicts A's blocks for A only; the engine got A's tenant salt;
// a trusted client gets the explanation, and the admin token never
// reaches an engine.
func TestCrossTenantZeroBits(t *testing.T) {
	if testing.Short() {
		t.Skip("real sockets and engines")
	}
	target, other := saltPrompt(7000), saltPrompt(9000)
	keyA, keyB := []string{"Authorization", "Bearer key-of-a"}, []string{"Authorization", "Bearer key-of-b"}
	type probe struct {
		name string
		a    saltAnswer
	}
	run := func(warmed []uint32) (*saltStack, []probe) {
		st := startSaltStack(t, func(c *Config) { c.TenantIsolation = true })
		if a := st.send(t, warmed, "", keyA...); a.status != http.StatusOK {
			t.Fatalf("A's warm-up: %d %s", a.status, a.body)
		}
		st.settle(t)
		var out []probe
		for _, salt := range []string{"", "salt-a", "salt-b"} {
			out = append(out, probe{"B salt " + salt, st.send(t, target, salt, keyB...)})
			st.settle(t)
		}
		out = append(out, probe{"anonymous", st.send(t, target, "")})
		return st, out
	}
	hot, hotProbes := run(target)
	_, coldProbes := run(other)
	for i := range hotProbes {
		h, c := hotProbes[i].a, coldProbes[i].a
		if h.status != http.StatusOK {
			t.Fatalf("%s: status %d %s", hotProbes[i].name, h.status, h.body)
		}
		if h.header.Get(HeaderRoute) != "" {
			t.Errorf("%s: an untrusted client got %s: %q", hotProbes[i].name, HeaderRoute, h.header.Get(HeaderRoute))
		}
		if h.status != c.status || h.cached != c.cached || !sameHeaders(h.header, c.header) {
			t.Errorf("%s: B tells a warmed prompt from a cold one:\nwarmed %d cached %d %v\ncold   %d cached %d %v",
				hotProbes[i].name, h.status, h.cached, h.header, c.status, c.cached, c.header)
		}
		if h.cached != 0 {
			t.Errorf("%s: the engine served %d of A's cached tokens", hotProbes[i].name, h.cached)
		}
	}
	// The test can fail: A sees its own prompt cached, B does not.
	if n := hot.predicted(t, target, "", keyA...); n != 96 {
		t.Errorf("the router predicts %d tokens of A's prompt for A, want 96", n)
	}
	if n := hot.predicted(t, target, "salt-a", keyA...); n != 0 {
		t.Errorf("the router predicts %d tokens for A under another client salt, want 0", n)
	}
	a := hot.send(t, target, "", append(keyA, tenancy.TokenHeader, saltToken)...)
	if _, matched, err := decisiontest.ParseRoute(a.header.Get(HeaderRoute)); err != nil || matched != 96 || a.cached != 80 {
		t.Errorf("A, trusted: route %q (%v), cached %d; want matched=96 and 80 cached", a.header.Get(HeaderRoute), err, a.cached)
	}
	hot.mu.Lock()
	defer hot.mu.Unlock()
	tenantA := cluster.TenantOf(http.Header{"Authorization": {keyA[1]}}.Get)
	first, err := openai.CacheSalt(hot.bodies[0])
	if want := tenancy.Salt("", tenantA, ""); err != nil || first != want {
		t.Errorf("the engine got A's request with cache_salt %q, want A's tenant salt %q", first, want)
	}
	for i, r := range hot.got {
		if r.Header.Get(tenancy.TokenHeader) != "" {
			t.Errorf("request %d reached an engine with the admin token header", i)
		}
		if s, _ := openai.CacheSalt(hot.bodies[i]); !strings.HasPrefix(s, tenancy.SaltPrefix) {
			t.Errorf("request %d reached an engine with cache_salt %q, not a tenant salt", i, s)
		}
	}
}

// sameHeaders compares two responses' headers but Date.
func sameHeaders(a, b http.Header) bool {
	a, b = a.Clone(), b.Clone()
	a.Del("Date")
	b.Del("Date")
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}
