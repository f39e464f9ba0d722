package proxy

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// tenantState is an exchange's tenant and quota: who the request is from
// (identify), the tokens it holds from its tenant's quota (reserve), and
// what the replica reported it used (served, from done).
type tenantState struct {
	who  tenant.Identity
	hold cluster.Hold
	// served is set once the request was answered (exchange.done), with
	// the output tokens it produced.
	served    bool
	outTokens int
}

// answered records what the answered request used (called from done).
func (t *tenantState) answered(fin *router.Finish) { t.served, t.outTokens = true, fin.OutputTokens }

// identify tells who the request is from (cluster.Tenants.Identify: a
// configured API key, or a trusted proxy's x-prefixlb-tenant, else
// anonymous) and keeps it in x.tq.who: the queue classes the request by
// it, its quota is its tenant's, and anything keyed per tenant reads
// x.tq.who.Tenant. It answers 401 and reports false, under require_tenant,
// for a request that is no configured tenant's.
func (x *exchange) identify() bool {
	id, err := x.p.tenants.Identify(x.r.Header.Get, x.r.RemoteAddr)
	x.tq.who = id
	if err != nil {
		x.code = strconv.Itoa(writeError(x.w, fmt.Errorf("proxy: %w: %w", ErrUnauthorized, err)))
		return false
	}
	return true
}

// reserve takes the request's tokens from its tenant's quota before it is
// routed: promptTokens (the router's count) and maxTokens of output
// (quota.DefaultOutputTokens when it sets none). Over the quota it answers
// 429 with Retry-After and an OpenAI rate-limit body, and reports false.
// A tenant with a quota gets the x-ratelimit-*-tokens headers on every
// response. Settle with settle when the exchange ends.
func (x *exchange) reserve(promptTokens, maxTokens int) bool {
	h, err := x.p.tenants.Reserve(&x.tq.who, promptTokens, maxTokens, time.Now())
	if err != nil {
		hdrs, body, _ := cluster.QuotaAnswer(err)
		wh := x.w.Header()
		for _, kv := range hdrs {
			wh.Set(kv[0], kv[1])
		}
		wh.Set("Content-Type", "application/json")
		x.w.WriteHeader(http.StatusTooManyRequests)
		_, _ = x.w.Write(body)
		x.code = strconv.Itoa(http.StatusTooManyRequests)
		return false
	}
	x.tq.hold = h
	for _, kv := range h.RateHeaders() {
		x.w.Header().Set(kv[0], kv[1])
	}
	return true
}

// settle ends the request's hold on its tenant's quota, once the exchange
// is over (serveInference's return: the one place every request ends):
//   - answered: the prompt tokens and the output the replica reported
//     (usage.completion_tokens, else the tokens counted in the stream);
//   - a stream cut after its first bytes (the client left, or the replica
//     failed): the whole reservation, since the router cannot tell how much
//     was generated, and refunding it would make cancelling at the last
//     token a way round the quota;
//   - anything else (shed, refused, a replica's error status, no replica,
//     the client gone before the first byte): refunded.
func (x *exchange) settle() {
	h := &x.tq.hold
	if !h.Held() {
		return
	}
	var used int64
	switch {
	case x.tq.served:
		used = h.Prompt() + int64(max(x.tq.outTokens, 0))
	case x.wrote && (x.code == "aborted" || x.code == "cancelled"):
		used = h.Reserved()
	}
	h.Settle(used, time.Now())
}
