package quota

import (
	"errors"
	"sync"
	"testing"
	"time"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func newLimiter(t *testing.T, limits map[string]Limit) *Limiter {
	t.Helper()
	l, err := New(limits)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestReserveSettle(t *testing.T) {
	// 600 tokens a minute: 10 a second, a bucket of 600.
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 600}})
	r1, err := l.Reserve("a", 400, t0)
	if err != nil {
		t.Fatal(err)
	}
	// 200 left: a reservation of 300 is refused, and told when it fits.
	_, err = l.Reserve("a", 300, t0)
	var ee *ExceededError
	if !errors.As(err, &ee) || !errors.Is(err, ErrExceeded) {
		t.Fatalf("Reserve over the quota: %v, want an ExceededError", err)
	}
	if ee.RetryAfter != 10*time.Second || ee.Requested != 300 || ee.State.Remaining != 200 || ee.State.Limit != 600 {
		t.Errorf("ExceededError %+v, want retry after 10s (100 tokens at 10/s), 300 requested, 200 remaining", ee)
	}
	// The first request used 150 of its 400: 250 come back.
	r1.Settle(150, t0)
	if s, _ := l.State("a", t0); s.Remaining != 450 || s.Reset != 15*time.Second {
		t.Errorf("after settling 150 of 400: %+v, want 450 remaining, full in 15s", s)
	}
	r1.Settle(0, t0) // twice: nothing
	if s, _ := l.State("a", t0); s.Remaining != 450 {
		t.Errorf("a second Settle changed the bucket: %+v", s)
	}
	// It refills at 10 tokens a second, up to its size.
	if s, _ := l.State("a", t0.Add(5*time.Second)); s.Remaining != 500 {
		t.Errorf("5s later: %+v, want 500", s)
	}
	if s, _ := l.State("a", t0.Add(time.Hour)); s.Remaining != 600 || s.Reset != 0 {
		t.Errorf("an hour later: %+v, want full (600, reset 0)", s)
	}
}

func TestRefundAndDebt(t *testing.T) {
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 60, Burst: 100}})
	r, err := l.Reserve("a", 80, t0)
	if err != nil {
		t.Fatal(err)
	}
	r.Settle(0, t0) // failed: refunded
	if s, _ := l.State("a", t0); s.Remaining != 100 {
		t.Errorf("after a refund: %+v, want the full 100", s)
	}
	// A request that used more than it reserved leaves the bucket owing:
	// even an empty reservation waits until the debt is paid.
	r, _ = l.Reserve("a", 50, t0)
	r.Settle(130, t0) // 100 − 130 = −30
	if s, _ := l.State("a", t0); s.Remaining != 0 {
		t.Errorf("in debt: %+v, want 0 remaining", s)
	}
	_, err = l.Reserve("a", 0, t0)
	var ee *ExceededError
	if !errors.As(err, &ee) || ee.RetryAfter != 30*time.Second {
		t.Errorf("Reserve(0) in debt of 30 at 1/s: %v, want refused, retry after 30s", err)
	}
	if _, err := l.Reserve("a", 0, t0.Add(30*time.Second)); err != nil {
		t.Errorf("debt paid: %v", err)
	}
}

func TestOversizedRequest(t *testing.T) {
	// A request larger than the bucket reserves the whole bucket: it passes
	// when the bucket is full, never before, and owes the rest.
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 60}})
	r, err := l.Reserve("a", 1000, t0)
	if err != nil {
		t.Fatalf("a request over the bucket's size with the bucket full: %v", err)
	}
	r.Settle(1000, t0)
	_, err = l.Reserve("a", 1000, t0)
	var ee *ExceededError
	if !errors.As(err, &ee) || ee.Requested != 60 || ee.RetryAfter != 1000*time.Second {
		t.Fatalf("second oversized request: %v, want refused, 60 requested, retry after 1000s (940 owed + 60, at 1/s)", err)
	}
	if _, err := l.Reserve("a", 1000, t0.Add(ee.RetryAfter)); err != nil {
		t.Errorf("at its Retry-After: %v", err)
	}
}

func TestNoQuota(t *testing.T) {
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 60}})
	r, err := l.Reserve("b", 1<<40, t0)
	if err != nil || r.Held() {
		t.Fatalf("a tenant without a quota: %v, held %v", err, r.Held())
	}
	r.Settle(5, t0)
	if _, ok := l.State("b", t0); ok || l.Has("b") || !l.Has("a") {
		t.Error("Has/State of tenants with and without a quota")
	}
	var nilL *Limiter
	if r, err := nilL.Reserve("a", 1, t0); err != nil || r.Held() {
		t.Errorf("nil Limiter: %v", err)
	}
	var zero Reservation
	zero.Settle(10, t0)
}

func TestValidate(t *testing.T) {
	for _, lim := range []Limit{{}, {TokensPerMinute: -1}, {TokensPerMinute: 10, Burst: -1}} {
		if _, err := New(map[string]Limit{"a": lim}); !errors.Is(err, ErrConfig) {
			t.Errorf("New(%+v) = %v, want ErrConfig", lim, err)
		}
	}
}

// TestLongRunRate: a tenant that sends as fast as it can gets its
// tokens_per_minute over time, whatever it reserves, once its usage is
// settled.
func TestLongRunRate(t *testing.T) {
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 6000, Burst: 500}})
	used := int64(0)
	now := t0
	for now.Before(t0.Add(10 * time.Minute)) {
		r, err := l.Reserve("a", 300, now) // reserves 300, uses 120
		if err != nil {
			var ee *ExceededError
			errors.As(err, &ee)
			now = now.Add(ee.RetryAfter)
			continue
		}
		r.Settle(120, now)
		used += 120
	}
	// 10 minutes at 6000/min, plus the first burst.
	if want := int64(60000 + 500); used < want-300 || used > want {
		t.Errorf("used %d tokens in 10 minutes, want about %d", used, want)
	}
}

func TestConcurrent(t *testing.T) {
	l := newLimiter(t, map[string]Limit{"a": {TokensPerMinute: 1000}})
	var wg sync.WaitGroup
	var mu sync.Mutex
	granted := 0
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := l.Reserve("a", 100, t0); err == nil {
				mu.Lock()
				granted++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if granted != 10 {
		t.Errorf("%d of 50 concurrent reservations of 100 granted from 1000, want 10", granted)
	}
}
