package proxy

import (
	"net/http"
	"strings"

	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// What a client learns of the cache, and tenant isolation
// (docs/security.md):
//
//   - x-prefixlb-route (the decision explained: matched tokens per
//     replica) goes only to the clients Config.Explain allows: by default
//     those that present the admin token. It is a block-exact oracle of
//     what the replicas cache.
//   - x-prefixlb-replica, x-prefixlb-prefill-replica and
//     x-prefixlb-retries go to every client: they name no cached content,
//     benches and the chaos suite read them, and for a salted request
//     (the only one vLLM shields from other tenants: an unsalted prompt's
//     hit shows in its TTFT anyway) the decision depends on no other
//     salt's blocks, since its keys never match them.
//   - With Config.TenantIsolation every request is salted with its tenant
//     (tenancy.Isolation.Apply) before it is keyed, and forwarded with
//     that cache_salt.

// trusted reports whether a request with headers h presents the admin
// token: in tenancy.TokenHeader, or as Authorization: Bearer (as /debug/*
// takes it). Nobody is trusted without a configured token.
func (p *Proxy) trusted(h http.Header) bool {
	if p.cfg.AdminToken == "" {
		return false
	}
	if v := h.Get(tenancy.TokenHeader); v != "" && tokenMatches(strings.TrimSpace(v), p.adminTok) {
		return true
	}
	bearer, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	return ok && tokenMatches(strings.TrimSpace(bearer), p.adminTok)
}

// explainMode is Config.Explain, tenancy.ExplainTrusted when unset.
func (p *Proxy) explainMode() tenancy.Explain {
	if p.cfg.Explain == "" {
		return tenancy.ExplainTrusted
	}
	return p.cfg.Explain
}

// isolate applies tenant isolation (Config.TenantIsolation) to request
// req whose body is body, from tenant (the identified tenant:
// cluster.Tenants.Identify): the body to forward, with the tenant's
// cache_salt, and req salted to match. Off, it returns body as it is.
func (p *Proxy) isolate(req *openai.Request, body []byte, tenant string) ([]byte, error) {
	iso := tenancy.Isolation{On: p.cfg.TenantIsolation, Secret: p.cfg.TenantSaltSecret}
	return iso.Apply(req, body, tenant)
}

// admitClient decides what x's client may see (x.explain) and isolates
// its tenant: x's bodies and req then carry the tenant's salt. The admin
// token header is removed, so that it never reaches a replica.
func (x *exchange) admitClient(req *openai.Request) error {
	x.explain = x.p.explainMode().For(x.p.trusted(x.r.Header))
	x.r.Header.Del(tenancy.TokenHeader)
	body, err := x.p.isolate(req, x.orig, x.tq.who.Tenant)
	if err != nil {
		return err
	}
	x.body, x.orig = body, body
	return nil
}
