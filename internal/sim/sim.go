// Package sim is prefixlb's discrete-event simulator: a cluster of modelled
// GPU replicas (internal/replica) behind the routing core (internal/router),
// on a virtual clock. Every arrival goes through the same policy code as the
// live router; the replicas' cache events reach the router after a
// configurable lag, as vLLM's KV events do.
package sim

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// Config describes one simulated run.
type Config struct {
	// Replicas is the number of replicas.
	Replicas int
	// Replica configures every replica (its Profile is set from Profile or
	// Profiles; a zero ChunkBudget or MaxRunning becomes each replica's
	// profile's engine batching). With Replica.Slots > 0 the replicas model
	// llama.cpp's slot cache, and the router is told so
	// (router.SetCacheSlots), as `prefixlb serve` is told by a
	// llama-server's /props.
	Replica replica.Config
	// Profile prices the replicas' work and the router's estimates.
	Profile costmodel.Profile
	// Profiles, when set, gives each replica its own true profile (one per
	// replica): a heterogeneous cluster. Profile then only labels results
	// and prices the oracle.
	Profiles []costmodel.Profile
	// RouterProfiles, when set, is the profile the router's cost model
	// takes for each replica (one per replica); else each replica's true
	// one. With Calibrate it is the prior the router corrects.
	RouterProfiles []costmodel.Profile
	// Calibrate, when set, makes the router learn each replica's speed
	// from what it observes (router.Config.Calibrate): first tokens and
	// finishes, and for slot replicas the timings llama.cpp reports.
	Calibrate *calibrate.Config
	// Policy routes; use a fresh one per run (policies keep state).
	Policy policy.Policy
	// KVEvents feeds the router the replicas' cache events (after EventLag)
	// instead of letting it mirror caches from its own decisions.
	KVEvents bool
	// EventLag delays cache events on their way to the router.
	EventLag time.Duration
	// SpeculativeTTL is the router's speculative-entry lifetime with KV
	// events (router.Config.SpeculativeTTL: 0 default, negative off).
	SpeculativeTTL time.Duration
	// Seed seeds the router's random source.
	Seed uint64
	// Rate labels the results (requests/s of the arrival process).
	Rate float64
	// Progress, when set, is called now and then with requests finished.
	Progress func(done, total int)
	// HostCores, when > 0, puts every replica on one host of that many
	// CPU cores, as CPU engines (llama.cpp's llama-server with one thread
	// each) share a machine: an iteration that starts while k > HostCores
	// replicas compute takes k/HostCores times as long (processor sharing,
	// fixed at the iteration's start). 0: each replica has its own hardware.
	HostCores int
	// PrefillReplicas, when > 0, makes the first PrefillReplicas replicas
	// prefill replicas and the others decode replicas (prefill/decode
	// disaggregation): a policy that disaggregates (policy.Disaggregator)
	// prefills a request on one and decodes it on another, its KV moving
	// over KVLink; any other policy sees only the decode replicas. 0: every
	// replica does both.
	PrefillReplicas int
	// IgnoreCacheTiers drops the replicas' KV events of slower cache tiers
	// (Replica.CPUOffloadTokens' CPU events) on their way to the router, as
	// `serve --ignore-cache-tiers` does: the tier-blind router.
	IgnoreCacheTiers bool
	// KVLink is each replica's link for disaggregated requests' KV: its
	// bandwidth, shared by the transfers using it, and a latency per
	// transfer (links in link.go). The bytes of a transfer are the blocks
	// the decode replica lacks times the profile's KV bytes per token
	// (costmodel.KVBytesOf). Required with PrefillReplicas.
	KVLink policy.KVLink
	// Queue, when set, puts the router-side queue (internal/admission)
	// in front of the router, on the virtual clock: requests wait in the
	// router while the pool is saturated and are routed when capacity
	// frees (queue.go). nil: every request is routed on arrival.
	Queue *QueueConfig
}

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	switch {
	case c.Replicas < 1:
		return fmt.Errorf("sim: replicas must be ≥ 1, got %d", c.Replicas)
	case c.Profile == nil:
		return errors.New("sim: a cost profile is required")
	case c.Policy == nil:
		return errors.New("sim: a policy is required")
	case c.EventLag < 0:
		return fmt.Errorf("sim: event lag must be ≥ 0, got %v", c.EventLag)
	case c.HostCores < 0:
		return fmt.Errorf("sim: host cores must be ≥ 0, got %d", c.HostCores)
	case len(c.Profiles) != 0 && len(c.Profiles) != c.Replicas:
		return fmt.Errorf("sim: %d replica profiles for %d replicas", len(c.Profiles), c.Replicas)
	case len(c.RouterProfiles) != 0 && len(c.RouterProfiles) != c.Replicas:
		return fmt.Errorf("sim: %d router profiles for %d replicas", len(c.RouterProfiles), c.Replicas)
	}
	for i, p := range c.Profiles {
		if p == nil {
			return fmt.Errorf("sim: replica %d has no profile", i)
		}
	}
	for i, p := range c.RouterProfiles {
		if p == nil {
			return fmt.Errorf("sim: replica %d has no router profile", i)
		}
	}
	if c.Queue != nil {
		if err := c.Queue.Validate(); err != nil {
			return fmt.Errorf("sim: queue: %w", err)
		}
	}
	return c.validatePD()
}

// validatePD checks the disaggregation settings.
func (c *Config) validatePD() error {
	switch {
	case c.PrefillReplicas < 0 || c.PrefillReplicas >= max(c.Replicas, 1):
		return fmt.Errorf("sim: prefill replicas must be in [0, replicas), got %d of %d", c.PrefillReplicas, c.Replicas)
	case c.PrefillReplicas == 0:
		return nil
	case !(c.KVLink.BytesPerSecond > 0) || math.IsInf(c.KVLink.BytesPerSecond, 0):
		return fmt.Errorf("sim: prefill replicas need a KV link bandwidth > 0, got %v bytes/s", c.KVLink.BytesPerSecond)
	case c.KVLink.Latency < 0:
		return fmt.Errorf("sim: KV link latency must be ≥ 0, got %v", c.KVLink.Latency)
	case c.Replica.Slots > 0:
		return errors.New("sim: prefill replicas need a block cache (llama.cpp's slots receive no KV)")
	case c.Calibrate != nil:
		return errors.New("sim: calibration does not model disaggregated requests yet")
	}
	for i := 0; i < c.Replicas; i++ {
		if costmodel.KVBytesOf(c.profile(i)) <= 0 {
			return fmt.Errorf("sim: replica %d's profile %s gives no KV bytes per token (a roofline does): its transfers cannot be sized", i, c.profile(i).Name())
		}
	}
	return nil
}

// profile is replica i's true profile.
func (c *Config) profile(i int) costmodel.Profile {
	if len(c.Profiles) > 0 {
		return c.Profiles[i]
	}
	return c.Profile
}

// routerProfile is the profile the router starts from for replica i.
func (c *Config) routerProfile(i int) costmodel.Profile {
	if len(c.RouterProfiles) > 0 {
		return c.RouterProfiles[i]
	}
	return c.profile(i)
}

// Result is what a run produced.
type Result struct {
	// Records has one entry per request, in request order.
	Records []report.RequestRecord
	// Span is the virtual time from the first arrival to the last finish.
	Span time.Duration
	// Router holds the routing core's counters.
	Router router.Stats
	// Replicas holds each replica's final counters.
	Replicas []replica.Stats
	// Branches counts decisions by branch.
	Branches map[string]int
	// RouterCachedBlocks is, per replica, the number of blocks the router
	// believed it cached at the end (compare Replicas[i].CachedBlocks).
	RouterCachedBlocks []int
	// Events counts cache events delivered to the router, and Unknown those
	// whose parent it did not know.
	Events, UnknownParents int
	// Calibration holds, per replica, the router's calibrated fit and its
	// counters at the end (Config.Calibrate; empty otherwise).
	Calibration []ReplicaCalibration
	// PD describes the disaggregated requests (Config.PrefillReplicas > 0;
	// nil otherwise).
	PD *PDStats `json:",omitempty"`
	// Queue counts what the router-side queue did (Config.Queue; nil
	// otherwise).
	Queue *admission.Stats `json:",omitempty"`
	// Tiers has, per request in request order, where its TTFT went on a
	// replica with a CPU offload tier (Replica.CPUOffloadTokens > 0; nil
	// otherwise).
	Tiers []TierRecord `json:",omitempty"`
}

// TierRecord splits one request's TTFT on a replica with a CPU offload
// tier: the wait for admission, the CPU-tier copy (its own transfer and the
// copies queued before it on the replica's host-to-device link), then the
// prefill of the rest and the first token. Times are from the request's
// arrival at the router; all zero for a request that never ran.
type TierRecord struct {
	// GPUTokens and CPUTokens are the prompt tokens found in the GPU cache
	// and loaded from the CPU tier at its (first) admission.
	GPUTokens, CPUTokens int
	// Admitted is the wait from arrival to admission; LoadDone from
	// arrival to the copy's end (= Admitted when nothing was loaded).
	Admitted, LoadDone time.Duration
}

// PDStats counts what disaggregation did in a run.
type PDStats struct {
	// Disaggregated and Local count the requests prefilled on a prefill
	// replica and those prefilled where they decoded.
	Disaggregated, Local int
	// TransferBytes is the KV moved between replicas.
	TransferBytes float64
	// PrefillMs, TransferMs and DecodeWaitMs split the disaggregated
	// requests' TTFT: arrival to the prefill leg's end, the KV's way from
	// there to the decode replica (its admission there, the transfer and
	// the link's latency), and from the KV's arrival to the first token.
	PrefillMs, TransferMs, DecodeWaitMs report.Summary
}

// ReplicaCalibration is one replica's calibration at the end of a run, with
// the true profile's figures at the same reference points.
type ReplicaCalibration struct {
	Fit   calibrate.Fit
	Stats calibrate.Stats
	// TruePrefillSecondsPer1K and TrueDecodeStepSeconds are the replica's
	// true profile at Fit's reference points.
	TruePrefillSecondsPer1K, TrueDecodeStepSeconds float64
}

// epoch is virtual time zero.
var epoch = time.Unix(1_700_000_000, 0).UTC()

type evKind uint8

const (
	evArrival evKind = iota
	evStepDone
	evCache
	evLink     // the link's next transfer end (ev.N holds its generation)
	evKVArrive // a transfer's KV reaches its decode replica
	evQueue    // the router-side queue's next timeout or deadline
)

type event struct {
	at   time.Time
	seq  uint64
	kind evKind
	idx  int // request index (arrival) or replica (step, cache)
	ev   replica.Event
}

type eventHeap []*event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(*event)) }
func (h *eventHeap) Pop() any {
	old := *h
	n := len(old)
	x := old[n-1]
	old[n-1] = nil
	*h = old[:n-1]
	return x
}

type reqState struct {
	keys     []blocks.Key
	rreq     replica.Request
	replica  int
	arrival  time.Time
	first    time.Time
	finish   time.Time
	hit      int
	tierHit  int // prompt tokens loaded from the replica's CPU tier
	admitted bool
	// admittedAt is when its prefill began (the iteration that admitted
	// it): llama.cpp's timings measure prompt_ms from there.
	admittedAt time.Time
	loadEnd    time.Time // its CPU-tier copy's end (tierHit > 0)
	out        int
	err        string
	// lastTok and gaps follow the request's token stream when the router
	// calibrates: the gaps between its tokens, as a streaming client sees
	// them (their median is the decode step calibration learns).
	lastTok time.Time
	gaps    []time.Duration
	// A disaggregated request: prefilled on prefill (preq, its one-token
	// prefill leg), whose cache held prefillHit of its prompt; prefilled
	// when that leg ended, kvAt when its KV reached the decode replica.
	pd         bool
	prefill    int
	preq       replica.Request
	prefillHit int
	prefilled  time.Time
	kvAt       time.Time
}

type runner struct {
	cfg      Config
	rt       *router.Router
	reps     []*replica.Replica
	stepping []bool
	pending  [][]replica.Event
	h        eventHeap
	seq      uint64
	reqs     []workload.Request
	st       []reqState
	res      *Result
	done     int
	free     []*event
	freeGaps [][]time.Duration
	links    *links // nil unless disaggregated
	// LoRA adapters: each replica's adapter loads when the router last
	// heard its residency, and a buffer for it; the running and waiting
	// adapters the router last heard of each replica.
	loraLoads []int64
	loraBuf   []string
	loraRun   [][]string
	loraWait  [][]string
	done_     []*transfer
	// the disaggregated requests' TTFT split (PDStats)
	pdPrefill, pdTransfer, pdWait report.Samples
	// the router-side queue (queue.go): nil unless Config.Queue
	q *simQueue
	// next[i] is the request that awaits request i's end (the next turn
	// of its conversation, workload.Request.AwaitPrevious), or -1.
	next []int
	// now is the time of the event being handled.
	now time.Time
}

// CapacitySource is the source the simulator gives its replicas' KV
// capacity (router.SetKVCapacity): their configured size, the model's.
const CapacitySource = "sim"

// Run simulates reqs (sorted by Arrival) on the configured cluster.
func Run(ctx context.Context, cfg Config, reqs []workload.Request) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bt := cfg.Replica.BlockSize
	if bt == 0 {
		bt = blocks.DefaultBlockSize
	}
	rt, err := router.New(router.Config{BlockTokens: bt, Profile: cfg.routerProfile(0), Policy: cfg.Policy, Seed: cfg.Seed,
		SpeculativeTTL:       cfg.SpeculativeTTL,
		MirrorCapacityTokens: cfg.Replica.KVCapacity,
		Calibrate:            cfg.Calibrate,
		KVLink:               cfg.KVLink})
	if err != nil {
		return nil, err
	}
	rn := &runner{cfg: cfg, rt: rt, reqs: reqs, st: make([]reqState, len(reqs)),
		res: &Result{Branches: map[string]int{}}}
	if cfg.PrefillReplicas > 0 {
		rn.links = newLinks(cfg.Replicas, cfg.KVLink.BytesPerSecond, cfg.KVLink.Latency)
		rn.res.PD = &PDStats{}
	}
	for i := 0; i < cfg.Replicas; i++ {
		rc := cfg.Replica
		rc.Profile = cfg.profile(i)
		rc.BlockSize = bt
		role := policy.RoleBoth
		if cfg.PrefillReplicas > 0 {
			rc.Role, role = replica.RoleDecode, policy.RoleDecode
			if i < cfg.PrefillReplicas {
				rc.Role, role = replica.RolePrefill, policy.RolePrefill
			}
		}
		rp, err := replica.New(rc)
		if err != nil {
			return nil, fmt.Errorf("sim: replica %d: %w", i, err)
		}
		rn.reps = append(rn.reps, rp)
		id := rt.AddReplica(fmt.Sprintf("replica-%d", i), cfg.KVEvents)
		if err := rt.SetProfile(id, cfg.routerProfile(i)); err != nil {
			return nil, fmt.Errorf("sim: replica %d: %w", i, err)
		}
		// The replica's KV capacity as its engine would report it
		// (vllm:cache_config_info: num_gpu_blocks × block_size): the
		// configured replica's, which serve reads from the engine.
		if err := rt.SetKVCapacity(id, rp.Stats().TotalBlocks*bt, CapacitySource); err != nil {
			return nil, fmt.Errorf("sim: replica %d: %w", i, err)
		}
		if rc.Slots > 0 {
			if err := rt.SetCacheSlots(id, rc.Slots); err != nil {
				return nil, fmt.Errorf("sim: replica %d: %w", i, err)
			}
		}
		if err := rt.SetRole(id, role); err != nil {
			return nil, fmt.Errorf("sim: replica %d: %w", i, err)
		}
		if rc.MaxLoras > 0 {
			if err := rt.SetAdapters(id, nil, rc.MaxLoras); err != nil {
				return nil, fmt.Errorf("sim: replica %d: %w", i, err)
			}
			if err := rt.SetAdapterBytes(id, maxAdapterBytes(reqs)); err != nil {
				return nil, fmt.Errorf("sim: replica %d: %w", i, err)
			}
		}
	}
	rn.loraLoads = make([]int64, cfg.Replicas)
	rn.loraRun = make([][]string, cfg.Replicas)
	rn.loraWait = make([][]string, cfg.Replicas)
	for i := range rn.reps {
		// The router knows each engine's load from the start, as serve
		// does from its first scrape (idle: nothing waiting or running).
		rn.updateLoad(i)
	}
	if cfg.Queue != nil {
		if rn.q, err = rn.newSimQueue(cfg.Queue, len(reqs)); err != nil {
			return nil, err
		}
	}
	rn.stepping = make([]bool, cfg.Replicas)
	rn.pending = make([][]replica.Event, cfg.Replicas)
	rn.next = nextTurns(reqs)
	awaits := make([]bool, len(reqs))
	for _, j := range rn.next {
		if j >= 0 {
			awaits[j] = true
		}
	}
	for i := range reqs {
		if !awaits[i] {
			rn.push(epoch.Add(reqs[i].Arrival), evArrival, i, replica.Event{})
		}
	}
	for n := 0; rn.h.Len() > 0; n++ {
		if n&0xfff == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		e := heap.Pop(&rn.h).(*event)
		rn.handle(e)
		rn.free = append(rn.free, e)
	}
	rn.finish()
	return rn.res, nil
}

func (rn *runner) push(at time.Time, k evKind, idx int, ev replica.Event) {
	var e *event
	if n := len(rn.free); n > 0 {
		e = rn.free[n-1]
		rn.free = rn.free[:n-1]
	} else {
		e = &event{}
	}
	rn.seq++
	*e = event{at: at, seq: rn.seq, kind: k, idx: idx, ev: ev}
	heap.Push(&rn.h, e)
}

func (rn *runner) handle(e *event) {
	rn.now = e.at
	switch e.kind {
	case evArrival:
		rn.arrive(e.idx, e.at)
	case evStepDone:
		rn.stepDone(e.idx, e.at)
	case evCache:
		rn.deliverCache(e.idx, e.ev, e.at)
	case evLink:
		rn.linkDone(uint64(e.ev.N), e.at)
	case evKVArrive:
		rn.kvArrive(e.idx, e.at)
	case evQueue:
		rn.queueTimer(e.at)
	}
}

// nextTurns returns, for each request of reqs, the request that awaits
// its end (the next one in reqs with the same Session and AwaitPrevious
// set), or -1.
func nextTurns(reqs []workload.Request) []int {
	next := make([]int, len(reqs))
	last := map[string]int{}
	for i, r := range reqs {
		next[i] = -1
		if r.Session == "" {
			continue
		}
		if p, ok := last[r.Session]; ok && r.AwaitPrevious {
			next[p] = i
		}
		last[r.Session] = i
	}
	return next
}

// ended counts request i as done, successfully or not, and lets the next
// turn of its conversation arrive: at its own arrival, or now if that has
// passed, as a chat client sends it once the answer is in.
func (rn *runner) ended(i int) {
	rn.done++
	if j := rn.next[i]; j >= 0 {
		at := epoch.Add(rn.reqs[j].Arrival)
		if at.Before(rn.now) {
			at = rn.now
		}
		rn.push(at, evArrival, j, replica.Event{})
	}
}

func (rn *runner) arrive(i int, now time.Time) {
	w := &rn.reqs[i]
	s := &rn.st[i]
	bt := rn.rt.Tree().BlockTokens()
	// An adapter's request is keyed from its seed, as serve and epp key it
	// and as its replica's KV events are keyed (blocks.AdapterSeed).
	s.keys = blocks.SeededKeys(nil, blocks.AdapterSeed(w.Adapter), w.Tokens, bt)
	s.arrival = now
	s.replica = -1
	if rn.q != nil {
		rn.queueArrive(i, now)
		return
	}
	rn.route(i, now)
}

// route routes request i (arrived) at now and submits it.
func (rn *runner) route(i int, now time.Time) { rn.routeWithin(i, now, router.Constraint{}) }

// routeWithin is route with the decision held to c.
func (rn *runner) routeWithin(i int, now time.Time, c router.Constraint) {
	w := &rn.reqs[i]
	s := &rn.st[i]
	out := max(w.OutputTokens, 1)
	d, err := rn.rt.RouteWithin(policy.Request{ID: uint64(i), Keys: s.keys, PromptTokens: len(w.Tokens),
		OutputTokens: out, Session: w.Session, Adapter: w.Adapter}, now, c)
	if err != nil {
		s.err = err.Error()
		rn.ended(i)
		return
	}
	rn.res.Branches[d.Branch]++
	s.replica = d.Replica
	s.rreq = replica.Request{ID: uint64(i), Keys: s.keys, PromptTokens: len(w.Tokens), OutputTokens: out,
		Adapter: w.Adapter, AdapterBytes: w.AdapterBytes}
	if pd := rn.res.PD; pd != nil {
		if !d.Disaggregated {
			pd.Local++
		} else {
			pd.Disaggregated++
			s.pd, s.prefill = true, d.PrefillReplica
			s.rreq.RemoteKV = true
			s.preq = replica.Request{ID: uint64(i), Keys: s.keys, PromptTokens: len(w.Tokens), OutputTokens: 1,
				Adapter: w.Adapter, AdapterBytes: w.AdapterBytes}
			rn.submit(i, d.PrefillReplica, &s.preq, now)
			return
		}
	}
	rn.submit(i, d.Replica, &s.rreq, now)
}

// submit gives request i's leg req to replica r at now, failing the
// request if the replica refuses it.
func (rn *runner) submit(i, r int, req *replica.Request, now time.Time) {
	s := &rn.st[i]
	rp := rn.reps[r]
	if err := rp.Submit(req, now); err != nil {
		s.err = err.Error()
		rn.ended(i)
		_ = rn.rt.Finished(uint64(i), 0, -1, false, now)
		return
	}
	rn.updateLoad(r)
	if !rn.stepping[r] {
		rn.step(r, now)
	}
}

// prefillEvent handles an event of request i's prefill leg on its prefill
// replica: at its end the router learns it (PrefillDone) and the decode
// leg, which will pull the KV, goes to the decode replica.
func (rn *runner) prefillEvent(i int, ev replica.Event) {
	s := &rn.st[i]
	switch ev.Kind {
	case replica.Admitted:
		if s.prefilled.IsZero() {
			s.prefillHit = ev.HitTokens
		}
	case replica.Finished:
		s.prefilled = ev.At
		_ = rn.rt.PrefillDone(uint64(i), ev.At)
		rn.submit(i, s.replica, &s.rreq, ev.At)
	}
}

// pull starts moving request i's KV: n blocks its decode replica lacks.
func (rn *runner) pull(i, n int, now time.Time) {
	s := &rn.st[i]
	bytes := float64(n*rn.rt.Tree().BlockTokens()) * costmodel.KVBytesOf(rn.cfg.profile(s.replica))
	rn.res.PD.TransferBytes += bytes
	rn.links.start(i, s.prefill, s.replica, bytes, now)
	rn.scheduleLink()
}

// scheduleLink schedules the link's next transfer end; an earlier
// schedule is ignored when it fires (its generation is stale).
func (rn *runner) scheduleLink() {
	if at, gen, ok := rn.links.next(); ok {
		rn.push(at, evLink, 0, replica.Event{N: int(gen)})
	}
}

// linkDone ends the transfers done at now, if gen is still the link's
// current schedule: each one's KV arrives at its decode replica after the
// link's latency.
func (rn *runner) linkDone(gen uint64, now time.Time) {
	if gen != rn.links.gen {
		return
	}
	rn.done_ = rn.links.finish(now, rn.done_[:0])
	for _, t := range rn.done_ {
		rn.push(now.Add(rn.links.lat), evKVArrive, t.req, replica.Event{})
	}
	rn.scheduleLink()
}

// kvArrive hands request i's KV to its decode replica at now.
func (rn *runner) kvArrive(i int, now time.Time) {
	s := &rn.st[i]
	s.kvAt = now
	r := s.replica
	evs, err := rn.reps[r].KVArrived(uint64(i), now)
	if err != nil {
		panic(fmt.Sprintf("sim: request %d: %v", i, err)) // the replica reported a KVPull for it
	}
	for _, ev := range evs {
		rn.apply(r, ev)
	}
	rn.updateLoad(r)
	if !rn.stepping[r] {
		rn.step(r, now)
	}
}

// step starts replica r's next iteration at now and schedules its end.
func (rn *runner) step(r int, now time.Time) {
	end, evs, busy := rn.reps[r].Step(now, rn.pending[r][:0])
	if c := rn.cfg.HostCores; c > 0 && busy {
		k := 1 // replicas computing during this iteration, this one included
		for j, on := range rn.stepping {
			if on && j != r {
				k++
			}
		}
		if k > c {
			// Stretch the iteration; its events are dated at its start or
			// its end, and those at the end move with it.
			d := end.Sub(now)
			stretched := now.Add(time.Duration(float64(d) * float64(k) / float64(c)))
			for i := range evs {
				if evs[i].At.After(now) {
					evs[i].At = stretched
				}
			}
			end = stretched
		}
	}
	rn.pending[r] = evs
	// Events dated at the start of the iteration (admissions, evictions)
	// apply now; the rest at its end.
	for _, ev := range evs {
		if !ev.At.After(now) {
			rn.apply(r, ev)
		}
	}
	rn.stepping[r] = busy
	if busy {
		rn.push(end, evStepDone, r, replica.Event{})
	}
	rn.updateLoad(r)
}

func (rn *runner) stepDone(r int, now time.Time) {
	for _, ev := range rn.pending[r] {
		if ev.At.Equal(now) {
			rn.apply(r, ev)
		}
	}
	rn.step(r, now)
	if rn.q != nil {
		rn.queueDispatch(now)
	}
}

func (rn *runner) apply(r int, ev replica.Event) {
	switch ev.Kind {
	case replica.Admitted, replica.FirstToken, replica.Token, replica.Finished:
		if s := &rn.st[ev.RequestID]; s.pd && r == s.prefill {
			rn.prefillEvent(int(ev.RequestID), ev)
			return
		}
	case replica.KVPull:
		rn.pull(int(ev.RequestID), ev.N, ev.At)
		return
	}
	switch ev.Kind {
	case replica.Admitted:
		s := &rn.st[ev.RequestID]
		if !s.admitted {
			s.admitted = true
			s.hit, s.tierHit = ev.HitTokens, ev.TierTokens
			s.admittedAt, s.loadEnd = ev.At, ev.LoadEnd
		}
	case replica.FirstToken:
		s := &rn.st[ev.RequestID]
		s.first = ev.At
		s.lastTok = ev.At
		_ = rn.rt.FirstToken(ev.RequestID, ev.At)
	case replica.Token:
		if rn.cfg.Calibrate != nil {
			s := &rn.st[ev.RequestID]
			if !s.lastTok.IsZero() {
				if s.gaps == nil {
					if n := len(rn.freeGaps); n > 0 {
						s.gaps, rn.freeGaps = rn.freeGaps[n-1][:0], rn.freeGaps[:n-1]
					}
				}
				s.gaps = append(s.gaps, ev.At.Sub(s.lastTok))
			}
			s.lastTok = ev.At
		}
	case replica.Finished:
		s := &rn.st[ev.RequestID]
		s.finish = ev.At
		s.out = ev.N
		// Tokens loaded from a CPU tier count as cached, as vLLM's
		// cached_tokens counts a connector's tokens.
		fin := router.Finish{OutputTokens: ev.N, CachedTokens: s.hit + s.tierHit, OK: true}
		if rn.cfg.Replica.Slots > 0 && !s.first.IsZero() {
			// llama-server reports its own timings (server.cpp at
			// c392e50): prompt_ms from the slot starting the prompt to
			// the first token, predicted_ms from there to the last.
			fin.Timings = &calibrate.Timings{
				PromptN: len(rn.reqs[ev.RequestID].Tokens) - s.hit, PromptMs: ms(s.first.Sub(s.admittedAt)),
				PredictedN: ev.N, PredictedMs: ms(ev.At.Sub(s.first)),
			}
		}
		if len(s.gaps) > 0 {
			slices.Sort(s.gaps)
			fin.ITL, fin.ITLSamples = s.gaps[len(s.gaps)/2], len(s.gaps)
			rn.freeGaps = append(rn.freeGaps, s.gaps)
			s.gaps = nil
		}
		_ = rn.rt.Finish(ev.RequestID, fin, ev.At)
		rn.ended(int(ev.RequestID))
		if rn.cfg.Progress != nil && rn.done%500 == 0 {
			rn.cfg.Progress(rn.done, len(rn.reqs))
		}
	case replica.BlocksStored, replica.BlocksRemoved, replica.AllCleared:
		if rn.cfg.KVEvents && !(ev.Medium != "" && rn.cfg.IgnoreCacheTiers) {
			rn.push(ev.At.Add(rn.cfg.EventLag), evCache, r, ev)
		}
	}
}

func (rn *runner) deliverCache(r int, ev replica.Event, now time.Time) {
	rn.res.Events++
	if ev.Medium != "" {
		// A slower tier's blocks (CPU offloading): the router's tier set.
		if ev.Kind == replica.BlocksStored {
			_ = rn.rt.CacheStoredTier(r, ev.Medium, ev.Keys)
		} else {
			_ = rn.rt.CacheRemovedTier(r, ev.Medium, ev.Keys)
		}
		return
	}
	switch ev.Kind {
	case replica.BlocksStored:
		if err := rn.rt.CacheStored(r, ev.Parent, ev.HasParent, ev.Keys, now); err != nil {
			rn.res.UnknownParents++
		}
	case replica.BlocksRemoved:
		_ = rn.rt.CacheRemoved(r, ev.Keys)
	case replica.AllCleared:
		_ = rn.rt.CacheCleared(r)
	}
}

func (rn *runner) updateLoad(r int) {
	st := rn.reps[r].Stats()
	_ = rn.rt.ReplicaLoad(r, st.Waiting, st.Running, st.KVUsage)
	if st.AdapterLoads != rn.loraLoads[r] {
		// Its adapter residency changed (every change is a load): tell the
		// router, as serve reads vllm:lora_requests_info.
		rn.loraLoads[r] = st.AdapterLoads
		rn.loraBuf = rn.reps[r].Adapters(rn.loraBuf[:0])
		_ = rn.rt.SetAdapters(r, rn.loraBuf, rn.cfg.Replica.MaxLoras)
	}
	if rn.cfg.Replica.MaxLoras > 0 {
		// The adapters its running and waiting requests use, as vLLM's
		// vllm:lora_requests_info reports them, when they changed.
		rep := rn.reps[r]
		rn.loraBuf = rep.RunningAdapters(rn.loraBuf[:0])
		n := len(rn.loraBuf)
		rn.loraBuf = rep.WaitingAdapters(rn.loraBuf)
		run, wait := rn.loraBuf[:n], rn.loraBuf[n:]
		if !slices.Equal(run, rn.loraRun[r]) || !slices.Equal(wait, rn.loraWait[r]) {
			rn.loraRun[r] = append(rn.loraRun[r][:0], run...)
			rn.loraWait[r] = append(rn.loraWait[r][:0], wait...)
			_ = rn.rt.SetRunningAdapters(r, run, wait)
		}
	}
}

// AdapterLoadsPerMinute is the LoRA adapter loads of every replica
// (replica.Stats.AdapterLoads) per minute of the run's span.
func (r *Result) AdapterLoadsPerMinute() float64 {
	if r.Span <= 0 {
		return 0
	}
	var n int64
	for _, st := range r.Replicas {
		n += st.AdapterLoads
	}
	return float64(n) / r.Span.Minutes()
}

// maxAdapterBytes is the largest adapter of reqs (the size the router
// prices a load at).
func maxAdapterBytes(reqs []workload.Request) int64 {
	var n int64
	for i := range reqs {
		n = max(n, reqs[i].AdapterBytes)
	}
	return n
}

func (rn *runner) finish() {
	res := rn.res
	var first, last time.Time
	res.Records = make([]report.RequestRecord, len(rn.reqs))
	if rn.cfg.Replica.CPUOffloadTokens > 0 {
		res.Tiers = make([]TierRecord, len(rn.reqs))
	}
	for i := range rn.st {
		s := &rn.st[i]
		w := &rn.reqs[i]
		rec := report.RequestRecord{
			ID: i, Replica: replicaName(s.replica), ArrivalS: s.arrival.Sub(epoch).Seconds(),
			Session: w.Session, Group: w.Group, Priority: w.Priority, Tenant: w.Tenant,
			PromptTokens: len(w.Tokens), CachedTokens: s.hit + s.tierHit, OutputTokens: s.out, Error: s.err,
		}
		if rn.res.Tiers != nil && s.admitted {
			t := TierRecord{GPUTokens: s.hit, CPUTokens: s.tierHit, Admitted: s.admittedAt.Sub(s.arrival)}
			t.LoadDone = t.Admitted
			if s.tierHit > 0 {
				t.LoadDone = s.loadEnd.Sub(s.arrival)
			}
			rn.res.Tiers[i] = t
		}
		if s.pd {
			// The prefill computed what the prefill replica did not hold.
			rec.CachedTokens = s.prefillHit
			if s.err == "" && !s.first.IsZero() {
				rn.pdPrefill.Add(ms(s.prefilled.Sub(s.arrival)))
				rn.pdTransfer.Add(ms(s.kvAt.Sub(s.prefilled)))
				rn.pdWait.Add(ms(s.first.Sub(s.kvAt)))
			}
		}
		if s.err == "" && !s.finish.IsZero() {
			rec.TTFTMs = ms(s.first.Sub(s.arrival))
			rec.LatencyMs = ms(s.finish.Sub(s.arrival))
			if s.out > 1 {
				rec.TPOTMs = ms(s.finish.Sub(s.first)) / float64(s.out-1)
			}
			if last.Before(s.finish) {
				last = s.finish
			}
		} else if s.err == "" {
			rec.Error = "sim: request did not finish"
		}
		if i == 0 || s.arrival.Before(first) {
			first = s.arrival
		}
		res.Records[i] = rec
	}
	if !last.IsZero() {
		res.Span = last.Sub(first)
	}
	if pd := res.PD; pd != nil {
		pd.PrefillMs, pd.TransferMs, pd.DecodeWaitMs = rn.pdPrefill.Summary(), rn.pdTransfer.Summary(), rn.pdWait.Summary()
	}
	res.Router = rn.rt.Stats()
	if rn.q != nil {
		st := rn.q.q.Stats()
		res.Queue = &st
	}
	for i, rp := range rn.reps {
		res.Replicas = append(res.Replicas, rp.Stats())
		res.RouterCachedBlocks = append(res.RouterCachedBlocks, rn.rt.Tree().CachedBlocks(i))
		if fit, st, ok := rn.rt.Calibration(i); ok {
			p := rn.cfg.profile(i)
			res.Calibration = append(res.Calibration, ReplicaCalibration{Fit: fit, Stats: st,
				TruePrefillSecondsPer1K: p.Prefill(calibrate.RefPrefillTokens, calibrate.RefPrefillTokens).Seconds(),
				TrueDecodeStepSeconds:   p.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: calibrate.RefDecodeContext}).Seconds(),
			})
		}
	}
}

// Utilization is the share of the run's span the replicas spent computing,
// over all of them: Σ busy time / (replicas · span).
func (r *Result) Utilization() float64 {
	if r.Span <= 0 || len(r.Replicas) == 0 {
		return 0
	}
	var busy time.Duration
	for _, st := range r.Replicas {
		busy += st.BusyTime
	}
	return busy.Seconds() / (float64(len(r.Replicas)) * r.Span.Seconds())
}

func replicaName(r int) string {
	if r < 0 {
		return ""
	}
	return fmt.Sprintf("replica-%d", r)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
