package router

import (
	"fmt"
	"math"
	"time"
)

// How a replica keeps its prefix cache, and how the router corrects its view
// of it from what the replica reports.
//
// Two kinds of engine cache are modelled:
//
//   - a block cache (vLLM, SGLang, prefixlb engine): fixed-size KV blocks
//     keyed by their prefix, evicted least recently used. The router learns
//     it from KV events or, without them, mirrors it from its own decisions
//     (an LRU of MirrorCapacityTokens);
//   - a slot cache (llama.cpp's llama-server): -np slots, each keeping the
//     tokens of the last prompt it served. A request goes to the idle slot
//     whose cached tokens it resembles most (longest common subsequence over
//     the slot's length, above --slot-prompt-similarity), else to the least
//     recently used idle slot, and reuses only the common prefix with that
//     slot; with every slot busy it waits. So the replica holds at most N
//     prefixes, and a prefix held by a busy slot helps no one
//     (llama.cpp examples/server/server.cpp, get_available_slot, at commit
//     c392e50).
//
// Every response that reports its cached prompt tokens (vLLM's and SGLang's
// usage.prompt_tokens_details.cached_tokens, llama.cpp's timings.prompt_n)
// is a measurement of the replica's cache, and Finished compares it with the
// router's prediction. For a replica whose cache the router mirrors (no KV
// events), a report of fewer cached tokens than predicted means the mirror
// held blocks the replica had evicted: the mirror's capacity estimate shrinks
// (multiplicatively) and the least recently used blocks beyond it go; a
// report of more than predicted lets it grow back (additively) towards the
// configured capacity. With KV events the events stay the source of truth and
// the report is only measured.

// CacheView is what the router believes about one replica's cache, and how
// well that belief has matched the replica's reports.
type CacheView struct {
	// Slots is the replica's number of cache slots (llama.cpp's -np); 0 for
	// a block cache.
	Slots int `json:"slots"`
	// Events says whether KV events report the cache (else it is mirrored).
	Events bool `json:"events"`
	// CachedTokens is what the router's view holds for the replica.
	CachedTokens int `json:"cached_tokens"`
	// CapacityTokens is the mirror's current capacity estimate, and
	// ConfiguredCapacityTokens what it started from (block caches).
	CapacityTokens           int `json:"capacity_tokens"`
	ConfiguredCapacityTokens int `json:"configured_capacity_tokens"`
	// ConfiguredCapacitySource says where ConfiguredCapacityTokens came
	// from (Router.KVCapacity: the engine's source, "config" or
	// "profile").
	ConfiguredCapacitySource string `json:"configured_capacity_source"`
	// Checked counts finished requests whose replica reported cached
	// tokens; Exact, Over and Under split them by whether the prediction
	// was within one block, above or below the report.
	Checked int `json:"checked"`
	Exact   int `json:"exact"`
	Over    int `json:"over"`
	Under   int `json:"under"`
	// ErrorTokens is a moving average (over about the last 32 reports) of
	// the prediction minus the report, in tokens: positive when the router
	// believes the replica caches more than it does.
	ErrorTokens float64 `json:"prediction_error_tokens"`
	// LastErrorTokens is the latest report's prediction minus report.
	LastErrorTokens int `json:"last_prediction_error_tokens"`
	// Corrections counts reports that changed the view (capacity shrunk or
	// grown, slot contents corrected).
	Corrections int `json:"corrections"`
	// UnitsPerToken is the router's count of a prompt over the engine's
	// (usage.prompt_tokens), learnt from the replica's reports: 1 when
	// requests are keyed by token ids or by the engine's own tokenizer;
	// for text keyed by chunks, four bytes to a unit against the engine's
	// tokenizer (about 1.8 for llm-d-inference-sim's word tokenizer on
	// bench's text, docs/peers.md). The
	// engine's KV capacity is converted by it into the units the mirror
	// and the policies count in (capacityUnits). 0 until learnt.
	UnitsPerToken float64 `json:"units_per_token,omitempty"`
}

// errorEWMA is the weight of the newest report in CacheView.ErrorTokens:
// about the last 32 reports count.
const errorEWMA = 1.0 / 32

// SetCacheSlots says that replica id's engine keeps its cache in slots, one
// prompt per slot (llama.cpp: /props total_slots, its -np), and how many;
// 0 makes it a block cache again. Changing it drops the router's view of the
// replica's cache (a slot cache is not a block LRU).
func (r *Router) SetCacheSlots(id, slots int) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if slots < 0 || slots > maxSlots {
		return fmt.Errorf("%w: %d cache slots for replica %d (want 0..%d)", ErrBadLoad, slots, id, maxSlots)
	}
	r.grow(id)
	if r.cache[id].slots.n() == slots {
		return nil
	}
	r.tree.ClearReplica(id) // and its speculation
	r.cache[id].slots = newSlotCache(slots)
	r.reps[id].Slots = slots
	// Requests in flight keep their accounting; they hold no slot in the
	// new view.
	for _, f := range r.inflight {
		if f.replica == id {
			f.slot = noSlot
		}
	}
	return nil
}

// CacheView returns the router's view of replica id's cache.
func (r *Router) CacheView(id int) (CacheView, error) {
	if id < 0 || id >= len(r.reps) {
		return CacheView{}, fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	r.grow(id)
	c := &r.cache[id]
	v := c.view
	v.Slots = c.slots.n()
	v.Events = r.events[id]
	v.CachedTokens = r.tree.CachedBlocks(id) * r.cfg.BlockTokens
	v.ConfiguredCapacityTokens, v.ConfiguredCapacitySource = r.KVCapacity(id)
	v.CapacityTokens = r.mirrorCapacity(id)
	v.UnitsPerToken = c.units
	return v, nil
}

// replicaCache is the router's per-replica cache state beyond the tree.
type replicaCache struct {
	// capacityTokens is the mirror's learned capacity (0: configured).
	capacityTokens int
	// kvCapacity is the replica's KV capacity as its engine reports it
	// (SetKVCapacity; 0: unknown), kvSource where it was read.
	kvCapacity int
	kvSource   string
	slots      *slotCache // nil: a block cache
	view       CacheView  // the counters of CacheView
	// units is the learnt router units per engine token (0: not learnt,
	// read as 1); applied is the ratio the capacities were last converted
	// with (learnUnits).
	units, applied float64
}

// grow makes r.cache hold replica id.
func (r *Router) grow(id int) {
	for len(r.cache) <= id {
		r.cache = append(r.cache, replicaCache{})
	}
}

// mirrorCapacity is replica id's mirror capacity estimate, in tokens.
func (r *Router) mirrorCapacity(id int) int {
	if c := r.cache[id].capacityTokens; c > 0 {
		return c
	}
	return r.configuredCapacity(id)
}

// configuredCapacity is the mirror capacity replica id starts from: its
// KV capacity (KVCapacity), in the router's units (capacityUnits).
func (r *Router) configuredCapacity(id int) int {
	n, _ := r.KVCapacity(id)
	return r.capacityUnits(id, n)
}

// capacityUnits converts tokens of replica id's engine into the router's
// units: unchanged until a report taught the ratio (CacheView.UnitsPerToken).
func (r *Router) capacityUnits(id, tokens int) int {
	if id < len(r.cache) {
		if u := r.cache[id].applied; u > 0 && u != 1 {
			return int(float64(tokens) * u)
		}
	}
	return tokens
}

// Learning CacheView.UnitsPerToken: each report's ratio weighs unitsEWMA,
// and the capacities are converted again when it has moved by more than
// unitsResync since they last were. Ratios outside unitsBounds are not
// a tokenizer's (a truncated or an empty prompt) and are ignored.
const (
	unitsEWMA   = 1.0 / 16
	unitsResync = 0.02
)

var unitsBounds = [2]float64{0.05, 20}

// learnUnits records one report of replica id: the router counted prompt
// units of a prompt the engine counted enginePrompt tokens.
func (r *Router) learnUnits(id, prompt, enginePrompt int) {
	if prompt <= 0 || enginePrompt <= 0 {
		return
	}
	ratio := float64(prompt) / float64(enginePrompt)
	if ratio < unitsBounds[0] || ratio > unitsBounds[1] {
		return
	}
	r.grow(id)
	c := &r.cache[id]
	if c.units == 0 {
		c.units = ratio
	} else {
		c.units += unitsEWMA * (ratio - c.units)
	}
	old := c.applied
	if old == 0 {
		old = 1
	}
	if math.Abs(c.units-old) <= unitsResync*old {
		return
	}
	c.applied = c.units
	r.syncKVCapacity(id)
	if c.capacityTokens > 0 {
		// The learnt capacity was counted in the old units.
		c.capacityTokens = min(int(float64(c.capacityTokens)*c.applied/old), r.configuredCapacity(id))
	}
}

// syncKVCapacity sets what the policies read as replica id's KV capacity
// (policy.Replica.KVCapacity) in the router's units: the engine's figure
// converted, or, once units are learnt, the fallback's converted (0 leaves
// View.KVCapacityOf on the profile's).
func (r *Router) syncKVCapacity(id int) {
	c := &r.cache[id]
	switch {
	case c.kvCapacity > 0:
		r.reps[id].KVCapacity = r.capacityUnits(id, c.kvCapacity)
	case c.applied > 0 && c.applied != 1:
		n, _ := r.KVCapacity(id)
		r.reps[id].KVCapacity = r.capacityUnits(id, n)
	default:
		r.reps[id].KVCapacity = 0
	}
}

// Sources of a replica's KV capacity that the router falls back on when
// no SetKVCapacity gave one (KVCapacity's source).
const (
	// CapacityConfig: Config.MirrorCapacityTokens.
	CapacityConfig = "config"
	// CapacityProfile: the replica's cost profile's KVCapacity.
	CapacityProfile = "profile"
)

// KVCapacity returns replica id's KV cache size in tokens, and where it
// came from: the figure SetKVCapacity gave (the engine's, in serve and
// epp; the simulator's configured replica), else
// Config.MirrorCapacityTokens when given (CapacityConfig), else the
// replica's profile's (CapacityProfile). An unknown id gives 0, "".
func (r *Router) KVCapacity(id int) (tokens int, source string) {
	if id < 0 || id >= len(r.reps) {
		return 0, ""
	}
	if id < len(r.cache) && r.cache[id].kvCapacity > 0 {
		return r.cache[id].kvCapacity, r.cache[id].kvSource
	}
	if !r.mirrorSet && id < len(r.profiles) && r.profiles[id] != nil {
		return r.profiles[id].KVCapacity(), CapacityProfile
	}
	return r.cfg.MirrorCapacityTokens, CapacityConfig
}

// maxKVCapacity bounds SetKVCapacity: 2^40 tokens is far beyond any GPU.
const maxKVCapacity = 1 << 40

// SetKVCapacity records replica id's KV cache size in tokens as its
// engine reports it (serve and epp: vLLM's vllm:cache_config_info,
// SGLang's server info, llama.cpp's /props; the simulator: its configured
// replica) and where it was read (source, shown as is); 0 forgets it, and
// KVCapacity falls back on the configured or the profile's. Policies read
// it as policy.Replica.KVCapacity (View.KVCapacityOf: E2's eviction term,
// llmd-approx's LRU); a mirrored block cache is bounded by it. A change
// restarts the mirror's learned capacity from the new figure, and a mirror
// that holds more than it now fits drops its least recently used blocks
// beyond it at the next decision routed there.
func (r *Router) SetKVCapacity(id, tokens int, source string) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	if tokens < 0 || tokens > maxKVCapacity {
		return fmt.Errorf("%w: kv capacity %d tokens for replica %d (want 0..%d)", ErrBadLoad, tokens, id, maxKVCapacity)
	}
	r.grow(id)
	c := &r.cache[id]
	if tokens == 0 {
		source = ""
	}
	if c.kvCapacity != tokens {
		c.capacityTokens = 0
	}
	c.kvCapacity, c.kvSource = tokens, source
	r.syncKVCapacity(id)
	return nil
}

// feedback compares a finished request's predicted cached tokens with the
// replica's report and corrects the view: see the comment at the top of this
// file.
func (r *Router) feedback(f *flight, reported int, now time.Time) {
	id := f.replica
	r.grow(id)
	c := &r.cache[id]
	bt := r.tolerance(f)
	d := f.matched - reported
	c.view.Checked++
	c.view.LastErrorTokens = d
	if c.view.Checked == 1 {
		c.view.ErrorTokens = float64(d)
	} else {
		c.view.ErrorTokens += errorEWMA * (float64(d) - c.view.ErrorTokens)
	}
	if math.IsNaN(c.view.ErrorTokens) {
		c.view.ErrorTokens = 0
	}
	switch {
	case d > bt:
		c.view.Over++
	case d < -bt:
		c.view.Under++
	default:
		c.view.Exact++
	}
	if r.events[id] || r.cfg.NoFeedback {
		return // events are the truth; the report is only measured
	}
	if c.slots != nil {
		if r.slotFeedback(id, c.slots, f, reported, now) {
			c.view.Corrections++
		}
		return
	}
	if r.blockFeedback(id, f, reported, now) {
		c.view.Corrections++
	}
}

// tolerance is how far the prediction of flight f's cached tokens may be
// from its replica's report and still count as exact, in the router's
// units: one block when the router counts the engine's tokens; with text
// keyed by chunks, one of the router's blocks plus one of the engine's
// (the engine caches whole blocks of its own tokens, the router matches
// whole chunks of bytes, and the two floors differ by up to a block of
// each).
func (r *Router) tolerance(f *flight) int {
	bt := r.cfg.BlockTokens
	if f.estimated && f.replica < len(r.cache) {
		if u := r.cache[f.replica].units; u > 0 {
			return bt + int(math.Ceil(float64(bt)*u))
		}
	}
	return bt
}

// Bounds of the learned mirror capacity: a shrink keeps this share of what
// the mirror held, and never goes below minCapacityPrompts of the prompt that
// reported the eviction (the replica held that prompt whole).
const (
	shrinkFactor       = 0.9
	minCapacityPrompts = 2
)

// blockFeedback corrects the LRU mirror of block-cache replica id from one
// report: see the comment at the top of this file. A report on a prefix that
// another request in flight on the replica was using is left out: those
// blocks may still have been being computed, which says nothing of capacity.
func (r *Router) blockFeedback(id int, f *flight, reported int, now time.Time) bool {
	bt := r.cfg.BlockTokens
	tol := r.tolerance(f)
	c := &r.cache[id]
	capTok := r.mirrorCapacity(id)
	switch d := f.matched - reported; {
	case d > tol && !f.contended:
		held := r.tree.CachedBlocks(id) * bt
		next := int(shrinkFactor * float64(min(capTok, held)))
		next = max(next, minCapacityPrompts*f.prompt, bt)
		if next >= capTok {
			return false
		}
		c.capacityTokens = next
		if over := r.tree.CachedBlocks(id) - next/bt; over > 0 {
			r.tree.EvictLRU(id, over, now)
		}
		return true
	case d < -tol:
		next := min(r.configuredCapacity(id), capTok-d)
		if next <= capTok {
			return false
		}
		c.capacityTokens = next
		return true
	}
	return false
}
