package admission

import (
	"cmp"
	"container/heap"
	"math"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// Reason is why a request was shed.
type Reason uint8

// Reasons a request is shed.
const (
	// QueueFull: the queue was at MaxQueue and nothing of a lower
	// priority could make room.
	QueueFull Reason = iota
	// Timeout: the request waited Config.Timeout.
	Timeout
	// Deadline: the request can no longer meet its TTFT deadline (the
	// pool's least predicted wait and its own prefill say so).
	Deadline
	// PoolDown: no replica of the pool takes requests.
	PoolDown
	numReasons
)

var reasonNames = [numReasons]string{QueueFull: "queue_full", Timeout: "timeout", Deadline: "deadline", PoolDown: "pool_down"}

// String is the reason's metric label.
func (r Reason) String() string {
	if r < numReasons {
		return reasonNames[r]
	}
	return "unknown"
}

// Reasons lists every reason, for metrics that want all their children.
func Reasons() []Reason { return []Reason{QueueFull, Timeout, Deadline, PoolDown} }

// Verdict is what Arrive decided for a request.
type Verdict uint8

// Verdicts of Arrive.
const (
	// Pass: route the request now (the fast path).
	Pass Verdict = iota
	// Queued: the request waits; Next or Expire will end its wait.
	Queued
	// Shed: the request is refused (Ticket.Reason says why).
	Shed
)

// Ticket is one request as the queue knows it. The caller fills the
// exported fields before Arrive and must not change them while it waits.
type Ticket struct {
	// ID identifies the request to the caller.
	ID uint64
	// Priority orders requests: higher first (GIE's InferenceObjective
	// priority: negative allowed, unset is 0).
	Priority int
	// Tenant is the flow the request is fair-shared in within its priority.
	Tenant string
	// Arrival is when the request reached the router.
	Arrival time.Time
	// Deadline is when its first token is due (arrival + its TTFT SLO);
	// zero: none.
	Deadline time.Time
	// Service is the estimate of the request's own time to first token
	// once it starts (0: unknown, counted as none: the queue sheds by
	// deadline only a request that cannot make it even so). When it is 0
	// and the request has a deadline and is not let straight through,
	// Arrive asks the queue's Estimator (SetEstimator).
	Service time.Duration
	// Reason is why it was shed (valid after a Shed verdict or a shed
	// callback).
	Reason Reason

	state        state
	flow         *flow
	tIdx, dIdx   int // indexes in the timeout and deadline heaps (-1: not in)
	expires, due time.Time
	// reprieved: it could not meet its deadline but its tenant is lighter
	// than the heaviest, so it waits in rq (due: when it is hopeless)
	// instead of dq.
	reprieved bool
}

type state uint8

const (
	stateNew state = iota
	stateQueued
	stateDone
)

// Waiting reports whether the ticket is in the queue.
func (t *Ticket) Waiting() bool { return t.state == stateQueued }

// Stats counts what the queue did. Every request that arrived is in
// exactly one of Passed, Dispatched, Shed, Cancelled or the queue (Len).
type Stats struct {
	// Arrived counts calls to Arrive.
	Arrived int64
	// Passed counts requests let through at once (not saturated, nothing
	// waiting), Queued those that waited, Dispatched those that waited and
	// were then let through.
	Passed, Queued, Dispatched int64
	// Shed counts shed requests by reason.
	Shed [numReasons]int64
	// Cancelled counts requests whose client left while they waited.
	Cancelled int64
}

// ShedTotal is the sum of Shed.
func (s *Stats) ShedTotal() int64 {
	var n int64
	for _, v := range s.Shed {
		n += v
	}
	return n
}

// flow is one tenant's FIFO within a band.
type flow struct {
	tenant  string
	items   []*Ticket // FIFO from head; done tickets are skipped
	head    int
	n       int // tickets still waiting
	weight  float64
	deficit float64
	visited bool // got its quantum in the current round
	active  bool
	band    *band
}

func (f *flow) push(t *Ticket) { f.items = append(f.items, t); f.n++ }

// popHead removes and returns the oldest waiting ticket.
func (f *flow) popHead() *Ticket {
	for f.head < len(f.items) {
		t := f.items[f.head]
		f.items[f.head] = nil
		f.head++
		if t.state == stateQueued {
			f.compact()
			return t
		}
	}
	return nil
}

// peekHead returns the oldest waiting ticket, dropping the done ones
// before it.
func (f *flow) peekHead() *Ticket {
	for f.head < len(f.items) {
		if t := f.items[f.head]; t.state == stateQueued {
			return t
		}
		f.items[f.head] = nil
		f.head++
	}
	return nil
}

// popFresh returns the oldest waiting ticket that is not reprieved (see
// Queue.lighter), else the oldest: a reprieved ticket, dispatched late, is
// likely to miss its deadline, and ahead of fresher ones it would make
// them late too. A ticket taken from the middle leaves its slot, skipped
// once done.
func (f *flow) popFresh() *Ticket {
	h := f.peekHead()
	if h == nil || !h.reprieved {
		return f.popHead()
	}
	for _, t := range f.items[f.head+1:] {
		if t != nil && t.state == stateQueued && !t.reprieved {
			return t
		}
	}
	return f.popHead()
}

// popTail removes and returns the newest waiting ticket.
func (f *flow) popTail() *Ticket {
	for len(f.items) > f.head {
		t := f.items[len(f.items)-1]
		f.items[len(f.items)-1] = nil
		f.items = f.items[:len(f.items)-1]
		if t.state == stateQueued {
			return t
		}
	}
	return nil
}

// compact drops the consumed head once it is most of the slice.
func (f *flow) compact() {
	if f.head > 32 && f.head*2 > len(f.items) {
		n := copy(f.items, f.items[f.head:])
		clear(f.items[n:])
		f.items, f.head = f.items[:n], 0
	}
}

// band is one priority's flows, served by deficit round robin.
type band struct {
	prio   int
	flows  map[string]*flow
	active []*flow // flows with waiting tickets, in round order
	cur    int
	n      int
}

// Queue is the router-side queue: see the package comment.
type Queue struct {
	cfg   Config
	bands []*band // by priority, highest first
	n     int
	tq    tHeap // by expiry (Arrival + Timeout)
	dq    dHeap // by due (Deadline − Service)
	rq    dHeap // reprieved tickets, by due (Deadline − Service)
	stats Stats
	spare []*flow // emptied flows, reused
	est   Estimator
	// demand is each tenant's recent demand while the queue is engaged
	// (an exponentially decayed count of its arrivals past the fast path),
	// which the deadline shed reads to shed from the heaviest tenant first.
	demand map[string]*rate
	// eff is cfg with MaxPredictedWait lowered by SLOFraction to a
	// fraction of tight, the tightest TTFT SLO seen within SLOWindow
	// (last seen at tightAt): the thresholds Judge and Room apply.
	eff     Config
	tight   time.Duration
	tightAt time.Time
	// satSince is when the pool was first judged saturated at an arrival
	// or a dispatch with no judgement since that it was not (zero: not
	// saturated): EngageAfter counts from it.
	satSince time.Time
}

// rate is a decayed arrival count: n·exp(−(now−at)/DemandWindow).
type rate struct {
	n  float64
	at time.Time
}

// DemandWindow is the time constant of the decayed per-tenant arrival
// count the deadline shed compares tenants by.
const DemandWindow = 2 * time.Second

func (r *rate) decay(now time.Time) float64 {
	if dt := now.Sub(r.at); dt > 0 {
		r.n *= math.Exp(-dt.Seconds() / DemandWindow.Seconds())
		r.at = now
	}
	return r.n
}

// SetEstimator makes e predict the replicas' waits for the saturation test
// and the deadline shed, and the requests' own Service (nil: the queued
// prefill, and the Service the caller gave).
func (q *Queue) SetEstimator(e Estimator) { q.est = e }

// Room is Config.Room under the queue's estimator: where a dispatched
// request may go.
func (q *Queue) Room(reps []policy.Replica, dst []int) []int { return q.eff.Room(reps, q.est, dst) }

// Judge is the pool's saturation test under the queue's estimator.
func (q *Queue) Judge(reps []policy.Replica) Pool { return q.eff.Judge(reps, q.est) }

// Threshold is the predicted-wait threshold in force (Config.
// MaxPredictedWait, lowered by Config.SLOFraction to a fraction of the
// tightest recent TTFT SLO).
func (q *Queue) Threshold() time.Duration { return q.eff.MaxPredictedWait }

// observeSLO lowers the predicted-wait threshold to SLOFraction of slo
// (raised to MinTTFTSLO) when slo is the tightest SLO of the last
// SLOWindow, and raises it back once the tightest has not been seen for
// that long. However tight the SLO, the threshold stays above 0: 0 would
// turn the predicted-wait test off.
func (q *Queue) observeSLO(slo time.Duration, now time.Time) {
	if q.cfg.SLOFraction <= 0 || q.cfg.MaxPredictedWait <= 0 || slo <= 0 {
		return
	}
	slo = max(slo, q.cfg.MinTTFTSLO)
	if q.tight > 0 && slo > q.tight && now.Sub(q.tightAt) <= SLOWindow {
		return
	}
	q.tight, q.tightAt = slo, now
	q.eff.MaxPredictedWait = max(1, min(q.cfg.MaxPredictedWait, time.Duration(q.cfg.SLOFraction*float64(slo))))
}

// observe keeps satSince: when the pool's saturation began, zero while it
// is not saturated.
func (q *Queue) observe(saturated bool, now time.Time) {
	switch {
	case !saturated:
		q.satSince = time.Time{}
	case q.satSince.IsZero():
		q.satSince = now
	}
}

// New returns an empty queue.
func New(cfg Config) (*Queue, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Queue{cfg: cfg, eff: cfg}, nil
}

// Config returns the queue's configuration.
func (q *Queue) Config() *Config { return &q.cfg }

// Len is the number of requests waiting.
func (q *Queue) Len() int { return q.n }

// Stats returns the queue's counters.
func (q *Queue) Stats() Stats { return q.stats }

// Arrive decides for request t, arriving at now, over the pool's replicas
// reps (the router's live view): Pass when nothing waits and the pool is
// not saturated, or has been for less than Config.EngageAfter (no
// allocation on that path), Shed when no replica is up
// (PoolDown), when it cannot meet its deadline or when the queue is full,
// else Queued. A full queue makes room, when it can, by shedding the
// newest request of the heaviest tenant in the lowest priority below t's:
// that request is returned as displaced (its Reason QueueFull), for the
// caller to answer.
func (q *Queue) Arrive(t *Ticket, reps []policy.Replica, now time.Time) (v Verdict, displaced *Ticket) {
	q.stats.Arrived++
	if !t.Deadline.IsZero() {
		q.observeSLO(t.Deadline.Sub(t.Arrival), now)
	}
	p := q.Judge(reps)
	q.observe(p.Saturated, now)
	switch {
	case p.Up == 0:
		return q.refuse(t, PoolDown), nil
	case q.n == 0 && (!p.Saturated || now.Sub(q.satSince) < q.cfg.EngageAfter):
		q.stats.Passed++
		t.state = stateDone
		return Pass, nil
	}
	q.count(t.Tenant, now)
	reprieve := false
	if !t.Deadline.IsZero() {
		if t.Service == 0 && q.est != nil {
			t.Service = q.est.Service(t, p.Best)
		}
		if !now.Add(p.MinWait + t.Service).Before(t.Deadline) {
			if !q.lighter(t, now) {
				return q.refuse(t, Deadline), nil
			}
			reprieve = true
		}
	}
	if q.n >= q.cfg.MaxQueue {
		displaced = q.displace(t.Priority)
		if displaced == nil {
			return q.refuse(t, QueueFull), nil
		}
	}
	q.push(t, now)
	if reprieve {
		q.toReprieve(t)
	}
	q.stats.Queued++
	return Queued, displaced
}

// count adds an arrival of tenant to its recent demand.
func (q *Queue) count(tenant string, now time.Time) {
	if q.demand == nil {
		q.demand = map[string]*rate{}
	}
	r := q.demand[tenant]
	if r == nil {
		r = &rate{at: now}
		q.demand[tenant] = r
	}
	r.decay(now)
	r.n++
}

// lighter reports whether t, which cannot meet its deadline by the pool's
// predicted wait, should wait anyway: its own time to first token still
// fits (now + Service before Deadline), and its tenant's recent demand
// (per weight) is below the heaviest tenant's. The deadline shed then
// falls on the heaviest tenant first, as a fair queue's buffer drops from
// its longest flow (longest queue drop: Suter et al., "Design
// considerations for supporting TCP with per-flow queueing", INFOCOM
// 1998), instead of on every tenant in proportion to its demand: a light
// tenant gets up to its max-min fair share of what is dispatched. Tenants
// that sent nothing lately are forgotten.
func (q *Queue) lighter(t *Ticket, now time.Time) bool {
	if !now.Add(t.Service).Before(t.Deadline) {
		return false
	}
	own := -1.0
	heaviest := 0.0
	for k, r := range q.demand {
		d := r.decay(now) / q.cfg.weight(k)
		if d < 1e-3 {
			delete(q.demand, k)
			continue
		}
		if k == t.Tenant {
			own = d
		}
		heaviest = max(heaviest, d)
	}
	return own >= 0 && own < heaviest
}

// toReprieve moves waiting ticket t from the deadline heap to the
// reprieved one, where it is shed once hopeless (now + Service at its
// Deadline).
func (q *Queue) toReprieve(t *Ticket) {
	if t.dIdx >= 0 {
		heap.Remove(&q.dq, t.dIdx)
	}
	t.reprieved = true
	heap.Push(&q.rq, t)
}

func (q *Queue) refuse(t *Ticket, r Reason) Verdict {
	t.state, t.Reason = stateDone, r
	q.stats.Shed[r]++
	return Shed
}

// push puts t in its band and flow, and in the heaps.
func (q *Queue) push(t *Ticket, now time.Time) {
	b := q.band(t.Priority)
	f := b.flows[t.Tenant]
	if f == nil {
		if k := len(q.spare); k > 0 {
			f, q.spare = q.spare[k-1], q.spare[:k-1]
		} else {
			f = &flow{}
		}
		f.tenant, f.weight, f.band = t.Tenant, q.cfg.weight(t.Tenant), b
		b.flows[t.Tenant] = f
	}
	if !f.active {
		f.active, f.deficit, f.visited = true, 0, false
		b.active = append(b.active, f)
	}
	f.push(t)
	b.n++
	q.n++
	t.state, t.flow = stateQueued, f
	t.expires = t.Arrival.Add(q.cfg.Timeout)
	if t.expires.Before(now) {
		t.expires = now
	}
	t.tIdx, t.dIdx, t.reprieved = -1, -1, false
	heap.Push(&q.tq, t)
	if !t.Deadline.IsZero() {
		t.due = t.Deadline.Add(-t.Service)
		heap.Push(&q.dq, t)
	}
}

// band returns priority p's band, made if needed.
func (q *Queue) band(p int) *band {
	// Highest first: band i sorts before p when its priority is higher.
	i, found := slices.BinarySearchFunc(q.bands, p, func(b *band, p int) int { return cmp.Compare(p, b.prio) })
	if found {
		return q.bands[i]
	}
	b := &band{prio: p, flows: map[string]*flow{}}
	q.bands = slices.Insert(q.bands, i, b)
	return b
}

// displace sheds the newest ticket of the heaviest flow of the lowest band
// below priority p, if any.
func (q *Queue) displace(p int) *Ticket {
	for i := len(q.bands) - 1; i >= 0; i-- {
		b := q.bands[i]
		if b.prio >= p {
			return nil
		}
		if b.n == 0 {
			continue
		}
		var heavy *flow
		for _, f := range b.active {
			if heavy == nil || f.n > heavy.n {
				heavy = f
			}
		}
		t := heavy.popTail()
		q.remove(t)
		t.Reason = QueueFull
		q.stats.Shed[QueueFull]++
		return t
	}
	return nil
}

// remove takes waiting ticket t out of its flow's count, its band, the
// heaps and the queue; its slot in the flow's FIFO is skipped later.
func (q *Queue) remove(t *Ticket) {
	f := t.flow
	f.n--
	t.state, t.flow = stateDone, nil
	if t.tIdx >= 0 {
		heap.Remove(&q.tq, t.tIdx)
	}
	if t.dIdx >= 0 {
		if t.reprieved {
			heap.Remove(&q.rq, t.dIdx)
		} else {
			heap.Remove(&q.dq, t.dIdx)
		}
	}
	q.n--
	b := f.band
	b.n--
	if f.n == 0 {
		q.retire(b, f)
	}
	if b.n == 0 {
		i := slices.Index(q.bands, b)
		q.bands = slices.Delete(q.bands, i, i+1)
	}
}

// retire takes emptied flow f out of band b.
func (q *Queue) retire(b *band, f *flow) {
	i := slices.Index(b.active, f)
	b.active = slices.Delete(b.active, i, i+1)
	if b.cur > i || b.cur >= len(b.active) {
		if b.cur > i {
			b.cur--
		}
		if b.cur >= len(b.active) {
			b.cur = 0
		}
	}
	delete(b.flows, f.tenant)
	clear(f.items)
	*f = flow{items: f.items[:0]}
	q.spare = append(q.spare, f)
}

// Next returns the next request to route, or nil: while the pool has room
// (not saturated), the highest priority's next flow in deficit round robin
// gives its oldest request. It first sheds what Expire would, through shed.
// Call it until nil after anything that may free capacity (a first token,
// a finish, a load report, a replica coming up), routing each request it
// returns before the next call so that the view counts it.
func (q *Queue) Next(reps []policy.Replica, now time.Time, shed func(*Ticket)) *Ticket {
	if q.n == 0 {
		return nil
	}
	p := q.Judge(reps)
	q.observe(p.Saturated, now)
	q.expire(p, now, shed)
	if q.n == 0 || p.Saturated || p.Up == 0 {
		return nil
	}
	b := q.bands[0]
	t := q.popBand(b, now)
	q.remove(t)
	q.stats.Dispatched++
	return t
}

// popBand picks band b's next ticket by deficit round robin (quantum: the
// flow's weight; cost: one request) and takes it off its flow's FIFO: the
// oldest not reprieved (popFresh), or with adaptive LIFO (Config.LIFOAfter) the newest while the
// oldest has waited that long.
func (q *Queue) popBand(b *band, now time.Time) *Ticket {
	for {
		f := b.active[b.cur]
		if !f.visited {
			f.deficit += f.weight
			f.visited = true
		}
		if f.deficit >= 1 {
			f.deficit--
			var t *Ticket
			if q.cfg.LIFOAfter > 0 {
				if h := f.peekHead(); h != nil && now.Sub(h.Arrival) >= q.cfg.LIFOAfter {
					t = f.popTail()
				}
			}
			if t == nil {
				t = f.popFresh()
			}
			if f.deficit < 1 && f.n > 1 {
				// Its turn is over: the next flow's comes.
				f.visited = false
				b.cur = (b.cur + 1) % len(b.active)
			}
			return t
		}
		f.visited = false
		b.cur = (b.cur + 1) % len(b.active)
	}
}

// Expire sheds, through shed, every waiting request past its timeout, every
// one that can no longer meet its deadline (now + the pool's least
// predicted wait + its Service at or past its Deadline) unless its tenant
// is lighter than the heaviest (see lighter: then it waits until now +
// its Service reaches its Deadline), and every one when no replica is up. After it, NextDue is after now. Next calls it; call it too from a timer at NextDue.
func (q *Queue) Expire(reps []policy.Replica, now time.Time, shed func(*Ticket)) {
	if q.n == 0 {
		return
	}
	q.expire(q.Judge(reps), now, shed)
}

func (q *Queue) expire(p Pool, now time.Time, shed func(*Ticket)) {
	if p.Up == 0 {
		for q.n > 0 {
			q.shed(q.tq[0], PoolDown, shed)
		}
		return
	}
	for len(q.tq) > 0 && !q.tq[0].expires.After(now) {
		q.shed(q.tq[0], Timeout, shed)
	}
	horizon := now.Add(p.MinWait)
	for len(q.dq) > 0 && !q.dq[0].due.After(horizon) {
		if t := q.dq[0]; q.lighter(t, now) {
			q.toReprieve(t)
		} else {
			q.shed(t, Deadline, shed)
		}
	}
	for len(q.rq) > 0 && !q.rq[0].due.After(now) {
		q.shed(q.rq[0], Deadline, shed)
	}
}

func (q *Queue) shed(t *Ticket, r Reason, fn func(*Ticket)) {
	q.remove(t)
	t.Reason = r
	q.stats.Shed[r]++
	if fn != nil {
		fn(t)
	}
}

// Cancel takes t out of the queue (its client left): true if it was
// waiting, false if it had already been dispatched or shed.
func (q *Queue) Cancel(t *Ticket) bool {
	if t.state != stateQueued {
		return false
	}
	q.remove(t)
	q.stats.Cancelled++
	return true
}

// NextDue is when Expire next has something to shed if nothing else
// changes: the earliest timeout, or the earliest deadline less the pool's
// least predicted wait. ok is false when nothing waits.
func (q *Queue) NextDue(reps []policy.Replica) (at time.Time, ok bool) {
	if q.n == 0 {
		return time.Time{}, false
	}
	at = q.tq[0].expires
	if len(q.dq) > 0 {
		d := q.dq[0].due.Add(-q.Judge(reps).MinWait)
		if d.Before(at) {
			at = d
		}
	}
	if len(q.rq) > 0 && q.rq[0].due.Before(at) {
		at = q.rq[0].due
	}
	return at, true
}

// Flow is one tenant's waiting requests within a priority, for a debug
// view and metrics.
type Flow struct {
	Priority int       `json:"priority"`
	Tenant   string    `json:"tenant"`
	Waiting  int       `json:"waiting"`
	Oldest   time.Time `json:"oldest"`
}

// Flows appends the waiting flows to dst, highest priority first, tenants
// in round order.
func (q *Queue) Flows(dst []Flow) []Flow {
	for _, b := range q.bands {
		for _, f := range b.active {
			fl := Flow{Priority: b.prio, Tenant: f.tenant, Waiting: f.n}
			for _, t := range f.items[f.head:] {
				if t != nil && t.state == stateQueued {
					fl.Oldest = t.Arrival
					break
				}
			}
			dst = append(dst, fl)
		}
	}
	return dst
}

// tHeap orders waiting tickets by expiry.
type tHeap []*Ticket

func (h tHeap) Len() int           { return len(h) }
func (h tHeap) Less(i, j int) bool { return h[i].expires.Before(h[j].expires) }
func (h tHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].tIdx, h[j].tIdx = i, j
}
func (h *tHeap) Push(x any) {
	t := x.(*Ticket)
	t.tIdx = len(*h)
	*h = append(*h, t)
}
func (h *tHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	t.tIdx = -1
	return t
}

// dHeap orders waiting tickets with a deadline by due time.
type dHeap []*Ticket

func (h dHeap) Len() int           { return len(h) }
func (h dHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].dIdx, h[j].dIdx = i, j
}
func (h *dHeap) Push(x any) {
	t := x.(*Ticket)
	t.dIdx = len(*h)
	*h = append(*h, t)
}
func (h *dHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	t.dIdx = -1
	return t
}
