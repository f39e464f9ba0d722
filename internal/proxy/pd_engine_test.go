package proxy

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/promtest"
)

// TestPDOverEngines runs the two-leg protocol end to end over prefixlb
// engines on loopback — 1 prefill + 2 decode engines, then 2 + 2 — streamed
// and unary, completions and chat: every request is answered, names its
// prefill and decode engines, and the decode engines pull the KV the
// prefill engines computed (their pull counters), as vLLM's NixlConnector
// does.
func TestPDOverEngines(t *testing.T) {
	for _, split := range []struct{ prefill, decode int }{{1, 2}, {2, 2}} {
		t.Run(fmt.Sprintf("%dP+%dD", split.prefill, split.decode), func(t *testing.T) {
			role := func(r string) func(*engine.Config) { return func(c *engine.Config) { c.Replica.Role = r } }
			pre := startEngines(t, split.prefill, role("prefill"))
			dec := startEngines(t, split.decode, role("decode"))
			cfg := testConfig()
			for i, b := range pre {
				b.Name, b.Role = fmt.Sprintf("p%d", i), "prefill"
				cfg.Backends = append(cfg.Backends, b)
			}
			for i, b := range dec {
				b.Name, b.Role = fmt.Sprintf("d%d", i), "decode"
				cfg.Backends = append(cfg.Backends, b)
			}
			cfg.Policy = "round-robin-pd"
			_, srv := startProxy(t, cfg)
			prompt := strings.Repeat("the repository file and its long shared context ", 40)
			bodies := []struct{ path, body string }{
				{"/v1/completions", `{"model":"prefixlb-sim","prompt":"` + prompt + `a","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`},
				{"/v1/completions", `{"model":"prefixlb-sim","prompt":"` + prompt + `b","max_tokens":4}`},
				{"/v1/chat/completions", `{"model":"prefixlb-sim","messages":[{"role":"user","content":"` + prompt + `c"}],"max_tokens":4,"stream":true}`},
				{"/v1/chat/completions", `{"model":"prefixlb-sim","messages":[{"role":"user","content":"` + prompt + `d"}],"max_completion_tokens":4}`},
			}
			prefillSeen := map[string]bool{}
			for _, b := range bodies {
				resp := post(t, srv.URL, b.path, b.body)
				got := readAll(t, resp)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: status %d: %s", b.path, resp.StatusCode, got)
				}
				p, d := resp.Header.Get(HeaderPrefillReplica), resp.Header.Get(HeaderReplica)
				if !strings.HasPrefix(p, "p") || !strings.HasPrefix(d, "d") {
					t.Errorf("%s: prefill %q, decode %q", b.path, p, d)
				}
				prefillSeen[p] = true
				if strings.Contains(b.body, `"stream":true`) && !strings.Contains(string(got), "data: [DONE]") {
					t.Errorf("%s: stream not ended: %s", b.path, got)
				}
			}
			if len(prefillSeen) != split.prefill {
				t.Errorf("prefill engines used %v, want all %d", prefillSeen, split.prefill)
			}
			pulls := 0.0
			for _, b := range dec {
				m := promtest.Scrape(t, http.DefaultClient, b.URL+"/metrics")
				v, _ := promtest.Sum(m, "prefixlb_engine_kv_pull_total")
				pulls += v
			}
			if pulls != float64(len(bodies)) {
				t.Errorf("the decode engines pulled %v times, want %d (one per request)", pulls, len(bodies))
			}
			m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
			if v, _ := promtest.Series(m, "prefixlb_pd_requests_total", "outcome", "disaggregated"); v != float64(len(bodies)) {
				t.Errorf("prefixlb_pd_requests_total{outcome=disaggregated} = %v, want %d", v, len(bodies))
			}
		})
	}
}
