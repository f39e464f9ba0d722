package epp

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// ErrPoolDown is returned for a request the queue shed because no replica
// is up (503).
var ErrPoolDown = errors.New("epp: no replica is up")

// admitPick is pickLocked through the router-side queue: picked at once
// below saturation, else once the queue dispatches the request (the
// policy then decides with the cluster as it is), or shed: ErrShed (429)
// or ErrPoolDown (503). A stream that ends while it waits leaves the queue.
// Its class comes from its tenant (id), its model and, when id is trusted
// (Config.Tenants.TrustClientHeaders), its class headers.
func (p *Picker) admitPick(ctx context.Context, req *policy.Request, model string, id *tenant.Identity, in Input, others map[string]router.ExternalLoad, now time.Time) (pick Pick, f *flight, err error) {
	get := headerOf(in)
	w := &cluster.Waiter{Ticket: admission.Ticket{ID: req.ID, Arrival: now}}
	if err := p.gate.Config().Classify(&w.Ticket, model, id, get); err != nil {
		return pick, nil, fmt.Errorf("%w: %w", openai.ErrBadRequest, err)
	}
	if obj := get(ObjectiveHeader); obj != "" && (!id.Trusted || get(cluster.PriorityHeader) == "") {
		if prio, ok := p.objectives.priority(obj); ok {
			w.Ticket.Priority = prio
		}
	}
	w.Request = req
	w.Dispatch = func(time.Time) {
		p.room = w.Room
		pick, f, err = p.pickLocked(req, in.Subset, others)
		p.room = nil
	}
	p.mu.Lock()
	switch p.gate.ArriveLocked(w, now) {
	case admission.Pass:
		w.Dispatch(now)
		p.mu.Unlock()
	case admission.Shed:
		p.mu.Unlock()
		return pick, nil, shedError(w.Ticket.Reason)
	default:
		p.mu.Unlock()
		if werr := p.gate.Wait(ctx, w); werr != nil {
			var se *cluster.ShedError
			if errors.As(werr, &se) {
				return pick, nil, shedError(se.Reason)
			}
			return pick, nil, fmt.Errorf("epp: left the queue: %w", werr)
		}
	}
	return pick, f, err
}

func shedError(r admission.Reason) error {
	if r == admission.PoolDown {
		return fmt.Errorf("%w: %w (%s)", ErrPoolDown, cluster.ErrShed, r)
	}
	return fmt.Errorf("%w: %w (%s)", ErrShed, cluster.ErrShed, r)
}
