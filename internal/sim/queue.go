package sim

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/router"
)

// QueueConfig configures the simulator's router-side queue: the same
// admission.Queue that serve and epp run, on the virtual clock.
type QueueConfig struct {
	// Admission is the queue and its saturation thresholds.
	Admission admission.Config
	// TTFTSLO is every request's TTFT deadline after its arrival (0: none),
	// unless SLOs gives its priority its own.
	TTFTSLO time.Duration
	// SLOs gives a priority its own TTFT deadline (0: none).
	SLOs map[int]time.Duration
	// Off runs no queue: the SLOs only label results (goodput), to measure
	// the same run without the queue.
	Off bool
}

// DefaultQueueConfig is the queue with admission's defaults and no SLO.
func DefaultQueueConfig() QueueConfig { return QueueConfig{Admission: admission.Default()} }

// Validate reports the first invalid field.
func (c *QueueConfig) Validate() error {
	if c.TTFTSLO < 0 {
		return fmt.Errorf("ttft_slo must be ≥ 0, got %v", c.TTFTSLO)
	}
	for p, d := range c.SLOs {
		if d < 0 {
			return fmt.Errorf("ttft_slo of priority %d must be ≥ 0, got %v", p, d)
		}
	}
	return c.Admission.Validate()
}

// slo is the TTFT deadline of a request of priority p.
func (c *QueueConfig) slo(p int) time.Duration {
	if d, ok := c.SLOs[p]; ok {
		return d
	}
	return c.TTFTSLO
}

// ParseQueueConfig parses `prefixlb sim --router-queue`: "on" (or "") for
// the defaults, else comma-separated KEY=VALUE of max (requests), timeout,
// max_waiting, max_kv_usage, max_queued_prefill, max_predicted_wait,
// slo_fraction, engage_after, lifo_after, max_inflight, ttft_slo, and
// ttft_slo.PRIORITY (an integer or high, normal, low) for one priority;
// "off" among them runs no queue and keeps the SLOs to report goodput by.
func ParseQueueConfig(s string) (QueueConfig, error) {
	c := DefaultQueueConfig()
	s = strings.TrimSpace(s)
	if s == "" || s == "on" || s == "true" {
		return c, nil
	}
	for part := range strings.SplitSeq(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if k == "off" && !ok {
			c.Off = true
			continue
		}
		if !ok {
			return c, fmt.Errorf("sim: --router-queue: %q is not KEY=VALUE", part)
		}
		var err error
		switch {
		case k == "max":
			c.Admission.MaxQueue, err = strconv.Atoi(v)
		case k == "timeout":
			c.Admission.Timeout, err = time.ParseDuration(v)
		case k == "max_waiting":
			c.Admission.MaxWaiting, err = strconv.Atoi(v)
		case k == "max_kv_usage":
			c.Admission.MaxKVUsage, err = strconv.ParseFloat(v, 64)
			if err == nil && math.IsNaN(c.Admission.MaxKVUsage) {
				err = fmt.Errorf("NaN")
			}
		case k == "max_inflight":
			c.Admission.MaxInFlight, err = strconv.Atoi(v)
		case k == "max_queued_prefill":
			c.Admission.MaxQueuedPrefill, err = time.ParseDuration(v)
		case k == "max_predicted_wait":
			c.Admission.MaxPredictedWait, err = time.ParseDuration(v)
		case k == "lifo_after":
			c.Admission.LIFOAfter, err = time.ParseDuration(v)
		case k == "slo_fraction":
			c.Admission.SLOFraction, err = strconv.ParseFloat(v, 64)
		case k == "engage_after":
			c.Admission.EngageAfter, err = time.ParseDuration(v)
		case k == "ttft_slo":
			c.TTFTSLO, err = time.ParseDuration(v)
		case strings.HasPrefix(k, "ttft_slo."):
			var p int
			if p, err = priorityOf(strings.TrimPrefix(k, "ttft_slo.")); err == nil {
				var d time.Duration
				if d, err = time.ParseDuration(v); err == nil {
					if c.SLOs == nil {
						c.SLOs = map[int]time.Duration{}
					}
					c.SLOs[p] = d
				}
			}
		default:
			return c, fmt.Errorf("sim: --router-queue: unknown key %q (max, timeout, max_waiting, max_kv_usage, max_queued_prefill, max_predicted_wait, slo_fraction, engage_after, lifo_after, max_inflight, ttft_slo, ttft_slo.PRIORITY)", k)
		}
		if err != nil {
			return c, fmt.Errorf("sim: --router-queue: %s: %w", k, err)
		}
	}
	return c, c.Validate()
}

// priorityOf is workload.PriorityOf (kept here to leave the import graph
// as it is: workload does not know sim).
func priorityOf(name string) (int, error) {
	switch strings.ToLower(name) {
	case "high":
		return 1, nil
	case "normal":
		return 0, nil
	case "low":
		return -1, nil
	}
	return strconv.Atoi(name)
}

// simQueue is the run's queue with a ticket per request and its timer.
type simQueue struct {
	cfg     *QueueConfig
	q       *admission.Queue
	tickets []admission.Ticket
	armed   time.Time // the earliest evQueue pending (zero: none)
	shed    func(*admission.Ticket)
	est     admission.DecodeAware
	room    []int
}

func (rn *runner) newSimQueue(c *QueueConfig, n int) (*simQueue, error) {
	q, err := admission.New(c.Admission)
	if err != nil {
		return nil, fmt.Errorf("sim: queue: %w", err)
	}
	sq := &simQueue{cfg: c, q: q, tickets: make([]admission.Ticket, n)}
	sq.est = admission.DecodeAware{Profile: rn.rt.PricedProfile, Reps: rn.rt.Load, Prefill: rn.prefillEstimate}
	q.SetEstimator(&sq.est)
	return sq, nil
}

// prefillEstimate is request t's own prefill on replica id, priced by the
// router as if routed there now.
func (rn *runner) prefillEstimate(t *admission.Ticket, id int) time.Duration {
	i := int(t.ID)
	w := &rn.reqs[i]
	req := policy.Request{ID: t.ID, Keys: rn.st[i].keys, PromptTokens: len(w.Tokens), OutputTokens: max(w.OutputTokens, 1),
		Session: w.Session, Adapter: w.Adapter}
	return rn.rt.PrefillEstimate(&req, id)
}

// queueArrive offers request i, arriving at now, to the queue: routed now,
// queued, or shed.
func (rn *runner) queueArrive(i int, now time.Time) {
	sq := rn.q
	w := &rn.reqs[i]
	t := &sq.tickets[i]
	*t = admission.Ticket{ID: uint64(i), Priority: w.Priority, Tenant: w.Tenant, Arrival: now}
	if d := sq.cfg.slo(w.Priority); d > 0 {
		t.Deadline = now.Add(d)
	}
	v, displaced := sq.q.Arrive(t, rn.rt.Load(), now)
	if displaced != nil {
		rn.shedRequest(displaced)
	}
	switch v {
	case admission.Pass:
		rn.route(i, now)
	case admission.Shed:
		rn.shedRequest(t)
	case admission.Queued:
		rn.armQueue()
	}
}

// queueDispatch routes what the queue lets through now (capacity may have
// freed: a replica ended an iteration), shedding what expired.
func (rn *runner) queueDispatch(now time.Time) {
	sq := rn.q
	if sq.q.Len() == 0 {
		return
	}
	if sq.shed == nil {
		sq.shed = rn.shedRequest
	}
	for t := sq.q.Next(rn.rt.Load(), now, sq.shed); t != nil; t = sq.q.Next(rn.rt.Load(), now, sq.shed) {
		// Only among the replicas with room (GIE's saturation Filter).
		sq.room = sq.q.Room(rn.rt.Load(), sq.room[:0])
		rn.routeWithin(int(t.ID), now, router.Constraint{Only: sq.room})
	}
	rn.armQueue()
}

// queueTimer is the queue's timer: shed what is due, dispatch what fits.
func (rn *runner) queueTimer(now time.Time) {
	if now.Equal(rn.q.armed) {
		rn.q.armed = time.Time{}
	}
	rn.queueDispatch(now)
}

// armQueue schedules an evQueue at the queue's next due time, unless one
// is pending no later.
func (rn *runner) armQueue() {
	sq := rn.q
	at, ok := sq.q.NextDue(rn.rt.Load())
	if !ok || (!sq.armed.IsZero() && !at.Before(sq.armed)) {
		return
	}
	sq.armed = at
	rn.push(at, evQueue, 0, replica.Event{})
}

// shedRequest ends request t as shed, with its reason as its error.
func (rn *runner) shedRequest(t *admission.Ticket) {
	s := &rn.st[t.ID]
	s.err = "shed: " + t.Reason.String()
	rn.ended(int(t.ID))
}
