package proxy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// TestExplainSetting: x-prefixlb-route goes to the clients the explain
// setting allows — by default only those presenting the admin token, in
// its own header or as a bearer token, and nobody without a token — while
// x-prefixlb-replica goes to everyone.
func TestExplainSetting(t *testing.T) {
	tests := []struct {
		name    string
		mode    tenancy.Explain
		token   string
		headers []string
		want    bool
	}{
		{"default, untrusted", "", "tok", nil, false},
		{"default, token header", "", "tok", []string{tenancy.TokenHeader, "tok"}, true},
		{"default, bearer", "", "tok", []string{"Authorization", "Bearer tok"}, true},
		{"default, wrong token", "", "tok", []string{tenancy.TokenHeader, "nope"}, false},
		{"trusted without a token", tenancy.ExplainTrusted, "", []string{tenancy.TokenHeader, ""}, false},
		{"never, even with the token", tenancy.ExplainNever, "tok", []string{tenancy.TokenHeader, "tok"}, false},
		{"always", tenancy.ExplainAlways, "", nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep := newFakeReplica(t, "r0")
			cfg := testConfig(rep)
			cfg.Explain, cfg.AdminToken = tt.mode, tt.token
			_, srv := startProxy(t, cfg)
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(plainBody))
			req.Header.Set("Content-Type", "application/json")
			for i := 0; i+1 < len(tt.headers); i += 2 {
				req.Header.Set(tt.headers[i], tt.headers[i+1])
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if got := resp.Header.Get(HeaderRoute) != ""; got != tt.want {
				t.Errorf("%s present %v, want %v", HeaderRoute, got, tt.want)
			}
			if resp.Header.Get(HeaderReplica) != "r0" {
				t.Errorf("%s = %q, want r0", HeaderReplica, resp.Header.Get(HeaderReplica))
			}
		})
	}
}

// TestConfigTenancy: the YAML keys and their validation.
func TestConfigTenancy(t *testing.T) {
	c, err := ParseConfig([]byte("explain: never\ntenant_isolation: true\ntenant_salt_secret: k\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.Explain != tenancy.ExplainNever || !c.TenantIsolation || c.TenantSaltSecret != "k" {
		t.Errorf("parsed %q %v %q", c.Explain, c.TenantIsolation, c.TenantSaltSecret)
	}
	if d := DefaultConfig(); d.Explain != tenancy.ExplainTrusted || d.TenantIsolation {
		t.Errorf("defaults: explain %q, tenant isolation %v; want trusted, off", d.Explain, d.TenantIsolation)
	}
	c, _ = ParseConfig([]byte("explain: sometimes\nbackends:\n  - url: http://a:1\n"), DefaultConfig())
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "explain") {
		t.Errorf("explain: sometimes: %v, want an error naming explain", err)
	}
}
