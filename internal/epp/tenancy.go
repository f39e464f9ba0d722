package epp

import (
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// isolate salts pr for tenant (the identified tenant: Picker.identify) when Config.TenantIsolation is on
// (tenancy.Isolation.Apply, as serve's tenant_isolation): pr.CacheSalt
// becomes the tenant's salt and the body returned, body (the one the
// replica would get: the model-rewritten one, or the request's own)
// with that cache_salt, goes on instead. Off, it returns nil: the body
// goes on as it is, keyed with the client's own cache_salt.
func (p *Picker) isolate(pr *openai.Request, body []byte, tenant string) ([]byte, error) {
	if !p.cfg.TenantIsolation {
		return nil, nil
	}
	return tenancy.Isolation{On: true, Secret: p.cfg.TenantSaltSecret}.Apply(pr, body, tenant)
}
