package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// ErrShed is returned for a request the router-side queue shed (429, or
// 503 with no replica up); it matches cluster.ErrShed.
var ErrShed = cluster.ErrShed

// admitRoute is route for a request's first attempt through the
// router-side queue: routed at once below saturation (Pass, in the same
// lock as without a queue), else held until the queue dispatches it, and
// routed then, or shed. Its class comes from its tenant (x.tq.who), its
// model and, from a trusted proxy, its headers.
func (p *Proxy) admitRoute(ctx context.Context, x *exchange, model string, req policy.Request) (d policy.Decision, b, prefill *backend, err error) {
	now := time.Now()
	w := &cluster.Waiter{Ticket: admission.Ticket{ID: req.ID, Arrival: now}, Request: &req}
	if err := p.gate.Config().Classify(&w.Ticket, model, &x.tq.who, x.r.Header.Get); err != nil {
		return d, nil, nil, fmt.Errorf("proxy: %w: %w", openai.ErrBadRequest, err)
	}
	at := now
	w.Dispatch = func(now time.Time) {
		at = now
		d, err = p.rt.RouteWithin(req, now, router.Constraint{Only: w.Room})
		if err == nil {
			b = p.pool.Member(d.Replica).Front.(*backend)
			if d.Disaggregated {
				prefill = p.pool.Member(d.PrefillReplica).Front.(*backend)
			}
		}
	}
	p.mu.Lock()
	switch p.gate.ArriveLocked(w, now) {
	case admission.Pass:
		w.Dispatch(now)
		p.mu.Unlock()
	case admission.Shed:
		p.mu.Unlock()
		return d, nil, nil, shedError(w.Ticket.Reason)
	default:
		p.mu.Unlock()
		if werr := p.gate.Wait(ctx, w); werr != nil {
			var se *cluster.ShedError
			if errors.As(werr, &se) {
				return d, nil, nil, shedError(se.Reason)
			}
			return d, nil, nil, fmt.Errorf("proxy: left the queue: %w", werr)
		}
	}
	if err == nil {
		p.dash.record(at, req.PromptTokens, &d)
	}
	return d, b, prefill, err
}

// shedError is the error a shed request is answered with: 503 when the
// pool has no replica up (policy.ErrNoReplica), else 429 (ErrOverloaded).
func shedError(r admission.Reason) error {
	if r == admission.PoolDown {
		return fmt.Errorf("proxy: %w: %w (%s)", policy.ErrNoReplica, ErrShed, r)
	}
	return fmt.Errorf("proxy: %w: %w (%s)", ErrOverloaded, ErrShed, r)
}

// writeShed answers a shed request: its status with Retry-After and an
// OpenAI error body.
func writeShed(w http.ResponseWriter, err error, retryAfter time.Duration) int {
	w.Header().Set("Retry-After", strconv.Itoa(max(1, int(retryAfter.Round(time.Second)/time.Second))))
	return writeError(w, err)
}

// kickLocked re-judges the queue (Mu held): capacity may have freed.
func (p *Proxy) kickLocked(now time.Time) {
	if p.gate != nil {
		p.gate.KickLocked(now)
	}
}

// serveDebugQueue is GET /debug/queue: the router-side queue's waiting
// flows, counters and configuration, and the pool's saturation now.
func (p *Proxy) serveDebugQueue(w http.ResponseWriter, r *http.Request) {
	if p.gate == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	p.mu.Lock()
	st := p.gate.StateLocked()
	p.mu.Unlock()
	writeJSON(w, http.StatusOK, st)
}
