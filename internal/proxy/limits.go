package proxy

import (
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
	"time"

	"github.com/prefixlb/prefixlb/internal/openai"
)

// limited wraps an inference handler with the checks that do not need the
// body: a path with dot segments is refused (400), the bound on requests in
// flight (Config.MaxConcurrent, a semaphore of that many slots, answered 429
// with Retry-After when full) and the deadline for reading the body
// (Config.BodyReadTimeout).
func (p *Proxy) limited(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if hasDotSegment(r.URL.Path) {
			// The mux cleans literal dot segments (with a redirect), not
			// encoded ones ("%2e%2e", "..%2F"), which the forwarded path
			// would carry decoded out of /v1 on the replica.
			p.m.requests.WithLabelValues(p.policy, "", strconv.Itoa(http.StatusBadRequest)).Inc()
			writeError(w, fmt.Errorf("proxy: %w: path %q has dot segments", openai.ErrBadRequest, r.URL.Path))
			return
		}
		if p.slots != nil {
			select {
			case p.slots <- struct{}{}:
				defer func() { <-p.slots }()
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
