package sim

import (
	"math"
	"time"
)

// links models the network that carries disaggregated requests' KV from
// their prefill replica to their decode replica: every replica has one link
// of bw bytes/s each way, shared equally by the transfers using it (egress
// on the prefill side, ingress on the decode side), so a transfer moves at
// bw / max(transfers leaving its source, transfers entering its
// destination), recomputed whenever one starts or ends (processor sharing,
// as TCP or RDMA flows through one NIC share it). Every transfer then pays
// the latency lat once, after its last byte: the decode side's notification
// and the first byte's way across, as vLLM's NixlConnector reads the blocks
// and then tells the prefill side to free them.
//
// It reads no clock: every method takes the time from the simulator, in
// order.
type links struct {
	bw     float64 // bytes per second per link
	lat    time.Duration
	active []*transfer
	out    []int // transfers leaving each replica
	in     []int // transfers entering each replica
	last   time.Time
	gen    uint64 // bumped whenever the next completion may move
}

// transfer is one request's KV on its way.
type transfer struct {
	req      int // request index in the run
	src, dst int
	left     float64 // bytes still to move
	rate     float64 // bytes per second now
	started  time.Time
}

func newLinks(replicas int, bw float64, lat time.Duration) *links {
	return &links{bw: bw, lat: lat, out: make([]int, replicas), in: make([]int, replicas)}
}

// advance moves every active transfer on to now at its current rate.
func (l *links) advance(now time.Time) {
	if dt := now.Sub(l.last).Seconds(); dt > 0 {
		for _, t := range l.active {
			t.left = math.Max(t.left-t.rate*dt, 0)
		}
	}
	l.last = now
}

// rates gives each active transfer its share of its two links.
func (l *links) rates() {
	for _, t := range l.active {
		t.rate = l.bw / float64(max(l.out[t.src], l.in[t.dst], 1))
	}
	l.gen++
}

// start begins moving bytes for request req from src to dst at now.
func (l *links) start(req, src, dst int, bytes float64, now time.Time) {
	l.advance(now)
	l.active = append(l.active, &transfer{req: req, src: src, dst: dst, left: bytes, started: now})
	l.out[src]++
	l.in[dst]++
	l.rates()
}

// next is when the first active transfer moves its last byte at the
// current rates (rounded up to the nanosecond), and the generation that
// time belongs to; ok is false when none is active.
func (l *links) next() (at time.Time, gen uint64, ok bool) {
	best := math.Inf(1)
	for _, t := range l.active {
		best = math.Min(best, t.left/t.rate)
	}
	if math.IsInf(best, 1) {
		return time.Time{}, l.gen, false
	}
	return l.last.Add(time.Duration(math.Ceil(best * 1e9))), l.gen, true
}

// finish moves the transfers on to now and returns those done (their last
// byte moved: less than one byte, or a nanosecond's worth, left), removed
// from the links; the others' rates are recomputed.
func (l *links) finish(now time.Time, done []*transfer) []*transfer {
	l.advance(now)
	kept := l.active[:0]
	for _, t := range l.active {
		if t.left <= math.Max(1, t.rate*2e-9) {
			l.out[t.src]--
			l.in[t.dst]--
			done = append(done, t)
			continue
		}
		kept = append(kept, t)
	}
	clear(l.active[len(kept):])
	l.active = kept
	l.rates()
	return done
}
