// Package tenancy keeps tenants apart in the prefix cache and decides what
// a client may learn of it.
//
// Isolation: vLLM salts a request's block hashes with its cache_salt
// (a body field), so salted prefixes are never shared across salts; the
// router keys salted requests from a salted seed (blocks.ChainSeed) and so
// never predicts one salt's blocks for another. With tenant isolation on,
// a front door salts every request with its tenant (Salt): the engine
// itself then keeps tenants apart, its KV events come back salted, and the
// router's keys use the same salt.
//
// Explanation: the x-prefixlb-route header says how many blocks of a
// prompt are cached, a block-exact membership oracle. Explain says who
// gets it: nobody, the clients that present the admin token, or everyone.
package tenancy

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/prefixlb/prefixlb/internal/openai"
)

// SaltPrefix starts every salt Salt derives, so that a replica's logs
// show which salts the router set.
const SaltPrefix = "pfxlb1-"

// Salt is the cache_salt a front door sets on a request of tenant when it
// isolates tenants: SaltPrefix and the unpadded base64url of
// HMAC-SHA256(secret, len(tenant) ‖ tenant ‖ clientSalt), 43 characters of
// 256 bits as vLLM advises for a salt (vllm/entrypoints/openai/protocol.py,
// cache_salt's description: "random, protected from access by 3rd
// parties, and long enough to be unpredictable (e.g., 43 characters
// base64-encoded, corresponding to 256 bit)"; vllm-project/vllm at
// 0052bed36509c7a5a2d8e48265334e40cf2f5a0e). Two tenants never get the
// same salt, whatever client salts they send; a tenant's own client salt
// still splits its cache. The length prefix keeps ("ab", "c") and ("a",
// "bc") apart. With an empty secret the salt is a plain function of the
// tenant: safe while clients reach the replicas only through the router
// (which always overwrites cache_salt), not against a client that reaches
// a replica directly and knows a tenant's name.
func Salt(secret, tenant, clientSalt string) string {
	m := hmac.New(sha256.New, []byte(secret))
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(tenant)))
	m.Write(n[:])
	m.Write([]byte(tenant))
	m.Write([]byte(clientSalt))
	return SaltPrefix + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// Explain says which clients get a decision's explanation
// (x-prefixlb-route, and epp's x-prefixlb-route-terms).
type Explain string

// The explanation settings.
const (
	// ExplainNever: nobody.
	ExplainNever Explain = "never"
	// ExplainTrusted: only requests that present the admin token
	// (Authorization: Bearer TOKEN, or TokenHeader); nobody when no token
	// is configured.
	ExplainTrusted Explain = "trusted"
	// ExplainAlways: every client (a closed deployment, tests, benches).
	ExplainAlways Explain = "always"
)

// ParseExplain reads a setting: never, trusted or always; for the
// compatibility of a boolean flag, true is always and false never. ""
// is def.
func ParseExplain(s string, def Explain) (Explain, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "":
		return def, nil
	case "never", "false":
		return ExplainNever, nil
	case "trusted":
		return ExplainTrusted, nil
	case "always", "true":
		return ExplainAlways, nil
	}
	return "", fmt.Errorf("explain %q: want never, trusted or always", s)
}

// Validate reports an unknown setting ("" is not one).
func (e Explain) Validate() error {
	switch e {
	case ExplainNever, ExplainTrusted, ExplainAlways:
		return nil
	}
	return fmt.Errorf("%q: want never, trusted or always", string(e))
}

// For reports whether a request gets the explanation: trusted says it
// presented the admin token.
func (e Explain) For(trusted bool) bool {
	return e == ExplainAlways || (e == ExplainTrusted && trusted)
}

// ExplainFlag is Explain as a command-line flag value (pflag.Value): the
// flag may be given bare (--explain, meaning always: set the flag's
// NoOptDefVal to "always"), or --explain=never|trusted|always|true|false.
type ExplainFlag struct{ V *Explain }

// String implements pflag.Value.
func (f ExplainFlag) String() string {
	if f.V == nil {
		return ""
	}
	return string(*f.V)
}

// Set implements pflag.Value.
func (f ExplainFlag) Set(s string) error {
	e, err := ParseExplain(s, ExplainAlways)
	if err != nil {
		return err
	}
	*f.V = e
	return nil
}

// Type implements pflag.Value.
func (ExplainFlag) Type() string { return "never|trusted|always" }

// TokenHeader is the request header in which a client may present the
// admin token to be trusted (beside Authorization: Bearer, which the
// replicas may need for their own API key). Front doors remove it before
// the request goes on.
const TokenHeader = "x-prefixlb-admin-token"

// Token is an admin token, held as its SHA-256 so that checks take the
// same time whatever the token's content and length. The zero Token is
// unset: nothing presents it.
type Token struct {
	sum [sha256.Size]byte
	set bool
}

// NewToken holds tok ("" gives the unset Token).
func NewToken(tok string) Token {
	if tok == "" {
		return Token{}
	}
	return Token{sum: sha256.Sum256([]byte(tok)), set: true}
}

// Set reports whether a token is configured.
func (t Token) Set() bool { return t.set }

// Matches reports whether got is the token, in constant time.
func (t Token) Matches(got string) bool {
	if !t.set {
		return false
	}
	g := sha256.Sum256([]byte(got))
	return subtle.ConstantTimeCompare(g[:], t.sum[:]) == 1
}

// Presented reports whether a request whose headers get returns
// presents the token: in TokenHeader, or as Authorization: Bearer TOKEN.
func (t Token) Presented(get func(string) string) bool {
	if !t.set {
		return false
	}
	if v := get(TokenHeader); v != "" && t.Matches(strings.TrimSpace(v)) {
		return true
	}
	bearer, ok := strings.CutPrefix(get("Authorization"), "Bearer ")
	return ok && t.Matches(strings.TrimSpace(bearer))
}

// Isolation is a front door's tenant isolation setting.
type Isolation struct {
	// On salts every request with its tenant (Salt).
	On bool
	// Secret keys the salts (Salt); the same on every router of a pool,
	// or their requests' salts differ and the engines' caches split.
	Secret string
}

// Apply salts req, whose body is body, for tenant: with isolation off it
// changes nothing (the client's own cache_salt keys it, as vLLM applies
// it); on, req.CacheSalt becomes Salt(Secret, tenant, the client's salt)
// and the body returned carries it as cache_salt, whatever cache_salt the
// client sent, so that the replica applies the same salt. A body that is
// not a JSON object (another API's, forwarded as it is) is returned
// unchanged, its keys still salted. It does not modify body.
func (i Isolation) Apply(req *openai.Request, body []byte, tenant string) ([]byte, error) {
	if !i.On {
		return body, nil
	}
	req.CacheSalt = Salt(i.Secret, tenant, req.CacheSalt)
	out, err := openai.WithCacheSalt(body, req.CacheSalt)
	if err != nil {
		if req.Kind == openai.KindOther {
			return body, nil
		}
		return nil, fmt.Errorf("tenancy: salt the request: %w", err)
	}
	return out, nil
}
