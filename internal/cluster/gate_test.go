package cluster

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/quota"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

var g0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func hdr(kv ...string) func(string) string {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h.Get
}

// TestClassifyTrust (issue 26, D6): an untrusted request's priority and SLO
// headers are not read (its class applies), a trusted one's are, and a
// trusted SLO is raised to the floor.
func TestClassifyTrust(t *testing.T) {
	c := DefaultQueueConfig()
	c.Classes = []Class{{Tenant: "acme", Priority: 3, TTFTSLO: "5s"}}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	get := hdr(PriorityHeader, "9", SLOHeader, "2ns")
	for _, tc := range []struct {
		name    string
		id      tenant.Identity
		prio    int
		slo     time.Duration
		wantErr bool
	}{
		{"untrusted: the class", tenant.Identity{Tenant: "acme", Known: true}, 3, 5 * time.Second, false},
		{"untrusted, no class", tenant.Identity{Tenant: "key-123"}, 0, 0, false},
		{"trusted: headers, SLO floored", tenant.Identity{Tenant: "acme", Known: true, Trusted: true}, 9, admission.DefaultMinTTFTSLO, false},
	} {
		tk := admission.Ticket{Arrival: g0}
		err := c.Classify(&tk, "m", &tc.id, get)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		var slo time.Duration
		if !tk.Deadline.IsZero() {
			slo = tk.Deadline.Sub(tk.Arrival)
		}
		if tk.Tenant != tc.id.Tenant || tk.Priority != tc.prio || slo != tc.slo {
			t.Errorf("%s: tenant %q priority %d SLO %v, want %q %d %v", tc.name, tk.Tenant, tk.Priority, slo, tc.id.Tenant, tc.prio, tc.slo)
		}
	}
	// A malformed header is an error only where it is read.
	bad := hdr(PriorityHeader, "high")
	if err := c.Classify(&admission.Ticket{Arrival: g0}, "m", &tenant.Identity{}, bad); err != nil {
		t.Errorf("untrusted malformed header: %v", err)
	}
	if err := c.Classify(&admission.Ticket{Arrival: g0}, "m", &tenant.Identity{Trusted: true}, bad); !errors.Is(err, ErrBadClass) {
		t.Errorf("trusted malformed header: %v, want ErrBadClass", err)
	}
}

func countSeries(t *testing.T, m *GateMetrics) int {
	t.Helper()
	return testutil.CollectAndCount(m.length) + testutil.CollectAndCount(m.wait) + testutil.CollectAndCount(m.dispatchC)
}

// TestGateMetricsBounded (issue 26, D6: 6 → 366 series after 20 queued
// requests): the tenant label is a configured name or "other", however
// many tenants queue, and a priority's and tenant's series go SeriesTTL
// after their last request.
func TestGateMetricsBounded(t *testing.T) {
	m, err := NewGateMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultQueueConfig()
	cfg.Tenants = []string{"acme"}
	cfg.Classes = []Class{{Tenant: "batch", Priority: -1}}
	m.know(&cfg)
	for i := range 200 {
		tk := &admission.Ticket{Tenant: fmt.Sprintf("key-%012x", i), Arrival: g0}
		m.enqueued(tk)
		m.dispatched(tk, g0.Add(time.Millisecond))
	}
	for _, name := range []string{"acme", "batch"} {
		tk := &admission.Ticket{Tenant: name, Arrival: g0}
		m.enqueued(tk)
		m.dispatched(tk, g0.Add(time.Millisecond))
	}
	// Three tenant labels (acme, batch, other) at one priority: a gauge,
	// a histogram and a counter each.
	if n := countSeries(t, m); n != 9 {
		t.Errorf("%d series after 202 tenants, want 9 (acme, batch, other × 3 metrics)", n)
	}
	out, _ := testutil.CollectAndFormat(m.dispatchC, expfmt.TypeTextPlain)
	if strings.Contains(string(out), "key-") {
		t.Errorf("an anonymous tenant is a label:\n%s", out)
	}

	// A tenant still waiting keeps its series; the others go SeriesTTL
	// after their last request.
	waiting := &admission.Ticket{Tenant: "acme", Priority: 5, Arrival: g0.Add(time.Minute)}
	m.enqueued(waiting)
	m.sweepLocked(g0.Add(SeriesTTL - time.Second))
	if n := countSeries(t, m); n != 10 {
		t.Errorf("%d series before the TTL, want 10", n)
	}
	m.sweepLocked(g0.Add(time.Hour))
	// Left: acme at priority 5 (its gauge) and acme's dispatched counter.
	if n := countSeries(t, m); n != 2 {
		got, _ := testutil.CollectAndFormat(m.length, expfmt.TypeTextPlain)
		t.Errorf("%d series after the TTL, want 2 (acme waiting):\n%s", n, got)
	}
	m.cancelled(waiting)
	m.sweepLocked(g0.Add(2 * time.Hour))
	if n := countSeries(t, m); n != 0 {
		t.Errorf("%d series once everything left, want 0", n)
	}
	// A tenant that comes back gets its series again.
	m.enqueued(&admission.Ticket{Tenant: "acme", Arrival: g0.Add(3 * time.Hour)})
	if got := testutil.ToFloat64(m.length.WithLabelValues("0", "acme")); got != 1 {
		t.Errorf("acme's queue length after its return: %v", got)
	}
}

// sha is key's hex SHA-256, as api_key_sha256 lists it.
func sha(key string) string { return fmt.Sprintf("%x", sha256.Sum256([]byte(key))) }

func TestTenantsIdentifyAndQuota(t *testing.T) {
	reg := prometheus.NewRegistry()
	ts, err := NewTenants(tenant.Config{
		Tenants: []tenant.Tenant{
			{Name: "acme", APIKeySHA256: []string{sha("sk-acme")}, TokensPerMinute: 600},
			{Name: "free", APIKeySHA256: []string{sha("sk-free")}},
		},
		TrustedProxies:           []string{"10.0.0.0/8"},
		AnonymousTokensPerMinute: 60,
	}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	// A client claiming acme by header is anonymous, counted.
	id, err := ts.Identify(hdr(TenantHeader, "acme", SLOHeader, "1ns"), "127.0.0.1:9")
	if err != nil || id.Known || id.Tenant != "" {
		t.Errorf("untrusted claim: %+v %v", id, err)
	}
	if got := testutil.ToFloat64(ts.untrusted.WithLabelValues(SLOHeader)); got != 1 {
		t.Errorf("untrusted SLO headers counted %v, want 1", got)
	}
	// The gateway may name it.
	if id, _ := ts.Identify(hdr(TenantHeader, "acme"), "10.1.1.1:9"); !id.Known || id.Tenant != "acme" {
		t.Errorf("trusted gateway: %+v", id)
	}
	acme, _ := ts.Identify(hdr("Authorization", "Bearer sk-acme"), "127.0.0.1:9")
	h, err := ts.Reserve(&acme, 100, 200, g0)
	if err != nil || !h.Held() || h.Prompt() != 100 {
		t.Fatalf("Reserve: %+v %v", h, err)
	}
	if rh := h.RateHeaders(); len(rh) != 3 || rh[1] != [2]string{HeaderRemainingTokens, "300"} || rh[2] != [2]string{HeaderResetTokens, "30s"} {
		t.Errorf("RateHeaders = %v, want 300 remaining, reset 30s", rh)
	}
	// Without max_tokens the output estimate is DefaultOutputTokens: 100 +
	// 256 > 300 left.
	_, err = ts.Reserve(&acme, 100, 0, g0)
	hdrs, body, ok := QuotaAnswer(err)
	if !ok || !errors.Is(err, quota.ErrExceeded) {
		t.Fatalf("over the quota: %v", err)
	}
	if hdrs[0] != [2]string{"Retry-After", "6"} || hdrs[1] != [2]string{HeaderRetryAfterMs, "5600"} {
		t.Errorf("429 headers %v, want Retry-After 6 (56 tokens at 10/s), retry-after-ms 5600", hdrs)
	}
	if !strings.Contains(string(body), `"code":"rate_limit_exceeded"`) || !strings.Contains(string(body), `"type":"tokens"`) {
		t.Errorf("429 body %s", body)
	}
	if got := testutil.ToFloat64(ts.rejected.WithLabelValues("acme")); got != 1 {
		t.Errorf("rejected{acme} = %v", got)
	}
	h.Settle(150, g0)
	if got := testutil.ToFloat64(ts.tokens.WithLabelValues("acme")); got != 150 {
		t.Errorf("tokens{acme} = %v", got)
	}
	// A configured tenant without a quota holds nothing; anonymous
	// requests share the anonymous bucket.
	free, _ := ts.Identify(hdr("x-api-key", "sk-free"), "")
	if h, err := ts.Reserve(&free, 1<<20, 0, g0); err != nil || h.Held() || h.RateHeaders() != nil {
		t.Errorf("no quota: %+v %v", h, err)
	}
	anon, _ := ts.Identify(hdr("Authorization", "Bearer sk-random-1"), "")
	if _, err := ts.Reserve(&anon, 10, 10, g0); err != nil {
		t.Errorf("anonymous within its quota: %v", err)
	}
	anon2, _ := ts.Identify(hdr("Authorization", "Bearer sk-random-2"), "")
	if _, err := ts.Reserve(&anon2, 35, 10, g0); !errors.Is(err, quota.ErrExceeded) {
		t.Errorf("a second anonymous key draws from the same bucket: %v", err)
	}
	if _, _, ok := QuotaAnswer(errors.New("other")); ok {
		t.Error("QuotaAnswer of another error")
	}
}

func TestTenantsRequire(t *testing.T) {
	ts, err := NewTenants(tenant.Config{RequireTenant: true, Tenants: []tenant.Tenant{{Name: "a", APIKeySHA256: []string{sha("k")}}}}, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ts.Identify(hdr("Authorization", "Bearer nope"), ""); !errors.Is(err, ErrUnknownTenant) {
		t.Errorf("unknown key: %v", err)
	}
	if got := testutil.ToFloat64(ts.unknown); got != 1 {
		t.Errorf("unknown counted %v", got)
	}
	if _, err := NewTenants(tenant.Config{Tenants: []tenant.Tenant{{Name: "other"}}}, nil, prometheus.NewRegistry()); !errors.Is(err, tenant.ErrConfig) {
		t.Errorf("invalid config: %v", err)
	}
}
