// Package router is prefixlb's routing core: the global prefix tree, the
// replicas' state and a policy, fed by observations. The proxy (prefixlb
// serve) and the simulator (prefixlb sim) drive the same Router, so that a
// simulated result is a statement about the code that ships.
//
// The Router is pure: it reads no clock, uses no global randomness and does no
// I/O. It is not safe for concurrent use; its owner serialises calls (the proxy
// under a mutex, the simulator on its one goroutine).
package router

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// Errors the router returns; wrapped with detail.
var (
	ErrEmptyPrompt     = errors.New("router: empty prompt")
	ErrBadRequest      = errors.New("router: invalid request")
	ErrUnknownReplica  = errors.New("router: unknown replica")
	ErrUnknownRequest  = errors.New("router: unknown request")
	ErrBadLoad         = errors.New("router: invalid load figure")
	ErrDuplicateFlight = errors.New("router: request id already in flight")
	ErrReplicaBusy     = errors.New("router: replica has requests in flight")
)

// Config configures a Router.
type Config struct {
	// BlockTokens is the tokens per block key (the engines' block size).
	BlockTokens int
	// Profile prices prefill and decode on a replica that has no profile
	// of its own (SetProfile).
	Profile costmodel.Profile
	// Calibrate, when set, learns each replica's real prefill and decode
	// speed from the requests it serves, with its profile as the prior
	// (internal/calibrate), and every policy prices work with what it
	// learnt; nil prices with the profiles as configured.
	Calibrate *calibrate.Config
	// Policy decides; the router feeds it observations if it is an Observer.
	Policy policy.Policy
	// Seed seeds the decisions' random source.
	Seed uint64
	// TreeMaxBlocks bounds the global tree (0: prefixtree.DefaultMaxBlocks).
	TreeMaxBlocks int
	// MirrorCapacityTokens is the cache size the router assumes for replicas
	// that publish no KV events, whose cache it mirrors from its own
	// decisions (0: each replica's profile's KV capacity).
	MirrorCapacityTokens int
	// DefaultOutputTokens is the output length assumed for a request that
	// gives no max_tokens (256).
	DefaultOutputTokens int
	// SpeculativeTTL is how long a routed prompt's blocks count as cached
	// on a replica that reports KV events before an event confirms them
	// (0: DefaultSpeculativeTTL; negative: no speculative entries). It
	// covers the lag between routing and the engine's BlockStored. Only
	// policies that implement policy.Speculator and say so get them.
	SpeculativeTTL time.Duration
	// SlotSimilarity is the share of a slot's cached tokens a prompt must
	// share to be placed on it, for replicas with a slot cache (llama.cpp's
	// --slot-prompt-similarity; 0: DefaultSlotSimilarity).
	SlotSimilarity float64
	// NoFeedback turns off the correction of mirrored caches by the cached
	// tokens replicas report (cacheview.go); the reports are still measured.
	NoFeedback bool
	// KVLink is the network between prefill and decode replicas that
	// disaggregating policies price transfers on (policy.View.KVLink; zero:
	// unknown).
	KVLink policy.KVLink
}

// DefaultSpeculativeTTL is Config.SpeculativeTTL's default: comfortably
// more than a prefill plus the event stream's lag.
const DefaultSpeculativeTTL = 2 * time.Second

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	switch {
	case c.BlockTokens < 1:
		return fmt.Errorf("router: block_tokens must be ≥ 1, got %d", c.BlockTokens)
	case c.Profile == nil:
		return errors.New("router: a cost profile is required")
	case c.Policy == nil:
		return errors.New("router: a policy is required")
	case c.TreeMaxBlocks < 0:
		return fmt.Errorf("router: tree_max_blocks must be ≥ 0, got %d", c.TreeMaxBlocks)
	case c.MirrorCapacityTokens < 0:
		return fmt.Errorf("router: mirror_capacity_tokens must be ≥ 0, got %d", c.MirrorCapacityTokens)
	case c.DefaultOutputTokens < 0:
		return fmt.Errorf("router: default_output_tokens must be ≥ 0, got %d", c.DefaultOutputTokens)
	case math.IsNaN(c.SlotSimilarity) || c.SlotSimilarity < 0 || c.SlotSimilarity >= 1:
		return fmt.Errorf("router: slot_similarity must be in [0,1), got %v", c.SlotSimilarity)
	}
	if c.Calibrate != nil {
		if err := c.Calibrate.Validate(); err != nil {
			return fmt.Errorf("router: calibrate: %w", err)
		}
	}
	return nil
}

// flight is one routed request that has not finished.
type flight struct {
	keys           []blocks.Key
	replica        int
	prompt         int
	matched        int
	pendingTokens  int
	pendingPrefill time.Duration
	// tierTokens of pendingTokens were expected to load from a slower
	// cache tier when routed (tierHit); tierPrefill is their share of
	// pendingPrefill (Replica.PendingTierPrefill).
	tierTokens  int
	tierPrefill time.Duration
	out         int
	routedAt    time.Time
	prefilled   bool
	// contended: when routed, another request in flight on the replica
	// used the matched prefix, so a report of fewer cached tokens may be
	// concurrency (blocks still being computed), not eviction.
	contended bool
	// estimated: the request's tokens were estimated from bytes
	// (policy.Request.Estimated).
	estimated bool
	// slot is the slot the request holds on a slot-cache replica (noSlot
	// otherwise), and prevKeys/prevTokens what that slot held before.
	slot       int
	prevKeys   []blocks.Key
	prevTokens int
	// cal is the request's state in its replica's calibration tracker;
	// unary says its client asked for no stream.
	cal   calibrate.Flight
	unary bool
	// adapter is the request's LoRA adapter ("" for the base model),
	// counted in its replica's AdapterFlights.
	adapter string
	// pd: a disaggregated request (Decision.Disaggregated), prefilled on
	// prefill while in flight on replica, the decode replica; prefillDone
	// once its prefill leg finished (PrefillDone), transferred once its KV
	// reached the decode replica (its first token there). prefillPending
	// and prefillTokens are the prefill leg's load on the prefill replica.
	pd, prefillDone, transferred bool
	prefill                      int
	prefillPending               time.Duration
	prefillTokens                int
}

// Router is the routing core. See the package comment for its concurrency.
type Router struct {
	cfg  Config
	tree *prefixtree.Tree
	pol  policy.Policy
	obs  policy.Observer
	// speculative: routed prompts count as cached before events confirm them.
	speculative bool
	reps        []policy.Replica
	events      []bool // replica r's cache is known from its KV events
	inflight    map[uint64]*flight
	free        []*flight
	rng         *rand.Rand
	match       prefixtree.Match
	scratch     prefixtree.Match
	victims     prefixtree.Match // slotVictims' lookups, during a decision
	cache       []replicaCache   // per replica: slot model, feedback (cacheview.go)
	view        policy.View
	masked      []policy.Replica // the view's replicas under a Constraint (decide)
	stats       Stats
	spec        speculation
	ext         []ExternalLoad // other routers' load by replica (SetExternalLoad)
	// profiles holds each replica's configured profile; priced what the
	// policies price its work with (its calibrated model when calibrating,
	// else the profile); cal its calibration tracker (nil when off).
	profiles []costmodel.Profile
	priced   []costmodel.Profile
	cal      []*calibrate.Tracker
	// mirrorSet: Config.MirrorCapacityTokens was given (else each
	// replica's profile's KV capacity).
	mirrorSet bool
	// disagg: the policy picks prefill replicas (policy.Disaggregator);
	// prefillRoles counts the replicas of role prefill, which other
	// policies never see.
	disagg       bool
	prefillRoles int
	// tiers holds each replica's blocks in slower cache tiers (tiers.go),
	// tierNames the tiers' media by index.
	tiers     []tierSet
	tierNames []string
}

// Stats counts what the router has done, for metrics and reports.
type Stats struct {
	Routed, Finished, Failed int
	// PredictedTokens and ReportedTokens sum, over finished requests whose
	// engine reported cached tokens, the router's prediction and the report.
	PredictedTokens, ReportedTokens int64
	// PredictionsExact counts requests whose prediction matched the report
	// within one block; PredictionsChecked those with a report at all.
	PredictionsExact, PredictionsChecked int
}

// New returns a Router with no replicas.
func New(cfg Config) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	mirrorSet := cfg.MirrorCapacityTokens > 0
	if !mirrorSet {
		cfg.MirrorCapacityTokens = cfg.Profile.KVCapacity()
	}
	if cfg.DefaultOutputTokens == 0 {
		cfg.DefaultOutputTokens = 256
	}
	if cfg.SpeculativeTTL == 0 {
		cfg.SpeculativeTTL = DefaultSpeculativeTTL
	}
	if cfg.SlotSimilarity == 0 {
		cfg.SlotSimilarity = DefaultSlotSimilarity
	}
	t, err := prefixtree.New(prefixtree.Config{BlockTokens: cfg.BlockTokens, MaxBlocks: cfg.TreeMaxBlocks}, 0)
	if err != nil {
		return nil, err
	}
	r := &Router{
		cfg:       cfg,
		tree:      t,
		pol:       cfg.Policy,
		inflight:  make(map[uint64]*flight),
		spec:      newSpeculation(),
		rng:       rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x5eed)),
		mirrorSet: mirrorSet,
	}
	r.obs, _ = cfg.Policy.(policy.Observer)
	if d, ok := cfg.Policy.(policy.Disaggregator); ok {
		r.disagg = d.Disaggregates()
	}
	if sp, ok := cfg.Policy.(policy.Speculator); ok && cfg.SpeculativeTTL > 0 {
		r.speculative = sp.Speculative()
	}
	r.view = policy.View{Tree: t, Match: &r.match, Profile: cfg.Profile, Rand: r.rng, KVLink: cfg.KVLink}
	r.view.TierHit = r.tierHit
	r.view.TierSplit = r.tierSplit
	return r, nil
}

// Policy returns the router's policy.
func (r *Router) Policy() policy.Policy { return r.pol }

// Tree returns the global prefix tree (read it under the owner's lock).
func (r *Router) Tree() *prefixtree.Tree { return r.tree }

// Stats returns the router's counters.
func (r *Router) Stats() Stats { return r.stats }

// AddReplica adds a replica, up, and returns its ID. events says whether
// its cache will be reported by KV events (else the router mirrors it).
func (r *Router) AddReplica(name string, events bool) int {
	id := r.tree.AddReplica()
	r.reps = append(r.reps, policy.Replica{ID: id, Name: name, Up: true, Waiting: -1, Running: -1, KVUsage: -1})
	r.events = append(r.events, events)
	r.grow(id)
	r.profiles = append(r.profiles, nil)
	r.priced = append(r.priced, nil)
	r.cal = append(r.cal, nil)
	r.setProfile(id, r.cfg.Profile)
	return id
}

// calStart starts flight f's prefill in tracker t, its prefill priced at
// seq tokens of sequence.
func (r *Router) calStart(t *calibrate.Tracker, f *flight, seq int, now time.Time) {
	if f.unary {
		t.StartUnary(&f.cal, f.prompt, seq, f.pendingTokens, f.out, now)
		return
	}
	t.Start(&f.cal, f.prompt, seq, f.pendingTokens, f.out, now)
}

// SetProfile gives replica id its own cost profile (a heterogeneous
// cluster), the prior of its calibration when calibrating. It fails with
// ErrReplicaBusy while requests are in flight on the replica: set it before
// routing to it.
func (r *Router) SetProfile(id int, p costmodel.Profile) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if p == nil {
		return errors.New("router: SetProfile: nil profile")
	}
	if r.reps[id].InFlight-r.ExternalLoad(id).InFlight > 0 {
		return fmt.Errorf("%w: %d (set its profile before routing to it)", ErrReplicaBusy, id)
	}
	r.setProfile(id, p)
	return nil
}

// setProfile installs p as replica id's profile and restarts its
// calibration from it.
func (r *Router) setProfile(id int, p costmodel.Profile) {
	r.profiles[id], r.priced[id], r.cal[id] = p, p, nil
	if r.cfg.Calibrate == nil {
		return
	}
	// Replicas of one profile share its figures (Model.Sibling): the same
	// value, or an equal one loaded again (a backend naming the default
	// profile, or several naming one in YAML).
	for j, t := range r.cal {
		if t != nil && j != id && costmodel.Same(r.profiles[j], p) {
			m := t.Model().Sibling()
			r.priced[id], r.cal[id] = m, calibrate.NewTracker(m)
			return
		}
	}
	// Config.Validate checked the calibration config; p is not nil.
	if m, err := calibrate.NewModel(p, *r.cfg.Calibrate); err == nil {
		r.priced[id], r.cal[id] = m, calibrate.NewTracker(m)
	}
}

// Profile returns replica id's configured profile (nil for an unknown id).
func (r *Router) Profile(id int) costmodel.Profile {
	if id < 0 || id >= len(r.profiles) {
		return nil
	}
	return r.profiles[id]
}

// PricedProfile returns the profile the policies price replica id's work
// with: its calibrated model when calibrating, else its profile (nil for
// an unknown id).
func (r *Router) PricedProfile(id int) costmodel.Profile {
	if id < 0 || id >= len(r.priced) {
		return nil
	}
	return r.priced[id]
}

// Calibration returns replica id's calibrated fit and its tracker's
// counters; ok is false when the router does not calibrate, and fit is then
// its profile's own figures (calibrate.FitOf).
func (r *Router) Calibration(id int) (fit calibrate.Fit, st calibrate.Stats, ok bool) {
	if id < 0 || id >= len(r.profiles) {
		return calibrate.Fit{}, calibrate.Stats{}, false
	}
	if r.cal[id] == nil {
		return calibrate.FitOf(r.profiles[id]), calibrate.Stats{}, false
	}
	return r.cal[id].Model().Fit(), r.cal[id].Stats(), true
}

// Pricing is how the router prices a replica's work, as /debug/replicas
// (prefixlb serve and epp) and the dashboard show it.
type Pricing struct {
	// Profile names the replica's configured cost profile; Calibrated
	// says whether the router learns its speed, and Speed is what it
	// prices the replica's work with (the calibrated fit, or the profile's
	// figures), with the observations behind it (Learnt).
	Profile    string           `json:"profile"`
	Calibrated bool             `json:"calibrated"`
	Speed      calibrate.Fit    `json:"speed"`
	Learnt     *calibrate.Stats `json:"calibration,omitempty"`
}

// Pricing returns replica id's pricing. withStats false leaves Learnt nil:
// the tracker's counters hold the model against its kept timings, a
// prediction each, which a caller that shows only the speed need not pay
// for under the router's lock.
func (r *Router) Pricing(id int, withStats bool) Pricing {
	var p Pricing
	if pr := r.Profile(id); pr != nil {
		p.Profile = pr.Name()
	}
	if id < 0 || id >= len(r.cal) {
		return p
	}
	if r.cal[id] == nil {
		p.Speed = calibrate.FitOf(r.profiles[id])
		return p
	}
	p.Calibrated, p.Speed = true, r.cal[id].Model().Fit()
	if withStats {
		st := r.cal[id].Stats()
		p.Learnt = &st
	}
	return p
}

// Calibrating reports whether the router learns its replicas' speed.
func (r *Router) Calibrating() bool { return r.cfg.Calibrate != nil }

// Replicas returns a snapshot of the replicas.
func (r *Router) Replicas() []policy.Replica {
	out := make([]policy.Replica, len(r.reps))
	for i := range r.reps {
		out[i] = cloneReplica(r.reps[i])
	}
	return out
}

// Load returns the replicas as the router sees them now, by ID, without a
// copy: read it under the owner's lock and do not keep it past the next
// call that changes the router. It is what a router-side queue judges
// saturation from (internal/admission), on the path of every request.
func (r *Router) Load() []policy.Replica { return r.reps }

// Replica returns a snapshot of replica id.
func (r *Router) Replica(id int) (policy.Replica, error) {
	if id < 0 || id >= len(r.reps) {
		return policy.Replica{}, fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	return cloneReplica(r.reps[id]), nil
}

// SetUp marks replica id up or down. A replica going down leaves the
// policy's placements; its cached state is kept (it may come back).
func (r *Router) SetUp(id int, up bool, now time.Time) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	was := r.reps[id].Up
	r.reps[id].Up = up
	if was && !up && r.obs != nil {
		r.obs.ReplicaDown(id, now)
	}
	if was && !up && r.cal[id] != nil {
		r.cal[id].Down(now)
	}
	return nil
}

// SetName renames replica id (a slot another replica joins; the name
// shows in decisions).
func (r *Router) SetName(id int, name string) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	r.reps[id].Name = name
	return nil
}

// SetEvents says whether replica id's cache is reported by KV events. When
// it switches on, the router's mirror is dropped: events are the truth.
func (r *Router) SetEvents(id int, on bool) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if on && !r.events[id] {
		r.tree.ClearReplica(id)
	}
	if !on {
		r.forget(id) // the mirror keeps what was marked
	}
	r.events[id] = on
	return nil
}

// SetRole gives replica id a role in a disaggregated cluster. A prefill
// replica is only ever the prefill leg of a disaggregated decision: policies
// that do not disaggregate (policy.Disaggregator) never see it, and a
// decision that sends a whole request to it is refused. Set roles before
// routing.
func (r *Router) SetRole(id int, role policy.Role) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if role > policy.RoleDecode {
		return fmt.Errorf("router: SetRole: unknown role %v", role)
	}
	if r.reps[id].Role == policy.RolePrefill {
		r.prefillRoles--
	}
	if role == policy.RolePrefill {
		r.prefillRoles++
	}
	r.reps[id].Role = role
	return nil
}

// ReplicaLoad records an engine's own load figures (scraped metrics, or the
// replica model's state in the simulator). Negative counts mean unknown; a
// NaN, infinite or out-of-range KV usage is rejected.
func (r *Router) ReplicaLoad(id, waiting, running int, kvUsage float64) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if math.IsNaN(kvUsage) || math.IsInf(kvUsage, 0) || kvUsage > 1.0001 {
		return fmt.Errorf("%w: kv usage %v for replica %d", ErrBadLoad, kvUsage, id)
	}
	rp := &r.reps[id]
	rp.Waiting, rp.Running = max(waiting, -1), max(running, -1)
	if kvUsage < 0 {
		kvUsage = -1
	}
	rp.KVUsage = kvUsage
	return nil
}

// SetAdapters records the LoRA adapters replica id holds in its GPU slots
// (policy.Replica.Adapters; copied) and its number of slots, vLLM's
// max_loras (policy.Replica.MaxAdapters; 0: unknown, adapters not priced).
// Callers pass Request.Adapter through Route; policies read both.
func (r *Router) SetAdapters(id int, loaded []string, max int) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if max < 0 {
		return fmt.Errorf("%w: max adapters %d for replica %d", ErrBadLoad, max, id)
	}
	rp := &r.reps[id]
	rp.Adapters = append([]string(nil), loaded...) // snapshots (Replicas) keep the old one
	rp.MaxAdapters = max
	return nil
}

// SetAdapterBytes records the size of an adapter replica id would load
// (policy.Replica.AdapterBytes), which prices its load time.
func (r *Router) SetAdapterBytes(id int, n int64) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if n < 0 {
		return fmt.Errorf("%w: adapter bytes %d for replica %d", ErrBadLoad, n, id)
	}
	r.reps[id].AdapterBytes = n
	return nil
}

// Constraint holds one decision to some replicas without marking the
// others down in the router (which would tell the policy they left the
// pool and drop their placements): serve excludes replicas a request
// already failed on, epp holds a decision to the gateway's subset hint.
// The policy sees the replicas it may not choose as down, for this
// decision only. The zero Constraint constrains nothing.
type Constraint struct {
	// Exclude lists replicas this decision must not choose.
	Exclude []int
	// Only, when non-nil, lists the only replicas this decision may choose.
	Only []int
}

// Route decides where req goes and commits the decision: the request is
// in flight on the chosen replica until Finished. The router keeps req.Keys
// until then (to release the path's references): do not modify them.
func (r *Router) Route(req policy.Request, now time.Time) (policy.Decision, error) {
	return r.RouteWithin(req, now, Constraint{})
}

// Assign commits req to replica id without asking the policy (Branch
// "served"): epp records the endpoint that actually served a request when
// the gateway picked another than the picker's choice. id must be up.
func (r *Router) Assign(req policy.Request, id int, now time.Time) (policy.Decision, error) {
	return r.route(req, now, Constraint{}, id)
}

// RouteWithin is Route with the decision held to c.
func (r *Router) RouteWithin(req policy.Request, now time.Time, c Constraint) (policy.Decision, error) {
	return r.route(req, now, c, -1)
}

// route is Route, RouteWithin and Assign: force ≥ 0 is Assign's replica.
func (r *Router) route(req policy.Request, now time.Time, c Constraint, force int) (policy.Decision, error) {
	if req.PromptTokens <= 0 && len(req.Keys) == 0 {
		return policy.Decision{}, ErrEmptyPrompt
	}
	if req.PromptTokens < len(req.Keys)*r.cfg.BlockTokens {
		return policy.Decision{}, fmt.Errorf("%w: %d prompt tokens but %d blocks of %d", ErrBadRequest, req.PromptTokens, len(req.Keys), r.cfg.BlockTokens)
	}
	if req.OutputTokens < 0 {
		return policy.Decision{}, fmt.Errorf("%w: negative output tokens %d", ErrBadRequest, req.OutputTokens)
	}
	if _, dup := r.inflight[req.ID]; dup {
		return policy.Decision{}, fmt.Errorf("%w: %d", ErrDuplicateFlight, req.ID)
	}
	if req.OutputTokens == 0 {
		req.OutputTokens = r.cfg.DefaultOutputTokens
	}
	r.expireSpeculative(now)
	r.tree.Insert(req.Keys, now, &r.match)
	r.prepareView(req.Keys, req.PromptTokens)
	var d policy.Decision
	if force >= 0 {
		d = policy.Decision{Replica: force, Branch: "served", MatchedTokens: r.view.MatchedTokens(force, &req)}
	} else {
		var err error
		if d, err = r.decide(&req, now, c); err != nil {
			return d, err
		}
	}
	if d.Replica < 0 || d.Replica >= len(r.reps) || !r.reps[d.Replica].Up {
		return d, fmt.Errorf("router: policy %s chose replica %d, which is not up", r.pol.Name(), d.Replica)
	}
	if err := r.checkRoles(&d); err != nil {
		return d, err
	}
	r.commit(&req, &d, now)
	return d, nil
}

// checkRoles refuses a decision that breaks the replicas' roles: a whole
// request or a decode leg on a prefill replica, a prefill leg elsewhere than
// on another up prefill replica.
func (r *Router) checkRoles(d *policy.Decision) error {
	if !d.Disaggregated {
		if r.reps[d.Replica].Role == policy.RolePrefill && r.prefillRoles > 0 {
			return fmt.Errorf("router: policy %s sent a whole request to prefill replica %d", r.pol.Name(), d.Replica)
		}
		return nil
	}
	p := d.PrefillReplica
	switch {
	case !r.disagg:
		return fmt.Errorf("router: policy %s disaggregated a request but is no Disaggregator", r.pol.Name())
	case r.reps[d.Replica].Role == policy.RolePrefill:
		return fmt.Errorf("router: policy %s chose prefill replica %d to decode", r.pol.Name(), d.Replica)
	case p < 0 || p >= len(r.reps) || !r.reps[p].Up || p == d.Replica || r.reps[p].Role != policy.RolePrefill:
		return fmt.Errorf("router: policy %s chose replica %d to prefill, which is not an up prefill replica", r.pol.Name(), p)
	}
	return nil
}

// decide asks the policy, showing it the replicas c rules out as down. The
// view the decision is then committed and observed with is the whole one.
func (r *Router) decide(req *policy.Request, now time.Time, c Constraint) (policy.Decision, error) {
	hide := r.prefillRoles > 0 && !r.disagg
	if c.Only == nil && len(c.Exclude) == 0 && !hide {
		return r.pol.Route(req, &r.view, now)
	}
	r.masked = append(r.masked[:0], r.reps...)
	if hide {
		for i := range r.masked {
			if r.masked[i].Role == policy.RolePrefill {
				r.masked[i].Up = false
			}
		}
	}
	if c.Only != nil {
		for i := range r.masked {
			r.masked[i].Up = false
		}
		for _, id := range c.Only {
			if id >= 0 && id < len(r.masked) {
				r.masked[id].Up = r.reps[id].Up && !(hide && r.reps[id].Role == policy.RolePrefill)
			}
		}
	}
	for _, id := range c.Exclude {
		if id >= 0 && id < len(r.masked) {
			r.masked[id].Up = false
		}
	}
	r.view.Replicas = r.masked
	d, err := r.pol.Route(req, &r.view, now)
	r.view.Replicas = r.reps
	return d, err
}

// prepareView readies the view for a decision on keys (already looked up
// into r.match): the replicas' snapshot, and for slot-cache replicas what
// the slot the request would land on holds.
func (r *Router) prepareView(keys []blocks.Key, prompt int) {
	r.view.Replicas = r.reps
	r.view.Profiles = r.priced
	r.view.Victims = nil
	if r.hasSlots() {
		r.slotMatches(keys, prompt)
		r.view.Victims = func(id int, fn func(n *prefixtree.Node) bool) { r.slotVictims(id, keys, fn) }
	}
}

// hasSlots reports whether some replica has a modelled slot cache.
func (r *Router) hasSlots() bool {
	for id := range r.cache {
		if r.slotted(id) != nil {
			return true
		}
	}
	return false
}

func (r *Router) commit(req *policy.Request, d *policy.Decision, now time.Time) {
	id := d.Replica
	f := r.newFlight()
	matched := r.view.MatchedTokens(id, req)
	missed := req.PromptTokens - matched
	*f = flight{
		keys: req.Keys, replica: id, prompt: req.PromptTokens, matched: matched, estimated: req.Estimated,
		pendingTokens: missed, pendingPrefill: r.priced[id].Prefill(missed, r.view.SeqFor(id, req)),
		out: req.OutputTokens, routedAt: now, slot: noSlot,
	}
	if !d.Disaggregated {
		r.flightTiers(f, id, req)
	}
	if mb := r.match.PerReplica[id]; mb > 0 && !r.events[id] {
		// The node holding the last matched block: another request on
		// this replica through it makes the match contended.
		for _, n := range r.match.Path {
			if n.Depth() < mb && mb <= n.Depth()+n.Own() {
				f.contended = n.Ref(id) > 0
				break
			}
		}
	}
	if d.Disaggregated {
		// The decode replica computes only the last prompt token; the
		// prefill replica carries the prefill of what it does not cache.
		pr := d.PrefillReplica
		pm := r.view.MatchedTokens(pr, req)
		f.pendingTokens, f.pendingPrefill = 0, 0
		f.pd, f.prefill = true, pr
		f.prefillTokens = req.PromptTokens - pm
		f.prefillPending = r.priced[pr].Prefill(f.prefillTokens, r.view.SeqFor(pr, req))
		pp := &r.reps[pr]
		pp.InFlight++
		pp.Prefilling++
		pp.PendingPrefill += f.prefillPending
		pp.PendingPrefillTokens += f.prefillTokens
		pp.Transfers++
		r.reps[id].Transfers++
		r.tree.AddRef(r.match.Path, pr, 1)
		r.cacheRouted(pr, req, now)
	}
	r.inflight[req.ID] = f
	rp := &r.reps[id]
	rp.InFlight++
	rp.Prefilling++
	rp.PendingPrefill += f.pendingPrefill
	rp.PendingPrefillTokens += f.pendingTokens
	rp.PendingTierPrefill += f.tierPrefill
	rp.PendingTierTokens += f.tierTokens
	rp.DecodeTokens += f.out
	f.adapter = req.Adapter
	r.addAdapterFlight(id, f.adapter, 1, f.out)
	path := r.match.Path
	r.tree.AddRef(path, id, 1)
	f.unary = req.Unary
	if t := r.cal[id]; t != nil && r.slotted(id) == nil && !f.pd {
		// A block cache's engine queue is opaque: the request's prefill
		// (as calibration counts it) starts now. A slot cache's starts
		// when it takes a slot (occupy).
		r.calStart(t, f, f.prompt, now)
	}
	if c := r.slotted(id); c != nil {
		// A slot cache: the request takes the slot llama.cpp would give it,
		// or waits for one (requests_deferred).
		if s, _, wait := c.choose(req.Keys, r.cfg.BlockTokens, r.cfg.SlotSimilarity); !wait {
			r.occupy(id, c, s, f, path, now)
		} else {
			c.deferred = append(c.deferred, req.ID)
		}
	} else {
		r.cacheRouted(id, req, now)
	}
	r.stats.Routed++
	if r.obs != nil {
		r.obs.Routed(req, d, &r.view, now)
	}
}

// cacheRouted records that block-cache replica id will cache req's prompt
// (the request's path, r.match.Path): in its mirror, evicting its least
// recently used unreferenced blocks beyond its capacity, or with KV events
// as a speculative entry when the policy wants them.
func (r *Router) cacheRouted(id int, req *policy.Request, now time.Time) {
	path := r.match.Path
	if !r.events[id] {
		r.tree.SetPathCached(path, id, now)
		capBlocks := r.mirrorCapacity(id) / r.cfg.BlockTokens
		if over := r.tree.CachedBlocks(id) - capBlocks; over > 0 {
			r.tree.EvictLRU(id, over, now)
		}
		return
	}
	if r.speculative {
		r.speculate(id, req.Keys, path, now)
	}
	r.tree.Touch(path, id, now)
}

// PrefillDone records that the prefill leg of disaggregated request id
// finished on its prefill replica (the prefill response came back, its KV
// ready to be pulled): the prefill replica's share of the request leaves
// its load. It is a no-op for a request that is not disaggregated or whose
// prefill was already reported.
func (r *Router) PrefillDone(id uint64, now time.Time) error {
	f, ok := r.inflight[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	if f.pd && !f.prefillDone {
		r.endPrefill(f)
	}
	return nil
}

// endPrefill takes flight f's prefill leg off its prefill replica.
func (r *Router) endPrefill(f *flight) {
	f.prefillDone = true
	pp := &r.reps[f.prefill]
	pp.InFlight--
	pp.Prefilling--
	pp.PendingPrefill -= f.prefillPending
	pp.PendingPrefillTokens -= f.prefillTokens
	r.tree.Lookup(f.keys, &r.scratch)
	r.tree.AddRef(r.scratch.Path, f.prefill, -1)
}

// endTransfer takes flight f's KV transfer off both replicas' links.
func (r *Router) endTransfer(f *flight) {
	f.transferred = true
	r.reps[f.prefill].Transfers--
	r.reps[f.replica].Transfers--
}

func (r *Router) newFlight() *flight {
	if n := len(r.free); n > 0 {
		f := r.free[n-1]
		r.free = r.free[:n-1]
		return f
	}
	return &flight{}
}

// FirstToken records the first output token of request id.
func (r *Router) FirstToken(id uint64, now time.Time) error {
	f, ok := r.inflight[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	if f.prefilled {
		return nil
	}
	f.prefilled = true
	if f.pd {
		if !f.prefillDone {
			r.endPrefill(f)
		}
		if !f.transferred {
			r.endTransfer(f)
		}
	}
	if t := r.cal[f.replica]; t != nil {
		t.FirstToken(&f.cal, now)
	}
	rp := &r.reps[f.replica]
	rp.Prefilling--
	rp.PendingPrefill -= f.pendingPrefill
	rp.PendingPrefillTokens -= f.pendingTokens
	rp.PendingTierPrefill -= f.tierPrefill
	rp.PendingTierTokens -= f.tierTokens
	rp.Decoding++
	rp.DecodeContextTokens += f.prompt + f.out/2
	if r.obs != nil {
		r.obs.FirstToken(id, f.replica, now.Sub(f.routedAt), now)
	}
	return nil
}

// Finished records the end of request id: outputTokens generated, and the
// cached prompt tokens the engine reported (-1 if it reported none). ok is
// false for a failed request.
func (r *Router) Finished(id uint64, outputTokens, cachedTokens int, ok bool, now time.Time) error {
	return r.Finish(id, Finish{OutputTokens: outputTokens, CachedTokens: cachedTokens, OK: ok}, now)
}

// Finish is what the router learns when a request ends.
type Finish struct {
	// OutputTokens is the number of tokens generated.
	OutputTokens int
	// CachedTokens is the prompt tokens the engine reported it served from
	// its cache, -1 if it reported none.
	CachedTokens int
	// PromptTokens is the prompt tokens the engine counted
	// (usage.prompt_tokens), 0 if it reported none. The router's own count
	// of a request keyed by text chunks (policy.Request.Estimated) is an
	// estimate in its own units (one key is BlockTokens of them,
	// keying.ChunkKeyer); with the engine's count, CachedTokens is
	// converted into those units before it is compared with the router's
	// prediction (reportedUnits).
	PromptTokens int
	// OK is false for a failed request.
	OK bool
	// Timings is the engine's own measurement of the request (llama.cpp's
	// timings), nil when it sent none; calibration learns from it.
	Timings *calibrate.Timings
	// ITL is the median gap between the request's streamed tokens as the
	// caller saw them (0: not measured), over ITLSamples gaps; calibration
	// learns the replica's decode step from it.
	ITL        time.Duration
	ITLSamples int
}

// Finish records the end of request id (Finished with the engine's
// timings when it sent some).
func (r *Router) Finish(id uint64, fin Finish, now time.Time) error {
	outputTokens, cachedTokens, ok := fin.OutputTokens, fin.CachedTokens, fin.OK
	f, found := r.inflight[id]
	if !found {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	reportedTokens, enginePrompt := cachedTokens, 0
	if f.estimated {
		enginePrompt = fin.PromptTokens
		cachedTokens = reportedUnits(cachedTokens, f.prompt, enginePrompt)
		if ok {
			r.learnUnits(f.replica, f.prompt, enginePrompt)
		}
	}
	if t := r.cal[f.replica]; t != nil && !f.pd {
		t.Finished(&f.cal, calibrate.Report{OK: ok, OutputTokens: outputTokens, CachedTokens: cachedTokens,
			Timings: fin.Timings, ITL: fin.ITL, ITLSamples: fin.ITLSamples}, now)
	}
	if f.pd {
		if !f.prefillDone {
			r.endPrefill(f)
		}
		if !f.transferred {
			r.endTransfer(f)
		}
	}
	if !f.prefilled {
		rp := &r.reps[f.replica]
		rp.Prefilling--
		rp.PendingPrefill -= f.pendingPrefill
		rp.PendingPrefillTokens -= f.pendingTokens
		rp.PendingTierPrefill -= f.tierPrefill
		rp.PendingTierTokens -= f.tierTokens
	} else {
		rp := &r.reps[f.replica]
		rp.Decoding--
		rp.DecodeContextTokens -= f.prompt + f.out/2
	}
	rp := &r.reps[f.replica]
	rp.InFlight--
	rp.DecodeTokens -= f.out
	r.addAdapterFlight(f.replica, f.adapter, -1, f.out)
	// The path may have been split since routing: look it up again.
	r.tree.Lookup(f.keys, &r.scratch)
	r.tree.AddRef(r.scratch.Path, f.replica, -1)
	if ok {
		r.stats.Finished++
	} else {
		r.stats.Failed++
	}
	if ok && cachedTokens >= 0 {
		r.stats.PredictionsChecked++
		r.stats.PredictedTokens += int64(engineTokens(f.matched, f.prompt, enginePrompt))
		r.stats.ReportedTokens += int64(reportedTokens)
		if d, tol := f.matched-cachedTokens, r.tolerance(f); d <= tol && d >= -tol {
			r.stats.PredictionsExact++
		}
		r.feedback(f, cachedTokens, now)
	}
	if c := r.slotted(f.replica); c != nil {
		r.releaseSlot(f.replica, c, id, f, outputTokens, now)
	}
	if r.obs != nil {
		r.obs.Finished(id, f.replica, outputTokens, ok, now)
	}
	delete(r.inflight, id)
	*f = flight{}
	r.free = append(r.free, f)
	return nil
}

// reportedUnits converts cached, the prompt tokens an engine reported
// cached out of its count enginePrompt, into the router's units for a
// request it counted as prompt: unchanged when either count is unknown.
// Only a request keyed by text chunks (flight.estimated) is converted:
// one keyed by token ids or a matching tokenizer is counted exactly. Text
// keyed by chunks counts four
// bytes to a token (keying.ChunkKeyer), which a tokenizer of longer
// tokens (llm-d-inference-sim's word tokenizer: about six bytes) makes an
// overestimate by the same factor as its cached share, so the cached share
// of the engine's count is what compares with the router's prediction.
// Comparing raw counts instead made every text prediction look like an
// eviction, and the mirror shrank each replica's cache to a third
// (docs/peers.md).
func reportedUnits(cached, prompt, enginePrompt int) int {
	if cached <= 0 || prompt <= 0 || enginePrompt <= 0 || prompt == enginePrompt {
		return cached
	}
	return int(int64(cached) * int64(prompt) / int64(enginePrompt))
}

// engineTokens is reportedUnits' inverse: the router's prediction of
// matched units in the engine's tokens.
func engineTokens(matched, prompt, enginePrompt int) int {
	if matched <= 0 || prompt <= 0 || enginePrompt <= 0 || prompt == enginePrompt {
		return matched
	}
	return int(int64(matched) * int64(enginePrompt) / int64(prompt))
}

// FlightLoad returns what in-flight request id adds to its replica's
// load, as the router counts it: what another router sharing the replica
// should add to its own view (SetExternalLoad). ok is false for an unknown
// request.
func (r *Router) FlightLoad(id uint64) (l ExternalLoad, ok bool) {
	f, ok := r.inflight[id]
	if !ok {
		return ExternalLoad{}, false
	}
	l = ExternalLoad{InFlight: 1, DecodeTokens: f.out}
	if !f.prefilled {
		l.Prefilling, l.PendingPrefill, l.PendingPrefillTokens = 1, f.pendingPrefill, f.pendingTokens
	}
	return l, true
}

// UpCount is the number of replicas up (SetUp).
func (r *Router) UpCount() int {
	v := policy.View{Replicas: r.reps}
	return v.Up()
}

// InFlight is the number of requests routed and not finished.
func (r *Router) InFlight() int { return len(r.inflight) }

// CacheStored applies an engine's report that replica id stored keys, a
// consecutive chain continuing parent (hasParent=false: from the prompt's
// start). It fails with prefixtree.ErrUnknownParent when the router does not
// know the parent (events were missed: the caller should replay).
func (r *Router) CacheStored(id int, parent blocks.Key, hasParent bool, keys []blocks.Key, now time.Time) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	r.expireSpeculative(now)
	if len(keys) == 0 {
		return nil
	}
	if err := r.tree.InsertBelow(parent, hasParent, keys, now, &r.scratch); err != nil {
		return err
	}
	// Mark the nodes that hold keys: the tail of the path, len(keys)
	// blocks (InsertBelow cut the path on the keys' ends), settling their
	// speculation.
	need, i := len(keys), len(r.scratch.Path)
	for i > 0 && need > 0 {
		i--
		need -= r.scratch.Path[i].Own()
	}
	tail := r.scratch.Path[i:]
	r.confirm(id, tail)
	for j := len(tail) - 1; j >= 0; j-- {
		r.tree.SetCached(tail[j], id, true)
	}
	return nil
}

// CacheRemoved applies an engine's report that replica id evicted keys.
// Unknown keys are ignored (the router may have dropped them already).
func (r *Router) CacheRemoved(id int, keys []blocks.Key) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	for _, k := range keys {
		r.uncache(id, k) // settles its speculation too
	}
	return nil
}

// uncache marks key k not cached on replica id.
func (r *Router) uncache(id int, k blocks.Key) {
	if n, _, ok := r.tree.Find(k); ok && n.Cached(id) {
		if n, ok := r.tree.Isolate(k); ok {
			r.tree.SetCached(n, id, false)
		}
	}
}

// CacheCleared applies an engine's report that replica id dropped its whole
// prefix cache (vLLM's AllBlocksCleared, or an engine restart).
func (r *Router) CacheCleared(id int) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	r.tree.ClearReplica(id) // and its speculation
	if id < len(r.cache) {
		r.cache[id].slots.clear()
	}
	r.clearTiers(id)
	return nil
}

// Predict returns, without committing anything, the decision the policy
// would make for req now (for POST /debug/route). The tree is only read.
// Stateful policies may still advance: E2 expires its windows to now, and
// round-robin's turn moves on as if the request had been routed.
func (r *Router) Predict(req policy.Request, now time.Time) (policy.Decision, error) {
	if req.PromptTokens <= 0 && len(req.Keys) == 0 {
		return policy.Decision{}, ErrEmptyPrompt
	}
	if req.OutputTokens == 0 {
		req.OutputTokens = r.cfg.DefaultOutputTokens
	}
	r.tree.Lookup(req.Keys, &r.match)
	r.prepareView(req.Keys, req.PromptTokens)
	return r.decide(&req, now, Constraint{})
}

// ExternalLoad is work other routers have in flight on one replica (shared
// through internal/sharedstate when several routers front the same pool).
// Its fields add to the Replica fields of the same names.
type ExternalLoad struct {
	// InFlight and Prefilling count requests (Prefilling: no token yet).
	InFlight, Prefilling int
	// PendingPrefill and PendingPrefillTokens are the prefill those
	// requests still owe; DecodeTokens the output tokens they still owe.
	PendingPrefill       time.Duration
	PendingPrefillTokens int
	DecodeTokens         int
}

// Add returns l + o, field by field.
func (l ExternalLoad) Add(o ExternalLoad) ExternalLoad {
	return ExternalLoad{
		InFlight:             l.InFlight + o.InFlight,
		Prefilling:           l.Prefilling + o.Prefilling,
		PendingPrefill:       l.PendingPrefill + o.PendingPrefill,
		PendingPrefillTokens: l.PendingPrefillTokens + o.PendingPrefillTokens,
		DecodeTokens:         l.DecodeTokens + o.DecodeTokens,
	}
}

// SetExternalLoad replaces what other routers are known to have in flight on
// replica id. From then on the policies see the replica's InFlight,
// Prefilling, PendingPrefill(Tokens) and DecodeTokens as this router's own
// plus l, so that several routers sharing their counts do not all pick the
// same replica at once. Negative fields are taken as 0.
func (r *Router) SetExternalLoad(id int, l ExternalLoad) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	l.InFlight, l.Prefilling = max(l.InFlight, 0), max(l.Prefilling, 0)
	l.PendingPrefill, l.PendingPrefillTokens = max(l.PendingPrefill, 0), max(l.PendingPrefillTokens, 0)
	l.DecodeTokens = max(l.DecodeTokens, 0)
	for len(r.ext) < len(r.reps) {
		r.ext = append(r.ext, ExternalLoad{})
	}
	old := r.ext[id]
	if t := r.cal[id]; t != nil {
		t.SetExternal(l.InFlight > 0)
	}
	rp := &r.reps[id]
	rp.InFlight += l.InFlight - old.InFlight
	rp.Prefilling += l.Prefilling - old.Prefilling
	rp.PendingPrefill += l.PendingPrefill - old.PendingPrefill
	rp.PendingPrefillTokens += l.PendingPrefillTokens - old.PendingPrefillTokens
	rp.DecodeTokens += l.DecodeTokens - old.DecodeTokens
	r.ext[id] = l
	return nil
}

// ExternalLoad returns what SetExternalLoad last set for replica id.
func (r *Router) ExternalLoad(id int) ExternalLoad {
	if id < 0 || id >= len(r.ext) {
		return ExternalLoad{}
	}
	return r.ext[id]
}
