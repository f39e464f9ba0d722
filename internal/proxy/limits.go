package proxy

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prefixlb/prefixlb/internal/openai"
)

// limited wraps an inference handler with the checks that do not need the
// body: a path with dot segments is refused (400), one not in AllowedPaths
// too (404, allowed), the bound on requests in flight (Config.MaxConcurrent, a semaphore of that many slots, answered 429
// with Retry-After when full) and the deadline for reading the body
// (Config.BodyReadTimeout).
func (p *Proxy) limited(h http.HandlerFunc) http.HandlerFunc { return p.limit(h, true) }

// limit is limited, with the AllowedPaths check when allowlisted (the
// /v1 requests; /tokenize is not under /v1).
func (p *Proxy) limit(h http.HandlerFunc, allowlisted bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if hasDotSegment(r.URL.Path) {
			// The mux cleans literal dot segments (with a redirect), not
			// encoded ones ("%2e%2e", "..%2F"), which the forwarded path
			// would carry decoded out of /v1 on the replica.
			p.m.requests.WithLabelValues(p.policy, "", strconv.Itoa(http.StatusBadRequest)).Inc()
			writeError(w, fmt.Errorf("proxy: %w: path %q has dot segments", openai.ErrBadRequest, r.URL.Path))
			return
		}
		if allowlisted && !p.allowRequest(w, r) {
			return
		}
		if p.slots != nil {
			select {
			case p.slots <- struct{}{}:
				defer func() {
					<-p.slots
					if p.hookReleased != nil {
						p.hookReleased()
					}
				}()
			default:
				p.m.requests.WithLabelValues(p.policy, "", strconv.Itoa(http.StatusTooManyRequests)).Inc()
				w.Header().Set("Retry-After", "1")
				writeError(w, fmt.Errorf("proxy: %w: the limit is %d (max_concurrent)", ErrOverloaded, cap(p.slots)))
				return
			}
		}
		if d := p.cfg.BodyReadTimeout; d > 0 && r.Body != nil && r.Body != http.NoBody {
			rc := http.NewResponseController(w)
			if rc.SetReadDeadline(time.Now().Add(d)) == nil {
				r.Body = &deadlineBody{ReadCloser: r.Body, rc: rc, d: d}
			}
		}
		h(w, r)
	}
}

// deadlineBody is a request body read under a connection read deadline. It
// lifts the deadline once the body is read to its end (the connection is
// then read only to notice the client leaving, which a stream may need for
// minutes) and turns a timeout into ErrBodyTimeout. A body not read to its
// end keeps the deadline: net/http, which discards the rest of an unread
// body after the handler to keep the connection, then gives up at the same
// deadline and closes the connection instead of waiting on the client.
type deadlineBody struct {
	io.ReadCloser
	rc *http.ResponseController
	d  time.Duration

	once sync.Once
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.clear()
	}
	var ne net.Error
	if err != nil && err != io.EOF && errors.As(err, &ne) && ne.Timeout() {
		err = fmt.Errorf("%w: not read within %v (body_read_timeout)", ErrBodyTimeout, b.d)
	}
	return n, err
}

// clear lifts the read deadline.
func (b *deadlineBody) clear() {
	b.once.Do(func() { _ = b.rc.SetReadDeadline(time.Time{}) })
}

// hasDotSegment reports whether the (decoded) path has a "." or ".."
// segment.
func hasDotSegment(path string) bool {
	for seg := range strings.SplitSeq(path, "/") {
		if seg == "." || seg == ".." {
			return true
		}
	}
	return false
}

// tokenDigest is what an admin token is compared by: its SHA-256.
type tokenDigest [sha256.Size]byte

// digestToken hashes an admin token for tokenMatches.
func digestToken(tok string) tokenDigest { return sha256.Sum256([]byte(tok)) }

// tokenMatches reports whether got is the token whose digest is want, in
// time that tells nothing of the configured token, neither its content nor
// its length: subtle.ConstantTimeCompare returns at once on a length
// mismatch, so both are compared as equal-length SHA-256 digests, the
// configured one computed once by New.
func tokenMatches(got string, want tokenDigest) bool {
	g := digestToken(got)
	return subtle.ConstantTimeCompare(g[:], want[:]) == 1
}

// byteBudget bounds the bytes held at once by all requests together
// (FrontDoor.MaxInflightBodyBytes). A nil *byteBudget bounds nothing. It is
// safe for concurrent use.
type byteBudget struct {
	max  int64
	used atomic.Int64
}

// newByteBudget returns a budget of max bytes (nil for max ≤ 0: no bound).
// It allows bytes.MinRead over max: a body of max_body_bytes is read into a
// buffer with that much to spare (readBodyWithin), and must fit a budget
// of max_body_bytes.
func newByteBudget(max int64) *byteBudget {
	if max <= 0 {
		return nil
	}
	return &byteBudget{max: max}
}

// bound is the most the budget lets be held.
func (b *byteBudget) bound() int64 { return b.max + bytes.MinRead }

// reserve takes n bytes, or returns an error wrapping ErrBodyMemory and
// takes nothing when they would exceed the bound.
func (b *byteBudget) reserve(n int64) error {
	if b == nil {
		return nil
	}
	for {
		u := b.used.Load()
		if u+n > b.bound() {
			return fmt.Errorf("%w: %d bytes of request bodies held, %d more would pass max_inflight_body_bytes (%d)", ErrBodyMemory, u, n, b.max)
		}
		if b.used.CompareAndSwap(u, u+n) {
			return nil
		}
	}
}

// release gives back n bytes reserved.
func (b *byteBudget) release(n int64) {
	if b != nil && n != 0 {
		b.used.Add(-n)
	}
}

// held is the bytes reserved now.
func (b *byteBudget) held() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}

// allowed wraps h with the AllowedPaths check (allowRequest).
func (p *Proxy) allowed(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if p.allowRequest(w, r) {
			h(w, r)
		}
	}
}

// allowRequest reports whether r's method and path are in AllowedPaths; if
// not, it answers 404 with an OpenAI-style error naming the setting, and
// counts the refusal.
func (p *Proxy) allowRequest(w http.ResponseWriter, r *http.Request) bool {
	if p.allow.allows(r.Method, r.URL.Path) {
		return true
	}
	p.m.refused.WithLabelValues(refusedPath).Inc()
	p.m.requests.WithLabelValues(p.policy, "", strconv.Itoa(http.StatusNotFound)).Inc()
	writeErrorStatus(w, http.StatusNotFound, fmt.Errorf("proxy: %s %s is not served here: not in allowed_paths", r.Method, r.URL.Path))
	return false
}

// warnOpenAdmin logs a warning when the proxy listens on addr beyond
// loopback without an admin token: /debug/* (routing decisions, each
// replica's cache, Go's profiler) and /ui are then open to whoever reaches
// the address (admin lets every request through when AdminToken is empty,
// which is kept for loopback, where only the host's users reach it).
func (p *Proxy) warnOpenAdmin(addr net.Addr) {
	if p.cfg.AdminToken != "" || isLoopback(addr) {
		return
	}
	p.log.Warn("listening beyond loopback without an admin token: /debug/* (routing decisions, replicas' caches, the Go profiler) and /ui are open to anyone who can reach this address; set --admin-token or $PREFIXLB_ADMIN_TOKEN (admin_token), or listen on 127.0.0.1",
		"listen", addr.String())
}

// isLoopback reports whether addr is a TCP address on a loopback IP (not an
// unspecified one, 0.0.0.0 or ::, which listens on every interface).
func isLoopback(addr net.Addr) bool {
	switch a := addr.(type) {
	case *net.TCPAddr:
		return a.IP.IsLoopback()
	case *net.UnixAddr:
		return true // a socket file: the host's users only
	}
	host, _, err := net.SplitHostPort(addr.String())
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
