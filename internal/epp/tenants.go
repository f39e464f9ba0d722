package epp

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// newTenants builds the picker's tenants from cfg.Tenants (API keys of
// api_keys_env read from the environment), registering their metrics on
// reg, and gives the queue's metrics the configured tenants' names.
// TrustedProxies cannot apply: behind Envoy every request's peer is the
// gateway (TrustClientHeaders says whether it strips client-set headers).
func newTenants(cfg *Config, reg prometheus.Registerer) (*cluster.Tenants, error) {
	if len(cfg.Tenants.TrustedProxies) > 0 {
		return nil, errors.New("epp: tenants: trusted_proxies does not apply to epp, whose every request comes from the gateway: use --trust-client-headers when the gateway strips client-set x-prefixlb-* headers")
	}
	t, err := cluster.NewTenants(cfg.Tenants, os.Getenv, reg)
	if err != nil {
		return nil, fmt.Errorf("epp: %w", err)
	}
	if cfg.Queue != nil {
		q := *cfg.Queue
		q.Tenants = cfg.Tenants.Names()
		cfg.Queue = &q
	}
	return t, nil
}

// headerOf is in's header getter (none: every header empty).
func headerOf(in Input) func(string) string {
	if in.Header != nil {
		return in.Header
	}
	return func(string) string { return "" }
}

// identify tells who in is from (cluster.Tenants.Identify, with no peer
// address: the gateway is every request's peer). Under require_tenant a
// request that is no configured tenant's is an error wrapping
// cluster.ErrUnknownTenant (401). Pick.Tenant carries the answer, and
// Identity.Tenant is what anything keyed per tenant reads.
func (p *Picker) identify(in Input) (tenant.Identity, error) {
	id, err := p.tenants.Identify(headerOf(in), "")
	if err != nil {
		return id, fmt.Errorf("epp: %w", err)
	}
	return id, nil
}

// tenantImmediate answers a request its tenant cannot send, when err says
// so: 401 under require_tenant, 429 over its quota (with Retry-After,
// retry-after-ms, the x-ratelimit-*-tokens headers and OpenAI's
// rate-limit error body). ok is false for any other error.
func (x *exchange) tenantImmediate(err error) (ok bool, sendErr error) {
	if errors.Is(err, cluster.ErrUnknownTenant) {
		return true, x.immediate(typev3.StatusCode_Unauthorized, err.Error())
	}
	hdrs, body, isQuota := cluster.QuotaAnswer(err)
	if !isQuota {
		return false, nil
	}
	code := typev3.StatusCode_TooManyRequests
	x.s.p.m.immediate.WithLabelValues(strconv.Itoa(int(code))).Inc()
	set := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}
	for _, kv := range hdrs {
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])}})
	}
	return true, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: code},
			Body:    body,
			Details: "prefixlb_epp: over the tenant's token quota",
			Headers: &extprocv3.HeaderMutation{SetHeaders: set},
		}}})
}

// rateHeaders is the response-headers mutation that adds the
// x-ratelimit-*-tokens headers of a request whose tenant has a quota (nil:
// none).
func (x *exchange) rateHeaders() *extprocv3.CommonResponse {
	if !x.picked {
		return nil
	}
	hs := x.pick.hold.RateHeaders()
	if len(hs) == 0 {
		return nil
	}
	set := make([]*corev3.HeaderValueOption, 0, len(hs))
	for _, kv := range hs {
		set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])}})
	}
	return &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
}

// settleQuota settles the request's hold when its response ends (finish):
// an answered request is charged its prompt tokens (usage.prompt_tokens,
// else the router's count) and its output (usage.completion_tokens, else
// the tokens counted in the stream, also for a stream its client left);
// a failed one is refunded.
func (x *exchange) settleQuota(out int, ok bool) {
	h := &x.pick.hold
	if !h.Held() {
		return
	}
	var used int64
	if ok {
		prompt := h.Prompt()
		if u := x.watch.Usage; u != nil && u.PromptTokens > 0 {
			prompt = int64(u.PromptTokens)
		}
		used = prompt + int64(max(out, 0))
	}
	h.Settle(used, time.Now())
}
