package tenant

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"
)

func digest(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

func headers(kv ...string) func(string) string {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h.Get
}

func newResolver(t *testing.T, c Config, env map[string]string) *Resolver {
	t.Helper()
	r, err := New(c, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestResolve(t *testing.T) {
	r := newResolver(t, Config{Tenants: []Tenant{
		{Name: "acme", APIKeySHA256: []string{digest("sk-acme-1"), strings.ToUpper(digest("sk-acme-2"))}},
		{Name: "beta", APIKeysEnv: "BETA_KEYS"},
		{Name: "gw-only"},
	}}, map[string]string{"BETA_KEYS": " sk-beta-1 ,\nsk-beta-2\n"})
	for _, tc := range []struct {
		name    string
		get     func(string) string
		trusted bool
		tenant  string
		known   bool
		ignored uint8
	}{
		{"bearer key", headers("Authorization", "Bearer sk-acme-1"), false, "acme", true, 0},
		{"scheme in any case, second key", headers("Authorization", "bearer  sk-acme-2"), false, "acme", true, 0},
		{"x-api-key from the environment", headers("x-api-key", "sk-beta-2"), false, "beta", true, 0},
		{"a key beats a trusted header", headers("Authorization", "Bearer sk-beta-1", Header, "acme"), true, "beta", true, 0},
		{"untrusted header is ignored", headers(Header, "acme", PriorityHeader, "9", SLOHeader, "2ns"), false, "", false, 0b111},
		{"untrusted header with an unknown key", headers(Header, "acme", "Authorization", "Bearer sk-x"), false, Anonymous(headers("x-api-key", "sk-x")), false, 0b001},
		{"trusted gateway names a configured tenant", headers(Header, "gw-only"), true, "gw-only", true, 0},
		{"trusted gateway names another", headers(Header, "team-z"), true, "team-z", false, 0},
		{"trusted gateway name is cut", headers(Header, strings.Repeat("é", 40)), true, strings.Repeat("é", 32), false, 0},
		{"no key", headers(), false, "", false, 0},
		{"basic auth is no key", headers("Authorization", "Basic c2stYWNtZS0x"), false, "", false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := r.Resolve(tc.get, tc.trusted)
			if id.Tenant != tc.tenant || id.Known != tc.known || id.Ignored != tc.ignored || id.Trusted != tc.trusted {
				t.Errorf("Resolve = %+v, want tenant %q known %v ignored %03b", id, tc.tenant, tc.known, tc.ignored)
			}
			if want := Other; tc.known {
				if id.Label() != tc.tenant {
					t.Errorf("Label = %q, want %q", id.Label(), tc.tenant)
				}
			} else if id.Label() != want {
				t.Errorf("Label = %q, want %q", id.Label(), want)
			}
		})
	}
	// An anonymous key is a tenant of its own in the fair share, never the
	// key itself.
	if a := Anonymous(headers("Authorization", "Bearer sk-secret")); !strings.HasPrefix(a, "key-") || len(a) != 16 || strings.Contains(a, "secret") {
		t.Errorf("Anonymous = %q", a)
	}
}

func TestRequireTenant(t *testing.T) {
	r := newResolver(t, Config{RequireTenant: true, Tenants: []Tenant{{Name: "acme", APIKeySHA256: []string{digest("k")}}}}, nil)
	id := r.Resolve(headers("Authorization", "Bearer k"), false)
	if err := r.Check(&id); err != nil {
		t.Errorf("a configured key: %v", err)
	}
	id = r.Resolve(headers("Authorization", "Bearer other"), false)
	if err := r.Check(&id); !errors.Is(err, ErrUnknown) {
		t.Errorf("an unknown key: %v, want ErrUnknown", err)
	}
}

func TestTrustedPeer(t *testing.T) {
	r := newResolver(t, Config{TrustedProxies: []string{"10.0.0.0/8", "192.168.1.7", "fd00::/8", "::ffff:172.16.0.0/108"}}, nil)
	for addr, want := range map[string]bool{
		"10.1.2.3:5555":          true,
		"[::ffff:10.9.9.9]:80":   true, // an IPv4 client on a dual-stack listener
		"192.168.1.7:1":          true,
		"192.168.1.8:1":          false,
		"[fd12::1]:443":          true,
		"[fe80::1%eth0]:443":     false,
		"172.16.3.4:9":           true,
		"127.0.0.1:80":           false,
		"garbage":                false,
		"":                       false,
		"10.0.0.1":               true, // no port
		"[2001:db8::1]:443":      false,
		"[::ffff:192.168.1.7]:1": true,
	} {
		if got := r.TrustedPeer(addr); got != want {
			t.Errorf("TrustedPeer(%q) = %v, want %v", addr, got, want)
		}
	}
	none := newResolver(t, Config{}, nil)
	if none.TrustedPeer("127.0.0.1:1") {
		t.Error("no trusted proxies: loopback trusted")
	}
	all := newResolver(t, Config{TrustClientHeaders: true}, nil)
	if !all.TrustedPeer("") {
		t.Error("TrustClientHeaders: a peer not trusted")
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    Config
		env  map[string]string
		want string
	}{
		{"empty name", Config{Tenants: []Tenant{{}}}, nil, "tenants[0].name"},
		{"reserved name", Config{Tenants: []Tenant{{Name: Other}}}, nil, "tenants[0].name"},
		{"long name", Config{Tenants: []Tenant{{Name: strings.Repeat("a", 65)}}}, nil, "tenants[0].name"},
		{"control character", Config{Tenants: []Tenant{{Name: "a\nb"}}}, nil, "tenants[0].name"},
		{"duplicate", Config{Tenants: []Tenant{{Name: "a"}, {Name: "a"}}}, nil, "tenants[1].name"},
		{"bad digest", Config{Tenants: []Tenant{{Name: "a", APIKeySHA256: []string{"abc"}}}}, nil, "api_key_sha256[0]"},
		{"not hex", Config{Tenants: []Tenant{{Name: "a", APIKeySHA256: []string{strings.Repeat("zz", 32)}}}}, nil, "api_key_sha256[0]"},
		{"negative quota", Config{Tenants: []Tenant{{Name: "a", TokensPerMinute: -1}}}, nil, "tokens_per_minute"},
		{"burst alone", Config{Tenants: []Tenant{{Name: "a", BurstTokens: 5}}}, nil, "burst_tokens"},
		{"bad proxy", Config{TrustedProxies: []string{"10.0.0.0/33"}}, nil, "trusted_proxies[0]"},
		{"bad anonymous quota", Config{AnonymousTokensPerMinute: -1}, nil, "anonymous_tokens_per_minute"},
		{"empty env", Config{Tenants: []Tenant{{Name: "a", APIKeysEnv: "NOPE"}}}, nil, "$NOPE holds no key"},
		{"shared key", Config{Tenants: []Tenant{{Name: "a", APIKeySHA256: []string{digest("k")}}, {Name: "b", APIKeysEnv: "K"}}},
			map[string]string{"K": "k"}, "also \"a\"'s"},
	} {
		_, err := New(tc.c, func(k string) string { return tc.env[k] })
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrConfig naming %s", tc.name, err, tc.want)
		}
	}
}

func TestLimits(t *testing.T) {
	c := Config{Tenants: []Tenant{{Name: "a", TokensPerMinute: 100, BurstTokens: 10}, {Name: "b"}}, AnonymousTokensPerMinute: 7}
	l := c.Limits()
	if len(l) != 2 || l["a"].TokensPerMinute != 100 || l["a"].Burst != 10 || l[Other].TokensPerMinute != 7 {
		t.Errorf("Limits = %+v", l)
	}
}

func TestParseFile(t *testing.T) {
	c, err := ParseFile([]byte(`
tenants:
  - name: acme
    api_key_sha256: [`+digest("k")+`]
    tokens_per_minute: 60000
anonymous_tokens_per_minute: 1000
require_tenant: true
`), Config{TrustClientHeaders: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Tenants) != 1 || c.Tenants[0].TokensPerMinute != 60000 || c.AnonymousTokensPerMinute != 1000 || !c.RequireTenant || !c.TrustClientHeaders {
		t.Errorf("ParseFile = %+v", c)
	}
	for _, bad := range []string{"tenants: [{name: a, nope: 1}]", "trusted_proxies: [1.2.3.4]", "tenants: [{name: other}]", "tenants: 3", "[:"} {
		if _, err := ParseFile([]byte(bad), Config{}); err == nil {
			t.Errorf("ParseFile(%q) accepted", bad)
		}
	}
}

// FuzzParseFile: no input panics, and what is accepted validates and
// resolves.
func FuzzParseFile(f *testing.F) {
	f.Add([]byte("tenants:\n  - name: acme\n    api_key_sha256: [" + digest("k") + "]\n    tokens_per_minute: 10\n"))
	f.Add([]byte("tenants: []\nrequire_tenant: true\n"))
	f.Add([]byte("anonymous_tokens_per_minute: -3"))
	f.Add([]byte("tenants: [{name: \"\\u0000\"}]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseFile(data, Config{})
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted but invalid: %v", err)
		}
		if _, err := New(c, nil); err != nil && !errors.Is(err, ErrConfig) {
			t.Fatalf("New: %v", err)
		}
	})
}

// FuzzResolve: any headers and peer address resolve without panicking to
// a name within bounds; untrusted requests never take a name from the
// tenant header, and a label is always a configured name or Other.
func FuzzResolve(f *testing.F) {
	r, err := New(Config{Tenants: []Tenant{{Name: "acme", APIKeySHA256: []string{digest("k")}}}, TrustedProxies: []string{"10.0.0.0/8"}}, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Add("Bearer k", "", "acme", "10.0.0.1:1")
	f.Add("bearer", "k", "x", "[::1]:2")
	f.Add("", "", strings.Repeat("\xff", 70), "10.255.255.255:0")
	f.Fuzz(func(t *testing.T, auth, apiKey, tenant, peer string) {
		get := func(k string) string {
			switch strings.ToLower(k) {
			case "authorization":
				return auth
			case "x-api-key":
				return apiKey
			case Header:
				return tenant
			}
			return ""
		}
		trusted := r.TrustedPeer(peer)
		id := r.Resolve(get, trusted)
		if len(id.Tenant) > MaxNameBytes {
			t.Fatalf("tenant %q longer than %d", id.Tenant, MaxNameBytes)
		}
		if l := id.Label(); l != Other && !r.Known(l) {
			t.Fatalf("label %q is neither configured nor %q", l, Other)
		}
		if !trusted && id.Tenant != "" && id.Tenant != "acme" && !strings.HasPrefix(id.Tenant, "key-") {
			t.Fatalf("untrusted request named tenant %q", id.Tenant)
		}
		if trusted && utf8.ValidString(tenant) && !utf8.ValidString(id.Tenant) {
			t.Fatalf("a valid name cut into invalid UTF-8: %q", id.Tenant)
		}
	})
}
