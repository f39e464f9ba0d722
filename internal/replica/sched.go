package replica

import (
	"cmp"
	"slices"
	"time"
)

// lpmMaxQueue is the queue length above which SGLang stops sorting its
// waiting queue by prefix match ("Turn off the expensive prefix matching and
// sorting when the #queue is large", SchedulePolicy._determine_active_policy)
// and admits in the queue's current order.
const lpmMaxQueue = 128

// admitQueue admits from the head of the waiting queue until a request does
// not fit, the budget is spent or MaxRunning is reached. A request that does
// not fit blocks those behind it (vLLM v1 stops scheduling waiting requests
// when allocate_slots fails; SGLang's PrefillAdder stops on NO_TOKEN).
func (r *Replica) admitQueue(now time.Time, ev *[]Event, budget *int) {
	n := 0
	skipped := false
	for _, s := range r.waiting {
		if len(r.running) >= r.cfg.MaxRunning || *budget == 0 {
			break
		}
		if r.loraBlocked(s) || r.offloadBlocked(s) {
			// vLLM skips a request whose adapter would exceed max_loras
			// (lora.go), or whose blocks a load from the CPU tier is
			// reading (offload.go), and goes on with the queue.
			skipped = true
			continue
		}
		if !r.tryAdmit(s, now, ev, budget) {
			break
		}
		n++
	}
	if n == 0 {
		return
	}
	if !skipped {
		clear(r.waiting[:n])
		r.waiting = r.waiting[n:]
		return
	}
	kept := r.waiting[:0]
	for _, s := range r.waiting {
		if !s.running {
			kept = append(kept, s)
		}
	}
	clear(r.waiting[len(kept):])
	r.waiting = kept
}

// sortLPM orders the waiting queue longest cached prefix first, ties in
// arrival order (SGLang's "lpm" policy; the tie-break is Preble's,
// scheduler.py get_priority_queue). Above lpmMaxQueue waiting requests the
// order is left as it is, as SGLang does.
func (r *Replica) sortLPM() {
	if len(r.waiting) > lpmMaxQueue {
		return
	}
	for _, s := range r.waiting {
		s.match, _ = r.scanPrefix(s, len(s.keys))
	}
	slices.SortFunc(r.waiting, func(a, b *seq) int {
		if c := cmp.Compare(b.match, a.match); c != 0 {
			return c
		}
		return cmp.Compare(a.arrival, b.arrival)
	})
}

// admitPriority is Preble's local scheduler ("fcfs-mpq" in the prototype's
// python/sglang/srt/managers/router/model_rpc.py, budget_forward_step, with
// get_schedule_group and schedule_within_group):
//   - requests not yet in a group join group ceil(G·hit)−1 (0 when hit is 0),
//     hit being the fraction of the prompt cached now; they keep that group;
//   - groups take turns from G−1 down to 0 and around again: the turn goes to
//     the first non-empty group at or below the pointer, and the pointer moves
//     to the group below it;
//   - the group whose turn it is admits at most PriorityQuota·(g+1) requests,
//     in arrival order; a request that does not fit is skipped, not waited
//     for (unlike fcfs), as in the prototype.
//
// The prototype also falls back to unchunked scheduling while more than half
// the KV cache is free; that is not modelled. The group index is computed in
// integers, so a hit of exactly 3/10 is group
// 2 (the prototype's floating point can put it in 3).
func (r *Replica) admitPriority(now time.Time, ev *[]Event, budget *int) {
	G := len(r.groups)
	for _, s := range r.waiting {
		g := r.groupOf(s)
		s.group = g
		grp := r.groups[g]
		pos := len(grp)
		if pos > 0 && grp[pos-1].arrival > s.arrival { // a preempted request
			pos, _ = slices.BinarySearchFunc(grp, s.arrival, func(x *seq, a uint64) int {
				return cmp.Compare(x.arrival, a)
			})
		}
		r.groups[g] = slices.Insert(grp, pos, s)
	}
	clear(r.waiting)
	r.waiting = r.waiting[:0]

	g := -1
	for i := range G {
		if c := (r.turn - i + G) % G; len(r.groups[c]) > 0 {
			g = c
			break
		}
	}
	if g < 0 {
		return
	}
	r.turn = (g - 1 + G) % G

	quota := r.cfg.PriorityQuota * (g + 1)
	grp := r.groups[g]
	kept := grp[:0]
	for i, s := range grp {
		if quota == 0 || len(r.running) >= r.cfg.MaxRunning || *budget == 0 {
			kept = append(kept, grp[i:]...)
			break
		}
		if r.tryAdmit(s, now, ev, budget) {
			quota--
			continue
		}
		kept = append(kept, s)
	}
	clear(grp[len(kept):])
	r.groups[g] = kept
}

// groupOf is the Preble priority group of waiting request s: ceil(G·hit)−1,
// clamped to [0, G−1], where hit is the cached fraction of its prompt.
func (r *Replica) groupOf(s *seq) int {
	G := len(r.groups)
	p := s.req.PromptTokens
	n, _ := r.scanPrefix(s, len(s.keys))
	hit := min(n*r.cfg.BlockSize, p)
	g := (G*hit+p-1)/p - 1
	return max(0, min(g, G-1))
}
