package proxy

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// allowRule is one entry of FrontDoor.AllowedPaths.
type allowRule struct {
	// method is the request method it allows ("": any).
	method string
	// path is the path allowed: exactly, or with prefix, every path that
	// starts with it (it then ends in "/").
	path   string
	prefix bool
}

// allowAll is the AllowedPaths entry that allows every /v1 request.
const allowAll = "*"

// parseAllowRule parses one AllowedPaths entry other than "*": "METHOD
// PATH", separated by spaces, METHOD an HTTP method (RFC 9110 §9: a token;
// methods are case-sensitive) or "*" (any), PATH a path under /v1/, exact,
// or ending in "/*" for every path below ("POST /v1/*").
func parseAllowRule(s string) (allowRule, error) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return allowRule{}, fmt.Errorf("%q: want \"METHOD /v1/path\" (or \"*\" alone for every /v1 request)", s)
	}
	var r allowRule
	if f[0] != "*" {
		if !isToken(f[0]) {
			return allowRule{}, fmt.Errorf("%q: method %q is not an HTTP method token", s, f[0])
		}
		r.method = f[0]
	}
	p := f[1]
	if !strings.HasPrefix(p, "/v1/") {
		return allowRule{}, fmt.Errorf("%q: path %q is not under /v1/ (only /v1 requests are forwarded)", s, p)
	}
	if hasDotSegment(p) || strings.Contains(p, "//") {
		return allowRule{}, fmt.Errorf("%q: path %q has an empty or dot segment", s, p)
	}
	if rest, ok := strings.CutSuffix(p, "/*"); ok {
		r.path, r.prefix = rest+"/", true
	} else {
		r.path = p
	}
	if strings.Contains(r.path, "*") {
		return allowRule{}, fmt.Errorf("%q: \"*\" is allowed only as the path's last segment", s)
	}
	return r, nil
}

// isToken reports whether s is an RFC 9110 token (§5.6.2).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// allowlist is FrontDoor.AllowedPaths compiled. The zero value allows
// nothing.
type allowlist struct {
	all   bool
	rules []allowRule
}

// newAllowlist compiles entries (validated by FrontDoor.validate).
func newAllowlist(entries []string) (allowlist, error) {
	var a allowlist
	for _, s := range entries {
		if strings.TrimSpace(s) == allowAll {
			a.all = true
			continue
		}
		r, err := parseAllowRule(s)
		if err != nil {
			return allowlist{}, err
		}
		a.rules = append(a.rules, r)
	}
	if !a.all && len(a.rules) == 0 {
		return allowlist{}, errors.New("no entry")
	}
	return a, nil
}

// allows reports whether a request of method for path (the decoded path the
// proxy would forward) may be served. HEAD is allowed where GET is, as
// net/http's mux routes it.
func (a *allowlist) allows(method, path string) bool {
	if a.all {
		return true
	}
	for _, r := range a.rules {
		if r.method != "" && r.method != method && (method != http.MethodHead || r.method != http.MethodGet) {
			continue
		}
		if r.path == path || (r.prefix && strings.HasPrefix(path, r.path)) {
			return true
		}
	}
	return false
}
