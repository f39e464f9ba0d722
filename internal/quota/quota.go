// Package quota is prefixlb's per-tenant token quota: a token bucket per
// tenant, filled at its tokens_per_minute, from which each request reserves
// its prompt tokens and an estimate of its output when it arrives, and
// settles to what it really used (prompt plus completion tokens) when it
// ends, the difference going back to the bucket or owed by it. A failed
// request is refunded.
//
// Reserve-then-settle is what makes a token quota hold under concurrency:
// a check that only compares the tokens already charged with the limit
// (Envoy AI Gateway's usage-based rate limit checks the count at the
// request and charges the response's usage after it,
// aigateway.envoyproxy.io/docs/capabilities/usage-based-ratelimiting) lets
// every request of a burst through before the first one is charged. SMG's
// rate limiter is a token bucket too, one token per request
// (lightseekorg/smg docs/concepts/reliability/rate-limiting.md); here a
// token is an LLM token, as a provider's tokens-per-minute limit counts
// them (OpenAI's x-ratelimit-*-tokens headers).
//
// Like the router, the package is pure: it reads no clock (the caller
// passes now), starts no goroutine and does no I/O. A Limiter is safe for
// concurrent use.
package quota

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"
)

// DefaultOutputTokens is the output a request that sets no max_tokens
// reserves. vLLM's default max_tokens is the model's whole remaining
// context (up to 128k tokens), which would make one request reserve a
// tenant's minute; a reservation is only an estimate that settling
// corrects, so a typical answer's length is what it should be: 256, the
// output `prefixlb epp` prices a request without max_tokens at
// (epp.Config.DefaultOutputTokens). A request that produces more owes the
// difference, which its tenant's next requests wait out.
const DefaultOutputTokens = 256

// ErrConfig is wrapped by every error of Limit.Validate and New.
var ErrConfig = errors.New("quota: invalid config")

// Limit is one tenant's quota.
type Limit struct {
	// TokensPerMinute is the rate the bucket fills at: prompt plus
	// output tokens a minute (> 0).
	TokensPerMinute int64
	// Burst is the bucket's size, the most tokens the tenant can spend at
	// once (0: one minute's worth, TokensPerMinute).
	Burst int64
}

// Validate reports an invalid limit.
func (l Limit) Validate() error {
	switch {
	case l.TokensPerMinute <= 0:
		return fmt.Errorf("%w: tokens_per_minute must be > 0, got %d", ErrConfig, l.TokensPerMinute)
	case l.Burst < 0:
		return fmt.Errorf("%w: burst_tokens must be ≥ 0, got %d", ErrConfig, l.Burst)
	}
	return nil
}

// burst is the bucket's size.
func (l Limit) burst() float64 {
	if l.Burst > 0 {
		return float64(l.Burst)
	}
	return float64(l.TokensPerMinute)
}

// bucket is one tenant's tokens (guarded by the Limiter's mu).
type bucket struct {
	limit Limit
	rate  float64 // tokens a second
	size  float64
	// tokens is what is left at `at`; below 0 the tenant owes tokens (a
	// request used more than it reserved).
	tokens float64
	at     time.Time
}

// refill adds what the bucket earned since its last look, up to its size.
func (b *bucket) refill(now time.Time) {
	if b.at.IsZero() {
		b.tokens, b.at = b.size, now
		return
	}
	if dt := now.Sub(b.at); dt > 0 {
		b.tokens = math.Min(b.size, b.tokens+b.rate*dt.Seconds())
		b.at = now
	}
}

// until is how long until the bucket holds n tokens.
func (b *bucket) until(n float64) time.Duration {
	if b.tokens >= n {
		return 0
	}
	return time.Duration(math.Ceil((n - b.tokens) / b.rate * float64(time.Second)))
}

// Limiter holds the buckets of the tenants that have a quota. Create it
// with New.
type Limiter struct {
	mu      sync.Mutex // guards every bucket
	buckets map[string]*bucket
}

// New returns a Limiter of limits by tenant, each bucket full.
func New(limits map[string]Limit) (*Limiter, error) {
	l := &Limiter{buckets: make(map[string]*bucket, len(limits))}
	for name, lim := range limits {
		if err := lim.Validate(); err != nil {
			return nil, fmt.Errorf("tenant %q: %w", name, err)
		}
		l.buckets[name] = &bucket{limit: lim, rate: float64(lim.TokensPerMinute) / 60, size: lim.burst()}
	}
	return l, nil
}

// Has reports whether tenant has a quota.
func (l *Limiter) Has(tenant string) bool {
	if l == nil {
		return false
	}
	_, ok := l.buckets[tenant] // the map is never written after New
	return ok
}

// Tenants lists the tenants with a quota, sorted.
func (l *Limiter) Tenants() []string {
	if l == nil {
		return nil
	}
	out := make([]string, 0, len(l.buckets))
	for name := range l.buckets {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// State is a tenant's bucket as the x-ratelimit-*-tokens headers tell it.
type State struct {
	// Limit is the tenant's tokens per minute.
	Limit int64
	// Remaining is the tokens it can spend now (0 while it owes some).
	Remaining int64
	// Reset is how long until its bucket is full again.
	Reset time.Duration
}

func (b *bucket) state() State {
	return State{Limit: b.limit.TokensPerMinute, Remaining: int64(math.Max(0, math.Floor(b.tokens))), Reset: b.until(b.size)}
}

// ExceededError is Reserve's answer to a request its tenant's bucket cannot
// cover now.
type ExceededError struct {
	// Tenant is the tenant over its quota.
	Tenant string
	// Requested is the tokens the request reserves (capped at the bucket's
	// size).
	Requested int64
	// RetryAfter is how long until the bucket covers Requested, if nothing
	// else is spent meanwhile.
	RetryAfter time.Duration
	// State is the bucket now.
	State State
}

func (e *ExceededError) Error() string {
	return fmt.Sprintf("quota: tenant %s is over its quota of %d tokens per minute: %d requested, %d remaining; try again in %v",
		e.Tenant, e.State.Limit, e.Requested, e.State.Remaining, e.RetryAfter)
}

// Is makes an ExceededError match ErrExceeded.
func (e *ExceededError) Is(target error) bool { return target == ErrExceeded }

// ErrExceeded is matched by every ExceededError.
var ErrExceeded = errors.New("quota: over the tenant's token quota")

// Reservation is the tokens one request holds from its tenant's bucket until
// Settle. The zero Reservation holds nothing (a tenant without a quota):
// its Settle does nothing.
type Reservation struct {
	l      *Limiter
	b      *bucket
	tokens float64
}

// Held reports whether the reservation holds tokens of a bucket (its
// tenant has a quota) and has not been settled.
func (r *Reservation) Held() bool { return r.b != nil }

// Tokens is what the reservation took from the bucket (the request's
// tokens, capped at the bucket's size).
func (r *Reservation) Tokens() int64 { return int64(r.tokens) }

// Reserve takes tokens (a request's prompt tokens and output estimate) from
// tenant's bucket at now. A tenant without a quota gets the zero
// Reservation and no error. A bucket that cannot cover them gives an
// *ExceededError (matching ErrExceeded) and takes nothing. A request that
// asks for more than the bucket holds when full reserves the full bucket
// (it passes once the bucket has filled, and owes the rest when it
// settles), so that no request is refused for ever.
func (l *Limiter) Reserve(tenant string, tokens int64, now time.Time) (Reservation, error) {
	if l == nil {
		return Reservation{}, nil
	}
	b := l.buckets[tenant]
	if b == nil {
		return Reservation{}, nil
	}
	n := math.Min(math.Max(float64(tokens), 0), b.size)
	l.mu.Lock()
	defer l.mu.Unlock()
	b.refill(now)
	if b.tokens < n {
		return Reservation{}, &ExceededError{Tenant: tenant, Requested: int64(n), RetryAfter: b.until(n), State: b.state()}
	}
	b.tokens -= n
	return Reservation{l: l, b: b, tokens: n}, nil
}

// Settle ends the reservation: the request really used used tokens (0 for
// a failed request: a full refund). The bucket gets back what was reserved
// and not used, or owes what was used beyond it. Settling twice, or the
// zero Reservation, does nothing.
func (r *Reservation) Settle(used int64, now time.Time) {
	if r.b == nil {
		return
	}
	l, b := r.l, r.b
	r.b = nil
	l.mu.Lock()
	defer l.mu.Unlock()
	b.refill(now)
	b.tokens = math.Min(b.size, b.tokens+r.tokens-math.Max(float64(used), 0))
}

// State is tenant's bucket at now (ok false: the tenant has no quota).
func (l *Limiter) State(tenant string, now time.Time) (s State, ok bool) {
	if l == nil {
		return s, false
	}
	b := l.buckets[tenant]
	if b == nil {
		return s, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b.refill(now)
	return b.state(), true
}
