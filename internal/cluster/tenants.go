package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/quota"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// Tenants is a front door's tenants: who each request is from
// (tenant.Resolver: configured API keys, a trusted gateway's headers) and
// their token quotas (quota.Limiter), with their metrics. Both front doors
// hold one; it is safe for concurrent use.
type Tenants struct {
	res *tenant.Resolver
	lim *quota.Limiter

	untrusted *prometheus.CounterVec
	rejected  *prometheus.CounterVec
	tokens    *prometheus.CounterVec
	unknown   prometheus.Counter
}

// NewTenants builds the tenants of cfg (validated here; getenv reads the
// API keys of api_keys_env) and registers their metrics on reg:
//
//	prefixlb_untrusted_headers_total{header}   class headers ignored from untrusted peers
//	prefixlb_quota_rejected_total{tenant}      requests refused 429 over their tenant's quota
//	prefixlb_quota_tokens_total{tenant}        tokens settled against a quota
//	prefixlb_tenant_unknown_total              requests refused 401 under require_tenant
//
// tenant is a configured tenant's name, or tenant.Other for the anonymous
// quota.
func NewTenants(cfg tenant.Config, getenv func(string) string, reg prometheus.Registerer) (*Tenants, error) {
	res, err := tenant.New(cfg, getenv)
	if err != nil {
		return nil, err
	}
	lim, err := quota.New(cfg.Limits())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", tenant.ErrConfig, err)
	}
	t := &Tenants{res: res, lim: lim,
		untrusted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "prefixlb_untrusted_headers_total",
			Help: "Class headers (x-prefixlb-tenant, -priority, -ttft-slo) ignored because the request's peer is not a trusted proxy, by header."}, []string{"header"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "prefixlb_quota_rejected_total",
			Help: "Requests refused with 429 because their tenant's token quota could not cover them, by tenant."}, []string{"tenant"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "prefixlb_quota_tokens_total",
			Help: "Prompt and output tokens charged to a tenant's quota, by tenant."}, []string{"tenant"}),
		unknown: prometheus.NewCounter(prometheus.CounterOpts{Name: "prefixlb_tenant_unknown_total",
			Help: "Requests refused with 401 because no configured tenant has their API key (require_tenant)."}),
	}
	for _, c := range []prometheus.Collector{t.untrusted, t.rejected, t.tokens, t.unknown} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, h := range tenant.ClassHeaders {
		t.untrusted.WithLabelValues(h)
	}
	for _, name := range lim.Tenants() {
		t.rejected.WithLabelValues(name)
		t.tokens.WithLabelValues(name)
	}
	return t, nil
}

// ErrUnknownTenant is returned by Identify, with require_tenant, for a
// request that is no configured tenant's (401 at the HTTP edge).
var ErrUnknownTenant = tenant.ErrUnknown

// Identify tells who a request is from: its headers (get, by name in any
// case) and its TCP peer (remoteAddr, "ip:port"; "" when the front door
// knows none, as epp behind its gateway) decide (tenant.Resolver.Resolve).
// Class headers from an untrusted peer are counted and ignored. With
// require_tenant a request that is no configured tenant's is an error
// wrapping ErrUnknownTenant. Identity.Tenant is the request's tenant for
// the queue's fair share and for anything keyed per tenant (a cache salt).
func (t *Tenants) Identify(get func(string) string, remoteAddr string) (tenant.Identity, error) {
	id := t.res.Resolve(get, t.res.TrustedPeer(remoteAddr))
	for i, h := range tenant.ClassHeaders {
		if id.Ignored&(1<<i) != 0 {
			t.untrusted.WithLabelValues(h).Inc()
		}
	}
	if err := t.res.Check(&id); err != nil {
		t.unknown.Inc()
		return id, err
	}
	return id, nil
}

// quotaKey is the bucket a request of id draws from: its configured
// tenant's, else the anonymous one.
func quotaKey(id *tenant.Identity) string {
	if id.Known {
		return id.Tenant
	}
	return tenant.Other
}

// Hold is one request's reservation against its tenant's quota, from
// Reserve to Settle. The zero Hold (a tenant without a quota) does
// nothing.
type Hold struct {
	t      *Tenants
	r      quota.Reservation
	key    string
	prompt int64
	state  quota.State
}

// Held reports whether the request's tenant has a quota (its responses
// carry RateHeaders) and the hold is not settled.
func (h *Hold) Held() bool { return h.r.Held() }

// Prompt is the prompt tokens the hold reserved.
func (h *Hold) Prompt() int64 { return h.prompt }

// Reserved is all the hold took from its bucket.
func (h *Hold) Reserved() int64 { return h.r.Tokens() }

// Reserve reserves a request's tokens from its tenant's quota at now:
// promptTokens (the router's count) and maxTokens of output, or
// quota.DefaultOutputTokens when it sets none. Over the quota it returns
// an error wrapping a *quota.ExceededError (429 with Retry-After at the
// HTTP edge), counted.
func (t *Tenants) Reserve(id *tenant.Identity, promptTokens, maxTokens int, now time.Time) (Hold, error) {
	key := quotaKey(id)
	if !t.lim.Has(key) {
		return Hold{}, nil
	}
	out := int64(maxTokens)
	if out <= 0 {
		out = quota.DefaultOutputTokens
	}
	prompt := int64(max(promptTokens, 0))
	r, err := t.lim.Reserve(key, prompt+out, now)
	if err != nil {
		t.rejected.WithLabelValues(key).Inc()
		return Hold{}, err
	}
	h := Hold{t: t, r: r, key: key, prompt: prompt}
	h.state, _ = t.lim.State(key, now)
	return h, nil
}

// Settle ends the hold: the request used used tokens (prompt plus output;
// 0 refunds a request that failed). Settling twice does nothing.
func (h *Hold) Settle(used int64, now time.Time) {
	if !h.r.Held() {
		return
	}
	h.r.Settle(used, now)
	if used > 0 {
		h.t.tokens.WithLabelValues(h.key).Add(float64(used))
	}
}

// Rate-limit response headers, OpenAI's names
// (platform.openai.com/docs/guides/rate-limits, "Rate limits in headers").
const (
	HeaderLimitTokens     = "x-ratelimit-limit-tokens"
	HeaderRemainingTokens = "x-ratelimit-remaining-tokens"
	HeaderResetTokens     = "x-ratelimit-reset-tokens"
	// HeaderRetryAfterMs is Retry-After in milliseconds, which OpenAI's
	// Python client reads before Retry-After.
	HeaderRetryAfterMs = "retry-after-ms"
)

// RateHeaders are the x-ratelimit-*-tokens headers of a held request, its
// bucket as it was once its tokens were reserved; nil without a quota.
func (h *Hold) RateHeaders() [][2]string {
	if h.t == nil {
		return nil
	}
	return rateHeaders(h.state)
}

func rateHeaders(s quota.State) [][2]string {
	return [][2]string{
		{HeaderLimitTokens, strconv.FormatInt(s.Limit, 10)},
		{HeaderRemainingTokens, strconv.FormatInt(s.Remaining, 10)},
		{HeaderResetTokens, resetString(s.Reset)},
	}
}

// resetString is a duration as OpenAI's reset headers write it ("6m0s",
// "1.5s", "20ms"): Go's form, to the millisecond.
func resetString(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	return d.Round(time.Millisecond).String()
}

// QuotaAnswer is what a request over its quota is answered: 429's headers
// (Retry-After in whole seconds, at least 1; retry-after-ms; the
// x-ratelimit-*-tokens of the bucket) and an OpenAI rate-limit error body
// ({"error": {"message", "type": "tokens", "param": null, "code":
// "rate_limit_exceeded"}}, as OpenAI answers a tokens-per-minute limit).
// ok is false when err is no quota error.
func QuotaAnswer(err error) (headers [][2]string, body []byte, ok bool) {
	var ee *quota.ExceededError
	if !errors.As(err, &ee) {
		return nil, nil, false
	}
	secs := max(1, int64(math.Ceil(ee.RetryAfter.Seconds())))
	headers = append([][2]string{
		{"Retry-After", strconv.FormatInt(secs, 10)},
		{HeaderRetryAfterMs, strconv.FormatInt(max(1, ee.RetryAfter.Milliseconds()), 10)},
	}, rateHeaders(ee.State)...)
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    string  `json:"code"`
		} `json:"error"`
	}
	e.Error.Message = fmt.Sprintf("Rate limit reached for tenant %s on tokens per min (TPM): Limit %d, Remaining %d, Requested %d. Please try again in %s.",
		ee.Tenant, ee.State.Limit, ee.State.Remaining, ee.Requested, resetString(ee.RetryAfter))
	e.Error.Type, e.Error.Code = "tokens", "rate_limit_exceeded"
	body, _ = json.Marshal(e)
	return headers, body, true
}
