// Package admission is prefixlb's router-side queue: it judges whether a
// pool of replicas is saturated from the router's live view of them, lets a
// request straight through while it is not, and otherwise holds requests in
// the router, ordered by priority and fair between tenants within a
// priority, until capacity frees, each then routed by the policy at dispatch
// time. The queue is bounded (a length, a per-request timeout) and sheds a
// request that can no longer meet its TTFT deadline before it costs GPU
// time. Every request ends as admitted (passed or dispatched), shed with a
// reason, or cancelled by its client, and is counted so.
//
// The design follows the Gateway API Inference Extension's flow control
// (kubernetes-sigs/gateway-api-inference-extension):
//   - strict priority between bands, highest first, and rejection at
//     capacity: pkg/epp/flowcontrol/controller/internal/processor.go at
//     04a97e67f7807b7daa14f220c25884eabfd80ea6 (dispatchCycle, hasCapacity);
//   - fairness only between flows (here: tenants) of one priority, each flow
//     first come first served: pkg/epp/flowcontrol/framework/policies.go at
//     0e05556d3ffe8a641a0fc2aa22c21847dc35bd45 (InterFlowDispatchPolicy,
//     IntraFlowDispatchPolicy); the inter-flow policy here is deficit round
//     robin with weights (Shreedhar and Varghese, "Efficient Fair Queuing
//     Using Deficit Round-Robin", SIGCOMM 1995);
//   - the saturation test is the utilization detector's roofline per pod,
//     max(waiting/QueueDepthThreshold, kv/KVCacheUtilThreshold):
//     pkg/epp/saturationdetector/framework/plugins/utilizationdetector/detector.go
//     at 275ac7609b1c32ce3768ad8b61b712d554b5ed3a, with E2's queued prefill
//     (Preble, §4: the replica's pending prefill time) as a third resource.
//     A pool is saturated when no replica passes the detector's Filter, that
//     is when every replica is at a threshold.
//
// Like the router, the package is pure: it reads no clock (the caller passes
// now), starts no goroutine and does no I/O, so that `prefixlb sim` drives
// it on its virtual clock. A Queue is not safe for concurrent use; its owner
// serialises calls (serve and epp under the routing core's lock, sim on its
// one goroutine).
package admission

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// Defaults of Config. The saturation thresholds are set where a replica is
// past its capacity, not merely busy: below saturation the queue never
// engages (docs/overload.md measures it).
const (
	// DefaultMaxQueue bounds the requests waiting in the router.
	DefaultMaxQueue = 1024
	// DefaultTimeout is the longest a request waits in the router.
	DefaultTimeout = 30 * time.Second
	// DefaultMaxWaiting is the engine's waiting queue (vLLM's
	// num_requests_waiting) at which a replica counts as saturated. GIE's
	// utilization detector uses 5 (DefaultQueueDepthThreshold); a vLLM
	// replica near capacity but keeping up queues a few requests between
	// two scheduler steps, so this leaves it more room.
	DefaultMaxWaiting = 8
	// DefaultMaxKVUsage is the KV-cache usage (blocks held by requests) at
	// which a replica counts as saturated: vLLM preempts past it. GIE's
	// default is 0.8.
	DefaultMaxKVUsage = 0.95
	// DefaultMaxQueuedPrefill is E2's queued prefill (the GPU time of the
	// prefills routed to the replica and not done) at which a replica
	// counts as saturated: 0, off by default since the predicted wait
	// (DefaultMaxPredictedWait) is that queued prefill stretched by the
	// running decodes, never less.
	DefaultMaxQueuedPrefill = 0
	// DefaultMaxPredictedWait is the predicted wait for a first token
	// (Estimator: the queued prefill stretched by the running decodes'
	// share of each chunked-prefill iteration) at which a replica counts
	// as saturated.
	DefaultMaxPredictedWait = 2 * time.Second
	// DefaultSLOFraction lowers the predicted-wait threshold to half the
	// tightest TTFT SLO of recent requests: a replica whose predicted wait
	// is at the SLO leaves a request routed there no slack for its own
	// prefill or for the estimate's error, and the queue none to order by
	// priority and share between tenants (docs/overload.md, round four).
	DefaultSLOFraction = 0.5
	// DefaultEngageAfter is how long the pool must stay saturated before
	// arrivals queue: a moment at a threshold between two scheduler steps
	// is not overload (CoDel's interval: Nichols and Jacobson,
	// "Controlling Queue Delay", ACM Queue 10(5), 2012).
	DefaultEngageAfter = 100 * time.Millisecond
	// DefaultMinTTFTSLO floors the TTFT SLO that lowers the predicted-wait
	// threshold (Config.MinTTFTSLO): at the default SLOFraction the
	// threshold never falls below 50 ms, about one chunked-prefill
	// iteration of 1.5k prompt tokens, or five decode steps of 32
	// sequences, of llama3.1-8b-h100 (costmodel). Below one engine
	// iteration every replica that runs anything counts as saturated, and
	// one request's SLO would hold the whole pool's traffic in the router.
	DefaultMinTTFTSLO = 100 * time.Millisecond
)

// SLOWindow is how long the queue remembers the tightest TTFT SLO it saw
// (Config.SLOFraction): a tighter one replaces it at once, a looser one
// only once no request has carried the tightest for this long.
const SLOWindow = 30 * time.Second

// Errors of Config.Validate.
var ErrConfig = errors.New("admission: invalid config")

// Config configures a Queue and its saturation test. Fill it from
// Default() and change what is needed.
type Config struct {
	// MaxQueue bounds the requests waiting (≥ 1). When it is full an
	// arrival displaces the newest request of the heaviest tenant of a
	// lower priority, or is shed (queue_full).
	MaxQueue int
	// Timeout bounds a request's wait in the router (> 0); past it the
	// request is shed (timeout).
	Timeout time.Duration
	// MaxWaiting is the engine waiting queue (policy.Replica.Queue) at
	// which a replica is saturated; 0 turns the test off.
	MaxWaiting int
	// MaxKVUsage is the KV-cache usage in (0,1] at which a replica is
	// saturated (block caches only: a slot cache's usage counts idle
	// slots); 0 turns the test off.
	MaxKVUsage float64
	// MaxQueuedPrefill is the queued prefill (policy.Replica.
	// PendingPrefill) at which a replica is saturated; 0 turns it off.
	MaxQueuedPrefill time.Duration
	// MaxPredictedWait is the predicted wait for a new request's first
	// token on a replica, before its own prefill (Estimator.Wait: queued
	// prefill stretched by decode interference), at which the replica is
	// saturated; 0 turns it off.
	MaxPredictedWait time.Duration
	// SLOFraction in [0,1) lowers MaxPredictedWait to this fraction of
	// the tightest TTFT SLO (Ticket.Deadline − Ticket.Arrival) of the
	// requests of the last SLOWindow, so that a replica counts as
	// saturated while a request routed to it still has slack to its
	// deadline; 0 turns it off. It never raises the threshold, and does
	// nothing while MaxPredictedWait is off.
	SLOFraction float64
	// MinTTFTSLO floors the SLOs SLOFraction reads: a tighter one lowers
	// the threshold as this one would (0: no floor). The front doors also
	// raise a header's SLO to it (cluster.QueueConfig.Classify).
	MinTTFTSLO time.Duration
	// EngageAfter is how long the pool must stay saturated (at every
	// arrival judged in between) before arrivals wait in the router; a
	// saturation that ends sooner lets them through. Once requests wait,
	// every arrival waits behind them until the queue empties. 0: at once.
	EngageAfter time.Duration
	// LIFOAfter turns on adaptive LIFO within a tenant: while the oldest
	// request of a flow has waited at least this long, the flow gives its
	// newest request first (it has the most slack to its deadline), as in
	// Facebook's server queues (Maurer, "Fail at Scale", ACM Queue 13(8),
	// 2015: controlled delay with adaptive LIFO); the old ones are shed
	// by their deadline or timeout. 0: first come first served always.
	LIFOAfter time.Duration
	// MaxInFlight is the requests in flight on a replica (routed by this
	// router, not finished: policy.Replica.InFlight) at which it is
	// saturated, GIE's concurrency detector
	// (pkg/epp/saturationdetector/framework/plugins/concurrencydetector/
	// detector.go at 1a00493aced6203942158c2b5409fecb78a64320, its
	// MaxConcurrency per endpoint); 0 turns it off, as it is by default: the
	// concurrency a replica sustains depends on the model and the GPU,
	// and the other thresholds do not need to be told it.
	MaxInFlight int
	// Weights are the tenants' weights in the fair share within a
	// priority (> 0 each); a tenant not listed weighs 1.
	Weights map[string]float64
}

// Default returns the default configuration: on, with thresholds that do
// not engage below saturation.
func Default() Config {
	return Config{MaxQueue: DefaultMaxQueue, Timeout: DefaultTimeout, MaxWaiting: DefaultMaxWaiting,
		MaxKVUsage: DefaultMaxKVUsage, MaxQueuedPrefill: DefaultMaxQueuedPrefill, MaxPredictedWait: DefaultMaxPredictedWait,
		SLOFraction: DefaultSLOFraction, EngageAfter: DefaultEngageAfter, MinTTFTSLO: DefaultMinTTFTSLO}
}

// Validate reports the first invalid field, by its name.
func (c *Config) Validate() error {
	switch {
	case c.MaxQueue < 1:
		return fmt.Errorf("%w: queue max must be ≥ 1, got %d", ErrConfig, c.MaxQueue)
	case c.Timeout <= 0:
		return fmt.Errorf("%w: queue timeout must be > 0, got %v", ErrConfig, c.Timeout)
	case c.MaxWaiting < 0:
		return fmt.Errorf("%w: max waiting must be ≥ 0, got %d", ErrConfig, c.MaxWaiting)
	case math.IsNaN(c.MaxKVUsage) || c.MaxKVUsage < 0 || c.MaxKVUsage > 1:
		return fmt.Errorf("%w: max kv usage must be in [0,1], got %v", ErrConfig, c.MaxKVUsage)
	case c.MaxQueuedPrefill < 0:
		return fmt.Errorf("%w: max queued prefill must be ≥ 0, got %v", ErrConfig, c.MaxQueuedPrefill)
	case c.MaxPredictedWait < 0:
		return fmt.Errorf("%w: max predicted wait must be ≥ 0, got %v", ErrConfig, c.MaxPredictedWait)
	case math.IsNaN(c.SLOFraction) || c.SLOFraction < 0 || c.SLOFraction >= 1:
		return fmt.Errorf("%w: slo fraction must be in [0,1), got %v", ErrConfig, c.SLOFraction)
	case c.MinTTFTSLO < 0:
		return fmt.Errorf("%w: min ttft slo must be ≥ 0, got %v", ErrConfig, c.MinTTFTSLO)
	case c.EngageAfter < 0:
		return fmt.Errorf("%w: engage after must be ≥ 0, got %v", ErrConfig, c.EngageAfter)
	case c.LIFOAfter < 0:
		return fmt.Errorf("%w: lifo after must be ≥ 0, got %v", ErrConfig, c.LIFOAfter)
	case c.MaxInFlight < 0:
		return fmt.Errorf("%w: max in flight must be ≥ 0, got %d", ErrConfig, c.MaxInFlight)
	case c.MaxWaiting == 0 && c.MaxKVUsage == 0 && c.MaxQueuedPrefill == 0 && c.MaxPredictedWait == 0 && c.MaxInFlight == 0:
		return fmt.Errorf("%w: every saturation threshold is off (max waiting, max kv usage, max queued prefill, max predicted wait, max in flight)", ErrConfig)
	}
	for t, w := range c.Weights {
		if !(w > 0) || math.IsInf(w, 0) {
			return fmt.Errorf("%w: weight of tenant %q must be > 0, got %v", ErrConfig, t, w)
		}
	}
	return nil
}

// weight is tenant t's weight.
func (c *Config) weight(t string) float64 {
	if w, ok := c.Weights[t]; ok {
		return w
	}
	return 1
}

// ReplicaSaturated reports whether replica r, whose predicted wait for a
// first token is wait (Estimator.Wait), is at one of the thresholds: GIE's
// roofline score max(waiting/MaxWaiting, kv/MaxKVUsage,
// queued/MaxQueuedPrefill, wait/MaxPredictedWait) ≥ 1.
func (c *Config) ReplicaSaturated(r *policy.Replica, wait time.Duration) bool {
	if c.MaxWaiting > 0 && r.Queue() >= c.MaxWaiting {
		return true
	}
	if c.MaxKVUsage > 0 && r.Slots == 0 && r.KVUsage >= c.MaxKVUsage {
		return true
	}
	if c.MaxInFlight > 0 && r.InFlight >= c.MaxInFlight {
		return true
	}
	if c.MaxPredictedWait > 0 && wait >= c.MaxPredictedWait {
		return true
	}
	return c.MaxQueuedPrefill > 0 && r.PendingPrefill >= c.MaxQueuedPrefill
}

// Pool is the saturation test of a pool and the figures it read.
type Pool struct {
	// Up counts the replicas that take requests (up, and not prefill-only:
	// every request is decoded where it is routed).
	Up int
	// Saturated says every one of them is at a threshold.
	Saturated bool
	// MinQueuedPrefill is the least queued prefill among them (E2's
	// queued prefill; 0 when none is up).
	MinQueuedPrefill time.Duration
	// MinWait is the least predicted wait for a first token among them
	// (Estimator.Wait; the queued prefill without an estimator): the
	// shortest time a request routed now waits before its own prefill.
	MinWait time.Duration
	// Best is the replica with that least wait (-1 when none is up).
	Best int
}

// takes reports whether r takes requests: up and not prefill-only (every
// request is decoded where it is routed).
func takes(r *policy.Replica) bool { return r.Up && r.Role != policy.RolePrefill }

// waitOf is replica i's predicted wait for a first token under est (nil:
// its queued prefill).
func waitOf(est Estimator, i int, r *policy.Replica) time.Duration {
	if est == nil {
		return r.PendingPrefill
	}
	return est.Wait(i, r)
}

// Judge reads the pool's replicas (the router's live view) and judges it,
// each replica's wait predicted by est (nil: its queued prefill). It does
// not allocate.
func (c *Config) Judge(reps []policy.Replica, est Estimator) Pool {
	p := Pool{Saturated: true, Best: -1}
	for i := range reps {
		r := &reps[i]
		if !takes(r) {
			continue
		}
		wait := waitOf(est, i, r)
		if p.Up == 0 || r.PendingPrefill < p.MinQueuedPrefill {
			p.MinQueuedPrefill = r.PendingPrefill
		}
		if p.Up == 0 || wait < p.MinWait {
			p.MinWait, p.Best = wait, i
		}
		p.Up++
		if p.Saturated && !c.ReplicaSaturated(r, wait) {
			p.Saturated = false
		}
	}
	if p.Up == 0 {
		p.Saturated = false
	}
	return p
}

// Room appends to dst the IDs of the replicas of reps that take requests
// and are not saturated (est predicts their waits; nil: queued prefill):
// the replicas that pass GIE's saturation Filter, where a request the
// queue dispatches may go. Routing a dispatched request among them only,
// not among all, keeps the policy from sending it to a saturated replica
// while another has room (the room that let it out).
func (c *Config) Room(reps []policy.Replica, est Estimator, dst []int) []int {
	for i := range reps {
		r := &reps[i]
		if takes(r) && !c.ReplicaSaturated(r, waitOf(est, i, r)) {
			dst = append(dst, r.ID)
		}
	}
	return dst
}
