package epp

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// TestPickTenantIsolation: with TenantIsolation the body the replica gets
// carries the tenant's salt, whatever cache_salt the client sent, and the
// keys use it: a tenant's repeat matches its own prompt, another tenant's
// identical prompt matches nothing. Without it, the client's cache_salt
// alone keys the request and the body goes on as it came.
func TestPickTenantIsolation(t *testing.T) {
	prompt := strings.Repeat("the same long shared system prompt. ", 30)
	body := []byte(`{"model":"m","prompt":"` + prompt + `","max_tokens":4,"cache_salt":"client"}`)
	hdr := func(key string) func(string) string {
		h := http.Header{"Authorization": {"Bearer " + key}}
		return func(k string) string { return h.Get(k) }
	}
	pick := func(p *Picker, key string) Pick {
		t.Helper()
		pk, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: body, Explain: true, Header: hdr(key)})
		if err != nil {
			t.Fatal(err)
		}
		p.Finish(pk.ID, router.Finish{OK: true})
		return pk
	}
	p := newTestPicker(t, Config{TenantIsolation: true, TenantSaltSecret: "k"}, 2)
	a1 := pick(p, "key-a")
	wantA := tenancy.Salt("k", cluster.TenantOf(hdr("key-a")), "client")
	if got, err := openai.CacheSalt(a1.Body); err != nil || got != wantA {
		t.Fatalf("the replica gets cache_salt %q (%v), want tenant a's %q", got, err, wantA)
	}
	a2 := pick(p, "key-a")
	b := pick(p, "key-b")
	if a2.Decision.MatchedTokens == 0 {
		t.Error("tenant a's repeat matches nothing of its own prompt")
	}
	if b.Decision.MatchedTokens != 0 {
		t.Errorf("tenant b matches %d tokens of tenant a's prompt", b.Decision.MatchedTokens)
	}
	if got, _ := openai.CacheSalt(b.Body); got == wantA || !strings.HasPrefix(got, tenancy.SaltPrefix) {
		t.Errorf("tenant b's body carries %q", got)
	}

	off := newTestPicker(t, Config{}, 2)
	o1 := pick(off, "key-a")
	o2 := pick(off, "key-b")
	if o1.Body != nil || o2.Decision.MatchedTokens == 0 {
		t.Errorf("isolation off: body %q, b's match %d; want the body as it came and a shared match", o1.Body, o2.Decision.MatchedTokens)
	}
}

// TestServerIsolatesTenant: through ext_proc, the body the gateway
// forwards carries the rewritten model and the tenant's cache_salt in
// place of the client's, with its new content-length.
func TestServerIsolatesTenant(t *testing.T) {
	p := newTestPicker(t, Config{TenantIsolation: true, TenantSaltSecret: "k"}, 2)
	rs, err := ParseModelRewrites([]byte(rewriteYAML), "qwen")
	if err != nil {
		t.Fatal(err)
	}
	p.SetModelRewrites(rs)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{Logger: slog.New(slog.DiscardHandler)})))
	body := `{"model":"chat","prompt":"hello there","max_tokens":3,"cache_salt":"client"}`
	e.request("/v1/completions", []byte(body), 8, nil, "authorization", "Bearer key-a")
	_, _, out := e.decision()
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	h := http.Header{"Authorization": {"Bearer key-a"}}
	want := tenancy.Salt("k", cluster.TenantOf(h.Get), "client")
	if m["model"] != "chat-v7" || m["cache_salt"] != want || m["prompt"] != "hello there" {
		t.Errorf("forwarded body %s; want model chat-v7 and cache_salt %s", out, want)
	}
}
