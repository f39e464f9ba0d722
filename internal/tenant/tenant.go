// Package tenant says who a request is from, as far as the router can trust
// it: a tenant configured with its API keys (matched by their SHA-256), a
// tenant a trusted gateway names in a header, or an anonymous client. Only a
// trusted peer (a gateway in Config.TrustedProxies, or every peer of an epp
// whose gateway strips client-set values) may set the class headers
// (tenant, priority, TTFT SLO); from anyone else they are ignored and
// counted, so that no client can claim another tenant's identity, jump the
// queue, or retune the pool's admission threshold.
//
// The package is pure: no clock, no goroutines, no I/O (the environment is
// read through a function the caller passes).
package tenant

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"unicode"
	"unicode/utf8"

	"sigs.k8s.io/yaml"

	"github.com/prefixlb/prefixlb/internal/quota"
)

// The class headers: what a trusted gateway may tell about a request.
const (
	// Header names the request's tenant.
	Header = "x-prefixlb-tenant"
	// PriorityHeader is the request's priority, an integer (higher first).
	PriorityHeader = "x-prefixlb-priority"
	// SLOHeader is the request's TTFT SLO, a Go duration ("2s", "500ms").
	SLOHeader = "x-prefixlb-ttft-slo"
)

// ClassHeaders lists the class headers, in the order of Identity.Ignored's
// bits.
var ClassHeaders = [...]string{Header, PriorityHeader, SLOHeader}

// Other is the metric label and the quota bucket of every request that is
// not a configured tenant's: metric label sets stay as bounded as the
// configuration, however many API keys or names clients send.
const Other = "other"

// MaxNameBytes bounds a tenant's name, configured or from a gateway's
// header (longer header values are cut).
const MaxNameBytes = 64

// ErrConfig is wrapped by every error of Config.Validate and New.
var ErrConfig = errors.New("tenant: invalid config")

// ErrUnknown is returned, with Config.RequireTenant, for a request that is
// no configured tenant's (the HTTP edge answers 401).
var ErrUnknown = errors.New("no configured tenant has this API key")

// Tenant is one configured tenant (YAML tenants[]): who it is, and its
// token quota. Its priority, TTFT SLO and fair-share weight are the
// queue's classes that name it (queue.classes[].tenant).
type Tenant struct {
	// Name identifies the tenant in the queue's classes and weights, in
	// metric labels, and in a trusted gateway's x-prefixlb-tenant.
	Name string `json:"name"`
	// APIKeySHA256 are the hex SHA-256 digests of the tenant's API keys
	// (`printf %s "$KEY" | sha256sum`): the configuration holds no key.
	APIKeySHA256 []string `json:"api_key_sha256,omitempty"`
	// APIKeysEnv names an environment variable holding more of its keys,
	// in clear, separated by commas or newlines (a Kubernetes Secret
	// mounted as an environment variable).
	APIKeysEnv string `json:"api_keys_env,omitempty"`
	// TokensPerMinute is its quota: prompt plus output tokens a minute
	// (0: none).
	TokensPerMinute int64 `json:"tokens_per_minute,omitempty"`
	// BurstTokens is the most it can spend at once (0: one minute's
	// worth, TokensPerMinute).
	BurstTokens int64 `json:"burst_tokens,omitempty"`
}

// Config is how a front door tells tenants apart and what it trusts.
type Config struct {
	// Tenants are the configured tenants.
	Tenants []Tenant
	// TrustedProxies are the CIDRs ("10.0.0.0/8") or addresses of the
	// gateways whose class headers are believed: a request whose TCP peer
	// is inside may name its tenant, priority and TTFT SLO. Empty (the
	// default): no client's.
	TrustedProxies []string
	// TrustClientHeaders believes the class headers of every peer: for
	// `prefixlb epp`, whose only peer is the gateway, when the gateway
	// strips client-set values (default false).
	TrustClientHeaders bool
	// AnonymousTokensPerMinute is one quota shared by every request that is
	// no configured tenant's (the Other bucket; 0: none), so that a
	// tenant over its quota gains nothing by dropping its key.
	AnonymousTokensPerMinute int64
	// RequireTenant refuses (401) every request that is no configured
	// tenant's.
	RequireTenant bool
}

// Validate reports the first invalid field, by its YAML name.
func (c *Config) Validate() error {
	names := map[string]bool{}
	for i, t := range c.Tenants {
		switch {
		case t.Name == "" || len(t.Name) > MaxNameBytes || !printable(t.Name):
			return fmt.Errorf("%w: tenants[%d].name: want 1 to %d printable bytes, got %q", ErrConfig, i, MaxNameBytes, t.Name)
		case t.Name == Other:
			return fmt.Errorf("%w: tenants[%d].name: %q is the label of every other tenant", ErrConfig, i, Other)
		case names[t.Name]:
			return fmt.Errorf("%w: tenants[%d].name: duplicate %q", ErrConfig, i, t.Name)
		case t.TokensPerMinute < 0 || t.BurstTokens < 0:
			return fmt.Errorf("%w: tenants[%d]: tokens_per_minute and burst_tokens must be ≥ 0", ErrConfig, i)
		case t.BurstTokens > 0 && t.TokensPerMinute == 0:
			return fmt.Errorf("%w: tenants[%d].burst_tokens needs tokens_per_minute", ErrConfig, i)
		}
		names[t.Name] = true
		for j, d := range t.APIKeySHA256 {
			if _, err := parseDigest(d); err != nil {
				return fmt.Errorf("%w: tenants[%d].api_key_sha256[%d]: %v", ErrConfig, i, j, err)
			}
		}
	}
	for i, p := range c.TrustedProxies {
		if _, err := parsePrefix(p); err != nil {
			return fmt.Errorf("%w: trusted_proxies[%d]: %v", ErrConfig, i, err)
		}
	}
	if c.AnonymousTokensPerMinute < 0 {
		return fmt.Errorf("%w: anonymous_tokens_per_minute must be ≥ 0, got %d", ErrConfig, c.AnonymousTokensPerMinute)
	}
	return nil
}

// Names lists the configured tenants' names.
func (c *Config) Names() []string {
	out := make([]string, len(c.Tenants))
	for i, t := range c.Tenants {
		out[i] = t.Name
	}
	return out
}

// Limits are the quotas of the configuration, by tenant (Other: the
// anonymous quota).
func (c *Config) Limits() map[string]quota.Limit {
	m := map[string]quota.Limit{}
	for _, t := range c.Tenants {
		if t.TokensPerMinute > 0 {
			m[t.Name] = quota.Limit{TokensPerMinute: t.TokensPerMinute, Burst: t.BurstTokens}
		}
	}
	if c.AnonymousTokensPerMinute > 0 {
		m[Other] = quota.Limit{TokensPerMinute: c.AnonymousTokensPerMinute}
	}
	return m
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// parseDigest reads a hex SHA-256 digest.
func parseDigest(s string) ([sha256.Size]byte, error) {
	var d [sha256.Size]byte
	s = strings.TrimSpace(s)
	if len(s) != 2*sha256.Size {
		return d, fmt.Errorf("want %d hex digits (a SHA-256), got %d characters", 2*sha256.Size, len(s))
	}
	if _, err := hex.Decode(d[:], []byte(s)); err != nil {
		return d, fmt.Errorf("not hex: %v", err)
	}
	return d, nil
}

// parsePrefix reads a CIDR or a single address.
func parsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, err
		}
		if p.Addr().Is4In6() {
			p = netip.PrefixFrom(p.Addr().Unmap(), max(p.Bits()-96, 0))
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("want a CIDR or an address, got %q", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// Resolver tells a request's tenant. Create it with New; it is safe for
// concurrent use (read-only after New).
type Resolver struct {
	// byDigest maps an API key's SHA-256 to its tenant. A key is looked up
	// by its digest, so that the lookup's timing can only tell an attacker
	// about digests, which it cannot steer towards a valid key's (the
	// reason to compare digests, not keys, in constant time).
	byDigest map[[sha256.Size]byte]string
	names    map[string]bool
	trusted  []netip.Prefix
	trustAll bool
	require  bool
}

// New returns the resolver of c (validated here); getenv reads the
// environment variables of APIKeysEnv (nil: none may be named).
func New(c Config, getenv func(string) string) (*Resolver, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	r := &Resolver{byDigest: map[[sha256.Size]byte]string{}, names: map[string]bool{}, trustAll: c.TrustClientHeaders, require: c.RequireTenant}
	add := func(i int, d [sha256.Size]byte) error {
		if other, dup := r.byDigest[d]; dup && other != c.Tenants[i].Name {
			return fmt.Errorf("%w: tenants[%d]: an API key of tenant %q is also %q's", ErrConfig, i, c.Tenants[i].Name, other)
		}
		r.byDigest[d] = c.Tenants[i].Name
		return nil
	}
	for i, t := range c.Tenants {
		r.names[t.Name] = true
		for _, s := range t.APIKeySHA256 {
			d, _ := parseDigest(s)
			if err := add(i, d); err != nil {
				return nil, err
			}
		}
		if t.APIKeysEnv == "" {
			continue
		}
		v := ""
		if getenv != nil {
			v = getenv(t.APIKeysEnv)
		}
		n := 0
		for _, k := range strings.FieldsFunc(v, func(r rune) bool { return r == ',' || r == '\n' || r == '\r' }) {
			if k = strings.TrimSpace(k); k != "" {
				if err := add(i, sha256.Sum256([]byte(k))); err != nil {
					return nil, err
				}
				n++
			}
		}
		if n == 0 {
			return nil, fmt.Errorf("%w: tenants[%d].api_keys_env: $%s holds no key", ErrConfig, i, t.APIKeysEnv)
		}
	}
	for _, p := range c.TrustedProxies {
		pr, _ := parsePrefix(p)
		r.trusted = append(r.trusted, pr)
	}
	return r, nil
}

// Known reports whether name is a configured tenant's.
func (r *Resolver) Known(name string) bool { return r.names[name] }

// TrustedPeer reports whether a request from remoteAddr (net/http's
// Request.RemoteAddr, "ip:port") may set the class headers: every peer
// with Config.TrustClientHeaders, else those inside Config.TrustedProxies.
func (r *Resolver) TrustedPeer(remoteAddr string) bool {
	if r.trustAll {
		return true
	}
	if len(r.trusted) == 0 {
		return false
	}
	var a netip.Addr
	if ap, err := netip.ParseAddrPort(remoteAddr); err == nil {
		a = ap.Addr()
	} else if a, err = netip.ParseAddr(remoteAddr); err != nil {
		return false
	}
	a = a.Unmap().WithZone("")
	for _, p := range r.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Identity is who a request is from.
type Identity struct {
	// Tenant is the request's tenant as the queue shares fairly between
	// tenants and as a per-tenant cache salt tells them apart: a
	// configured tenant's name, the name a trusted gateway gave, else
	// Anonymous (its API key's digest, "" without a key). A client can
	// never make it another tenant's.
	Tenant string
	// Known says Tenant is a configured tenant's name.
	Known bool
	// Trusted says the request's class headers may be read.
	Trusted bool
	// Ignored has bit i set when the request carried ClassHeaders[i] and
	// was not trusted to.
	Ignored uint8
}

// Label is the request's tenant as a metric label: its name when it is a
// configured tenant, else Other.
func (id *Identity) Label() string {
	if id.Known {
		return id.Tenant
	}
	return Other
}

// Resolve tells the tenant of a request whose headers get reads (by name,
// any case) and whose peer is trusted or not (TrustedPeer): the configured
// tenant whose API key it carries; else, from a trusted peer, the tenant
// its Header names; else the anonymous tenant of its key. Untrusted class
// headers are noted in Identity.Ignored.
func (r *Resolver) Resolve(get func(string) string, trusted bool) Identity {
	id := Identity{Trusted: trusted}
	if !trusted {
		for i, h := range ClassHeaders {
			if get(h) != "" {
				id.Ignored |= 1 << i
			}
		}
	}
	key := APIKey(get)
	if key != "" {
		if name, ok := r.byDigest[sha256.Sum256([]byte(key))]; ok {
			id.Tenant, id.Known = name, true
			return id
		}
	}
	if trusted {
		if t := clip(strings.TrimSpace(get(Header))); t != "" {
			id.Tenant, id.Known = t, r.names[t]
			return id
		}
	}
	id.Tenant = anonymous(key)
	return id
}

// Check is Resolve's verdict under Config.RequireTenant: ErrUnknown for a
// request that is no configured tenant's.
func (r *Resolver) Check(id *Identity) error {
	if r.require && !id.Known {
		return ErrUnknown
	}
	return nil
}

// clip cuts a header's name to MaxNameBytes, on a rune boundary.
func clip(s string) string {
	if len(s) <= MaxNameBytes {
		return s
	}
	s = s[:MaxNameBytes]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// APIKey is the API key a request carries: the credentials of its
// Authorization header's Bearer scheme (RFC 6750 §2.1; the scheme's name in
// any case, RFC 9110 §11.1), as OpenAI's clients send it, else its
// x-api-key header. "" when it carries neither.
func APIKey(get func(string) string) string {
	if auth := strings.TrimSpace(get("Authorization")); auth != "" {
		scheme, cred, ok := strings.Cut(auth, " ")
		if ok && strings.EqualFold(scheme, "Bearer") {
			return strings.TrimSpace(cred)
		}
		return ""
	}
	return strings.TrimSpace(get("x-api-key"))
}

// Anonymous is the anonymous tenant of a request's API key: "key-" and the
// first 12 hex digits of the key's SHA-256 (the key itself never leaves
// the request), "" without a key. Distinct keys are distinct tenants in
// the queue's fair share, but all are labelled Other.
func Anonymous(get func(string) string) string { return anonymous(APIKey(get)) }

func anonymous(key string) string {
	if key == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(key))
	return "key-" + hex.EncodeToString(sum[:6])
}

// File is the YAML form of Config's tenants as `prefixlb epp --tenants`
// reads it (serve reads the same keys at the top level of its --config).
type File struct {
	Tenants                  []Tenant `json:"tenants"`
	AnonymousTokensPerMinute int64    `json:"anonymous_tokens_per_minute,omitempty"`
	RequireTenant            bool     `json:"require_tenant,omitempty"`
}

// ParseFile reads a File from YAML (unknown keys are errors) and lays it
// over c; the result is validated.
func ParseFile(data []byte, c Config) (Config, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return c, fmt.Errorf("tenant: parse tenants file: %w", err)
	}
	var f File
	if t := bytes.TrimSpace(js); len(t) > 0 && string(t) != "null" {
		dec := json.NewDecoder(bytes.NewReader(js))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			return c, fmt.Errorf("tenant: parse tenants file: %w", err)
		}
	}
	c.Tenants, c.AnonymousTokensPerMinute, c.RequireTenant = f.Tenants, f.AnonymousTokensPerMinute, f.RequireTenant
	if err := c.Validate(); err != nil {
		return c, err
	}
	return c, nil
}
