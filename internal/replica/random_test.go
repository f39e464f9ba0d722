package replica

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// TestRandomized drives replicas with every local scheduler and chunking mode
// through random shared-prefix load on a small KV cache (evictions and
// preemptions), with random cancellations, and checks after every call that
// the cache events mirror the cache exactly, that the cache stays
// prefix-closed with consistent references and block accounting, and that
// every request's events form a valid life.
func TestRandomized(t *testing.T) {
	type mode struct {
		local       string
		budget, max int
	}
	var modes []mode
	for _, local := range []string{LocalFCFS, LocalLPM, LocalPriority} {
		modes = append(modes, mode{local, 512, 16}, mode{local, 24, 16}, mode{local, NoChunking, 16})
	}
	seeds := 6
	if testing.Short() {
		seeds = 2
	}
	for _, m := range modes {
		for seed := range seeds {
			t.Run(fmt.Sprintf("%s/budget=%d/seed=%d", m.local, m.budget, seed), func(t *testing.T) {
				r := newReplica(t, Config{Profile: linear{kv: 48 * 16}, Local: m.local,
					ChunkBudget: m.budget, MaxRunning: m.max, PriorityQuota: 1 + seed%3})
				randomRun(t, r, rand.New(rand.NewPCG(uint64(seed), 7)), 300)
			})
		}
	}
}

// TestRandomizedSlots is TestRandomized for the slot cache: 1 to 3 slots,
// chunked or not, contexts small enough that prompts are truncated and
// decodes shift, with and without similarity matching.
func TestRandomizedSlots(t *testing.T) {
	type mode struct {
		slots, budget int
		ctx           int // tokens per slot
		sim           float64
	}
	modes := []mode{
		{1, 512, 512, 0}, {2, 512, 256, 0}, {2, 24, 384, 0}, {3, NoChunking, 320, 0},
		{2, 64, 512, NoSlotSimilarity}, {3, 40, 256, 0.8},
	}
	seeds := 6
	if testing.Short() {
		seeds = 2
	}
	for _, m := range modes {
		for seed := range seeds {
			t.Run(fmt.Sprintf("slots=%d/budget=%d/ctx=%d/sim=%v/seed=%d", m.slots, m.budget, m.ctx, m.sim, seed), func(t *testing.T) {
				r := newReplica(t, Config{Profile: linear{kv: m.slots * m.ctx}, Slots: m.slots,
					ChunkBudget: m.budget, SlotSimilarity: m.sim})
				randomRun(t, r, rand.New(rand.NewPCG(uint64(seed), 11)), 300)
			})
		}
	}
}

// life is what the test knows of one request.
type life struct {
	req       *Request
	admitted  bool
	running   bool
	n         int // tokens seen
	finished  bool
	cancelled bool
}

func randomRun(t *testing.T, r *Replica, rng *rand.Rand, nReq int) {
	t.Helper()
	const B = 16
	randTokens := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = rng.Uint32N(50000)
		}
		return out
	}
	var bases [][]uint32
	for _, n := range []int{0, 40, 100, 200, 300} {
		bases = append(bases, randTokens(n))
	}
	var mids [][]uint32
	for range 3 {
		mids = append(mids, randTokens(32))
	}
	parent := map[blocks.Key]blocks.Key{} // a key's parent, for keys not first
	var arrivals []arrival
	at := time.Duration(0)
	for i := range nReq {
		tok := append([]uint32(nil), bases[rng.IntN(len(bases))]...)
		if rng.IntN(2) == 0 {
			tok = append(tok, mids[rng.IntN(len(mids))]...)
		}
		tok = append(tok, randTokens(rng.IntN(81))...)
		if len(tok) == 0 {
			tok = randTokens(1)
		}
		keys := blocks.Keys(nil, tok, B)
		for j := 1; j < len(keys); j++ {
			parent[keys[j]] = keys[j-1]
		}
		arrivals = append(arrivals, arrival{at, req(uint64(i+1), len(tok), 1+rng.IntN(50), keys...)})
		at += time.Duration(rng.IntN(3000)) * time.Microsecond
	}

	lives := map[uint64]*life{}
	for _, a := range arrivals {
		lives[a.req.ID] = &life{req: a.req}
	}
	mirror := map[blocks.Key]bool{}
	cpuMirror := map[blocks.Key]bool{}
	check := func(now time.Time, ev []Event) {
		t.Helper()
		applyCacheEvents(mirror, ev)
		checkMirror(t, r, mirror)
		checkInvariants(t, r, parent)
		if r.cpu != nil {
			applyTierEvents(cpuMirror, ev, costmodel.MediumCPU)
			checkTier(t, r, cpuMirror)
		}
		last := now
		for _, e := range ev {
			if e.At.Before(last) {
				t.Fatalf("event %s out of time order (after %v)", show(e), last.Sub(t0))
			}
			last = e.At
			checkLife(t, r, lives[e.RequestID], e, parent)
		}
	}

	now := t0
	next := 0
	var buf []Event
	for steps := 0; ; steps++ {
		if steps > 1_000_000 {
			t.Fatal("no end")
		}
		for next < len(arrivals) && !t0.Add(arrivals[next].at).After(now) {
			if err := r.Submit(arrivals[next].req, now); err != nil {
				t.Fatalf("Submit: %v", err)
			}
			next++
		}
		if rng.IntN(30) == 0 && next > 0 {
			id := arrivals[rng.IntN(next)].req.ID
			ev := r.Cancel(id, now)
			if l := lives[id]; l.finished || l.cancelled {
				if ev != nil {
					t.Fatalf("Cancel(%d) of a dead request = %v", id, ev)
				}
			} else if len(ev) != 1 || ev[0].Kind != Cancelled || ev[0].N != l.n {
				t.Fatalf("Cancel(%d) = %v, want one Cancelled with N=%d", id, ev, l.n)
			}
			check(now, ev)
		}
		var end time.Time
		var busy bool
		end, buf, busy = r.Step(now, buf[:0])
		check(now, buf)
		if busy {
			if end.Before(now) {
				t.Fatalf("end %v before now %v", end, now)
			}
			now = end
			continue
		}
		if next == len(arrivals) {
			break
		}
		now = t0.Add(arrivals[next].at)
	}
	for id, l := range lives {
		if !l.finished && !l.cancelled {
			t.Errorf("request %d neither finished nor cancelled: %+v", id, *l)
		}
	}
	st := r.Stats()
	if st.Running != 0 || st.Waiting != 0 || st.Preemptions == 0 && st.Finished == 0 {
		t.Errorf("at the end: %+v", st)
	}
	if r.slots == nil && st.KVUsage != 0 || r.slots != nil && (st.Preemptions != 0 || st.KVUsage > 1) {
		t.Errorf("at the end: %+v", st)
	}
}

func checkLife(t *testing.T, r *Replica, l *life, e Event, parent map[blocks.Key]blocks.Key) {
	t.Helper()
	B := r.cfg.BlockSize
	switch e.Kind {
	case BlocksStored, BlocksRemoved:
		if e.Medium != "" {
			if e.Medium != costmodel.MediumCPU || e.HasParent || len(e.Keys) == 0 {
				t.Fatalf("%s: a tier's event with medium %q, parent %v", show(e), e.Medium, e.HasParent)
			}
			return
		}
		for i, k := range e.Keys {
			if e.Kind == BlocksStored && i > 0 && parent[k] != e.Keys[i-1] {
				t.Fatalf("%s: not a chain", show(e))
			}
		}
		if e.Kind == BlocksStored {
			p, ok := parent[e.Keys[0]]
			if ok != e.HasParent || p != e.Parent {
				t.Fatalf("%s: parent %d %v, want %d %v", show(e), e.Parent, e.HasParent, p, ok)
			}
		}
		return
	case AllCleared:
		return
	}
	if l == nil {
		t.Fatalf("event for an unknown request: %s", show(e))
	}
	if l.finished || l.cancelled {
		t.Fatalf("event after the end: %s", show(e))
	}
	switch e.Kind {
	case Admitted:
		if l.running {
			t.Fatalf("%s: admitted twice", show(e))
		}
		target := l.req.PromptTokens + l.n
		aligned := e.HitTokens%B == 0
		if r.slots != nil {
			// A slot reuses its common prefix up to the prompt less one
			// token, from where truncation starts it.
			target -= truncation(l.req.PromptTokens, r.slotCtx)
			aligned = e.HitTokens%B == 0 || e.HitTokens == target-1
		}
		if e.TierTokens%B != 0 || e.TierTokens > 0 && r.cpu == nil {
			t.Fatalf("%s: %d tokens from the CPU tier", show(e), e.TierTokens)
		}
		if !aligned || e.HitTokens+e.TierTokens > target-1 || e.Resumed != (l.n > 0) {
			t.Fatalf("%s: bad hit or resumed flag (target %d, %d tokens)", show(e), target, l.n)
		}
		l.admitted, l.running = true, true
	case Preempted:
		if !l.running || e.N != l.n {
			t.Fatalf("%s: preempted while not running or with %d tokens", show(e), l.n)
		}
		l.running = false
	case FirstToken, Token:
		if !l.running || e.N != l.n+1 || (e.Kind == FirstToken) != (e.N == 1) {
			t.Fatalf("%s: after %d tokens", show(e), l.n)
		}
		l.n = e.N
	case Finished:
		if e.N != l.req.OutputTokens || l.n != e.N {
			t.Fatalf("%s: after %d tokens of %d", show(e), l.n, l.req.OutputTokens)
		}
		l.finished = true
	case Cancelled:
		l.cancelled = true
	default:
		t.Fatalf("unexpected %s", show(e))
	}
}

// checkInvariants checks the replica's internal accounting against a
// recomputation from its requests.
func checkInvariants(t *testing.T, r *Replica, parent map[blocks.Key]blocks.Key) {
	t.Helper()
	if r.slots != nil {
		checkSlotInvariants(t, r, parent)
		return
	}
	B := r.cfg.BlockSize
	c := &r.cache
	refs := map[blocks.Key]int32{}
	priv := 0
	for _, s := range r.running {
		if !s.running || s.done {
			t.Fatalf("request %d in the running list is not running", s.req.ID)
		}
		for _, k := range s.req.Keys[:s.pinned] {
			refs[k]++
		}
		priv += s.priv
		if got, want := s.pinned+s.priv, ceilDiv(max(s.computed, s.target), B); got != want {
			t.Fatalf("request %d holds %d blocks, want %d (computed %d, target %d)",
				s.req.ID, got, want, s.computed, s.target)
		}
	}
	waiting := append([]*seq(nil), r.waiting...)
	for _, g := range r.groups {
		waiting = append(waiting, g...)
	}
	for _, s := range waiting {
		if s.running || s.pinned != 0 || s.priv != 0 {
			t.Fatalf("waiting request %d holds blocks", s.req.ID)
		}
		// Its kept entries, checked as scanPrefix checks them, give the
		// lookups' answer (on a copy: the check must not change them).
		cp := *s
		cp.ents = slices.Clone(s.ents)
		if got, want := first(r.scanPrefix(&cp, len(s.keys))), c.prefix(s.keys); got != want {
			t.Fatalf("waiting request %d: scanPrefix %d, the cache holds %d of its blocks", s.req.ID, got, want)
		}
		for j, i := range cp.ents {
			if c.lookup(s.keys[j]) != i {
				t.Fatalf("waiting request %d: block %d scanned as entry %d, cached as %d", s.req.ID, j, i, c.lookup(s.keys[j]))
			}
		}
	}
	for _, s := range r.running {
		if len(s.ents) != s.pinned {
			t.Fatalf("running request %d: %d entries for %d pinned blocks", s.req.ID, len(s.ents), s.pinned)
		}
		for j, i := range s.ents {
			if c.lookup(s.keys[j]) != i {
				t.Fatalf("running request %d: block %d pinned as entry %d, cached as %d", s.req.ID, j, i, c.lookup(s.keys[j]))
			}
		}
	}
	for _, i := range c.slots {
		if c.ents[i].refs != freeRefs {
			t.Fatalf("free entry %d not marked free (refs %d)", i, c.ents[i].refs)
		}
	}
	if got := len(r.running) + len(waiting); got != len(r.byID) {
		t.Fatalf("%d requests queued or running, %d known", got, len(r.byID))
	}
	if priv != r.privAll {
		t.Fatalf("privAll = %d, requests hold %d", r.privAll, priv)
	}
	if r.freeBlocks() < 0 {
		t.Fatalf("%d free blocks", r.freeBlocks())
	}
	children := map[blocks.Key]int{}
	unref := 0
	for k, i := range c.idx {
		if c.ents[i].key != k {
			t.Fatalf("entry %d holds key %d, indexed as %d", i, c.ents[i].key, k)
		}
		if c.ents[i].refs != refs[k] {
			t.Fatalf("key %d has %d refs, requests hold %d", k, c.ents[i].refs, refs[k])
		}
		if c.ents[i].refs == 0 {
			unref++
		}
		if p, ok := parent[k]; ok {
			if c.lookup(p) == nilEntry {
				t.Fatalf("key %d cached without its parent %d", k, p)
			}
			children[p]++
		}
	}
	n := 0
	for i := c.head; i != nilEntry; i = c.ents[i].next {
		if c.ents[i].refs != 0 {
			t.Fatalf("referenced key %d in the LRU list", c.ents[i].key)
		}
		n++
	}
	if n != c.nLRU || n != unref {
		t.Fatalf("LRU list holds %d, counted %d, unreferenced %d", n, c.nLRU, unref)
	}
	if c.head != nilEntry && children[c.ents[c.head].key] != 0 {
		t.Fatalf("LRU head %d is not a leaf", c.ents[c.head].key)
	}
}

// first is the first of two results.
func first(a, _ int) int { return a }

// checkSlotInvariants checks a slot cache's accounting: every running request
// on its own slot, at most Slots running, the reported keys exactly the
// union of the slots' held chains (each a prefix of its slot's keys, and
// prefix-closed), each slot within its context.
func checkSlotInvariants(t *testing.T, r *Replica, parent map[blocks.Key]blocks.Key) {
	t.Helper()
	B := r.cfg.BlockSize
	if len(r.running) > len(r.slots) {
		t.Fatalf("%d requests running on %d slots", len(r.running), len(r.slots))
	}
	for _, s := range r.running {
		if !s.running || s.done || r.slots[s.slot].s != s {
			t.Fatalf("request %d in the running list is not on its slot %d", s.req.ID, s.slot)
		}
	}
	busy := 0
	refs := map[blocks.Key]int32{}
	for i := range r.slots {
		sl := &r.slots[i]
		if sl.s != nil {
			busy++
			if sl.s.computed >= r.slotCtx {
				t.Fatalf("slot %d holds %d tokens, its context is %d", i, sl.s.computed, r.slotCtx)
			}
		} else if sl.tokens >= r.slotCtx {
			t.Fatalf("idle slot %d holds %d tokens, its context is %d", i, sl.tokens, r.slotCtx)
		}
		if (sl.start > 0 || sl.shifted) && sl.held != 0 {
			t.Fatalf("slot %d reports %d keys with start %d, shifted %v", i, sl.held, sl.start, sl.shifted)
		}
		if sl.held > len(sl.keys) || sl.s != nil && sl.held*B > max(sl.s.computed, 0) {
			t.Fatalf("slot %d reports %d keys of %d", i, sl.held, len(sl.keys))
		}
		for _, k := range sl.keys[:sl.held] {
			refs[k]++
		}
	}
	if busy != len(r.running) {
		t.Fatalf("%d busy slots, %d running", busy, len(r.running))
	}
	for _, s := range r.waiting {
		if s.running {
			t.Fatalf("waiting request %d is running", s.req.ID)
		}
	}
	if got := len(r.running) + len(r.waiting); got != len(r.byID) {
		t.Fatalf("%d requests queued or running, %d known", got, len(r.byID))
	}
	if len(refs) != len(r.slotRefs) {
		t.Fatalf("slots hold %d keys, %d reported", len(refs), len(r.slotRefs))
	}
	for k, n := range refs {
		if r.slotRefs[k] != n {
			t.Fatalf("key %d held by %d slots, counted %d", k, n, r.slotRefs[k])
		}
		if p, ok := parent[k]; ok && refs[p] == 0 {
			t.Fatalf("key %d cached without its parent %d", k, p)
		}
	}
}
