package proxy

import (
	"context"
	"errors"
	"time"
)

// verdict is what one attempt tells of its replica's health.
type verdict int8

const (
	// verdictNone: nothing (4xx, the client left or stopped reading, the
	// request's own deadline): not the replica's doing either way.
	verdictNone verdict = iota
	// verdictOK: the replica answered (a 2xx or 3xx).
	verdictOK
	// verdictFail: the replica failed (5xx, connection error, timeout,
	// garbage, a stream cut).
	verdictFail
)

// breakerMaxEjectionFactor caps an ejection at this many times the base
// ejection time: Envoy's max_ejection_time defaults to 300 s over a 30 s
// base_ejection_time.
const breakerMaxEjectionFactor = 10

// breaker is one replica's passive outlier detection, after Envoy's
// (outlier_detection: consecutive_5xx, base_ejection_time ×
// times ejected): the outcomes of its last window requests, and its
// ejection. It is pure (the caller passes the time) and not safe for
// concurrent use: the core's Mu guards it.
type breaker struct {
	// ring holds the last len(ring) verdicts (true: failed), next the
	// slot the next one goes to, n how many it holds, fails how many of
	// them failed.
	ring          []bool
	next, n       int
	fails         int
	threshold     int
	base          time.Duration
	ejections     int       // recent ejections, decayed by time spent admitted
	until         time.Time // ejected until then; zero: not ejected
	admittedSince time.Time // when it was last re-admitted
}

// newBreaker returns a breaker that trips at failures of the last window
// verdicts and ejects for base × recent ejections (nil when failures is 0:
// off).
func newBreaker(failures, window int, base time.Duration) *breaker {
	if failures <= 0 {
		return nil
	}
	return &breaker{ring: make([]bool, window), threshold: failures, base: base}
}

// record adds one verdict (not verdictNone) and reports whether the window
// now holds threshold failures: the replica should be ejected.
func (br *breaker) record(failed bool) (trip bool) {
	if br.n == len(br.ring) {
		if br.ring[br.next] {
			br.fails--
		}
	} else {
		br.n++
	}
	br.ring[br.next] = failed
	if failed {
		br.fails++
	}
	br.next = (br.next + 1) % len(br.ring)
	return failed && br.fails >= br.threshold
}

// reset forgets the window.
func (br *breaker) reset() {
	clear(br.ring)
	br.next, br.n, br.fails = 0, 0, 0
}

// eject ejects the replica at now and returns for how long: base times its
// recent ejections, this one included, capped at breakerMaxEjectionFactor
// times base. Each base spent admitted since the last re-admission forgives
// one earlier ejection (Envoy decrements its ejection multiplier on every
// interval a host is not ejected).
func (br *breaker) eject(now time.Time) time.Duration {
	if !br.admittedSince.IsZero() {
		forgiven := int(now.Sub(br.admittedSince) / br.base)
		br.ejections = max(0, br.ejections-forgiven)
	}
	br.ejections = min(br.ejections+1, breakerMaxEjectionFactor)
	d := br.base * time.Duration(br.ejections)
	br.until = now.Add(d)
	br.reset()
	return d
}

// ejected reports whether the breaker holds the replica out.
func (br *breaker) ejected() bool { return br != nil && !br.until.IsZero() }

// due reports whether an ejected replica's time is up at now.
func (br *breaker) due(now time.Time) bool { return br.ejected() && !now.Before(br.until) }

// readmit ends the ejection at now, with a fresh window.
func (br *breaker) readmit(now time.Time) {
	br.until = time.Time{}
	br.admittedSince = now
	br.reset()
}

// verdict is what the attempt that returned res tells of its replica: ctx
// is the request's context (with RequestTimeout).
func (x *exchange) verdict(ctx context.Context, res result) verdict {
	if x.r.Context().Err() != nil || (x.cw != nil && x.cw.err != nil) {
		return verdictNone // the client left or stopped reading
	}
	if res.err == nil {
		if x.status >= 400 {
			return verdictNone // a 4xx: the request's fault as often as the replica's
		}
		return verdictOK
	}
	var ae *attemptError
	if !errors.As(res.err, &ae) {
		return verdictNone
	}
	if ctx.Err() != nil && errors.Is(ae.err, context.DeadlineExceeded) {
		return verdictNone // request_timeout: the client's budget ran out
	}
	return verdictFail
}

// observe feeds replica b's breaker the verdict of one attempt, and ejects b
// when it trips, if allowed (breakerMayEjectLocked).
func (p *Proxy) observe(b *backend, v verdict) {
	if v == verdictNone || b.brk == nil {
		return
	}
	now := time.Now()
	p.mu.Lock()
	if b.brk.ejected() || !b.Healthy() {
		p.mu.Unlock()
		return // out already: a late answer from before
	}
	if !b.brk.record(v == verdictFail) {
		p.mu.Unlock()
		return
	}
	if !p.breakerMayEjectLocked() {
		b.brk.reset() // N more failures before it is weighed again
		p.mu.Unlock()
		p.log.Warn("circuit breaker spared a failing replica: ejecting it would leave more than half of the healthy replicas out",
			"replica", b.Name, "breaker_failures", p.cfg.BreakerFailures, "breaker_window", p.cfg.BreakerWindow)
		return
	}
	d := b.brk.eject(now)
	b.oks = 0 // re-admission counts health checks from the ejection
	up, _ := p.pool.SetHealthy(b.Member, false)
	p.mu.Unlock()
	p.m.ejections.WithLabelValues(b.Name, ejectBreaker).Inc()
	p.log.Warn("replica ejected by the circuit breaker", "replica", b.Name, "for", d,
		"breaker_failures", p.cfg.BreakerFailures, "breaker_window", p.cfg.BreakerWindow)
	if p.hookState != nil {
		p.hookState(b.Name, up)
	}
}

// breakerMayEjectLocked reports whether the breaker may take one more
// replica out (Mu held): at most half of the replicas whose health checks
// pass may be out by the breaker at once, so it never takes the last one,
// and requests that fail everywhere (a poison request, a shared
// dependency down) cannot take out the pool. It is Envoy's
// max_ejection_percent at 50 (Envoy's default is 10, but it always lets one
// host out, which in pools of 2 to 16 replicas is up to 50%).
func (p *Proxy) breakerMayEjectLocked() bool {
	healthy, out := 0, 0
	for _, o := range p.backendsLocked() {
		if !o.Ready || !o.hcOK {
			continue
		}
		healthy++
		if o.brk.ejected() {
			out++
		}
	}
	return 2*(out+1) <= healthy
}
