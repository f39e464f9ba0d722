package epp

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http/httptest"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/promtest"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

func keyDigest(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

func scrape(t *testing.T, p *Picker) promtest.Families {
	web := httptest.NewServer(p.MetricsHandler())
	defer web.Close()
	return promtest.Scrape(t, nil, web.URL+"/metrics")
}

// TestExtProcUntrustedHeaders (issue 26, D6): by default (no
// --trust-client-headers) a request's 1ns TTFT SLO header neither sheds it
// nor moves the pool's predicted-wait threshold; the header is counted.
func TestExtProcUntrustedHeaders(t *testing.T) {
	qc := cluster.DefaultQueueConfig()
	qc.Admission.MaxInFlight = 1
	qc.Admission.EngageAfter = 0
	p := newTestPicker(t, Config{Queue: &qc}, 1)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	first := newEnvoy(t, conn)
	first.request("/v1/completions", completionBody("first", true), 1<<20, nil)
	if h, _, _ := first.decision(); h == "" {
		t.Fatal("first request not routed")
	}
	late := newEnvoy(t, conn)
	late.request("/v1/completions", completionBody("late", true), 1<<20, nil, cluster.SLOHeader, "1ns", cluster.PriorityHeader, "1000")
	waitLen(t, p, 1) // queued, not shed
	p.mu.Lock()
	thr := p.gate.StateLocked().Threshold
	p.mu.Unlock()
	if thr != admission.DefaultMaxPredictedWait {
		t.Errorf("threshold %v after an untrusted 1ns SLO, want %v", thr, admission.DefaultMaxPredictedWait)
	}
	first.respond(addr(0), "text/event-stream", []string{"data: {}\n\n", "data: [DONE]\n\n"}, nil)
	if h, _, _ := late.decision(); h == "" {
		t.Fatal("queued request not dispatched")
	}
	fams := scrape(t, p)
	for _, h := range []string{cluster.SLOHeader, cluster.PriorityHeader} {
		if v, _ := promtest.Series(fams, "prefixlb_untrusted_headers_total", "header", h); v != 1 {
			t.Errorf("untrusted %s counted %v, want 1", h, v)
		}
	}
}

// TestExtProcQuota: a tenant told by its API key reserves its tokens at the
// pick; one its bucket cannot cover gets an immediate 429 with Retry-After,
// the x-ratelimit-*-tokens headers and OpenAI's rate-limit body; a
// response carries the headers and settles to the usage it reports.
func TestExtProcQuota(t *testing.T) {
	p := newTestPicker(t, Config{Tenants: tenant.Config{Tenants: []tenant.Tenant{
		{Name: "acme", APIKeySHA256: []string{keyDigest("sk-acme")}, TokensPerMinute: 600, BurstTokens: 100},
	}}}, 1)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	body := []byte(`{"model":"m","prompt":"hi","max_tokens":60,"stream":true}`)
	first := newEnvoy(t, conn)
	first.request("/v1/completions", body, 1<<20, nil, "authorization", "Bearer sk-acme")
	if h, _, _ := first.decision(); h == "" {
		t.Fatal("first request not routed")
	}
	// 100 tokens of burst: a second reservation of 60 and more does not fit.
	second := newEnvoy(t, conn)
	second.answered = true
	second.request("/v1/completions", body, 1<<20, nil, "x-api-key", "sk-acme")
	ir := second.recv().GetImmediateResponse()
	if ir.GetStatus().GetCode() != typev3.StatusCode_TooManyRequests {
		t.Fatalf("second request: %v, want an immediate 429", ir)
	}
	got := map[string]string{}
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	if got["Retry-After"] == "" || got[cluster.HeaderLimitTokens] != "600" || got[cluster.HeaderRemainingTokens] == "" {
		t.Errorf("429 headers %v", got)
	}
	if !strings.Contains(string(ir.GetBody()), `"code":"rate_limit_exceeded"`) {
		t.Errorf("429 body %s", ir.GetBody())
	}
	// The first one's response carries the headers, and settles to its
	// usage: 7 prompt and 3 output tokens.
	first.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: hdrs(":status", "200", "content-type", "text/event-stream")}}})
	rh := first.recv().GetResponseHeaders()
	found := false
	for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
		found = found || h.GetHeader().GetKey() == cluster.HeaderRemainingTokens
	}
	if !found {
		t.Errorf("response headers %v lack %s", rh, cluster.HeaderRemainingTokens)
	}
	first.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte(`data: {"choices":[{"text":"a"}]}` + "\n\n" + `data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}` + "\n\ndata: [DONE]\n\n"), EndOfStream: true}}})
	first.recv()
	fams := scrape(t, p)
	if v, _ := promtest.Series(fams, "prefixlb_quota_tokens_total", "tenant", "acme"); v != 10 {
		t.Errorf("charged %v tokens, want 10 (the usage)", v)
	}
	if v, _ := promtest.Series(fams, "prefixlb_quota_rejected_total", "tenant", "acme"); v != 1 {
		t.Errorf("rejected %v, want 1", v)
	}
}

func TestExtProcRequireTenant(t *testing.T) {
	p := newTestPicker(t, Config{Tenants: tenant.Config{RequireTenant: true, Tenants: []tenant.Tenant{{Name: "a", APIKeySHA256: []string{keyDigest("k")}}}}}, 1)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
	e.answered = true
	e.request("/v1/completions", completionBody("x", false), 1<<20, nil, "authorization", "Bearer wrong")
	if code := e.immediate(); code != typev3.StatusCode_Unauthorized {
		t.Errorf("unknown key: %v, want 401", code)
	}
	if _, err := NewPicker(Config{Tenants: tenant.Config{TrustedProxies: []string{"10.0.0.0/8"}}}); err == nil {
		t.Error("epp accepted trusted_proxies")
	}
}
