package router

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// Speculative entries. A replica that reports KV events tells the router
// what it cached only after the prefill that stored it, plus the stream's
// lag; a second request for the same prefix arriving meanwhile would see no
// match and could be sent elsewhere. So when a request is routed to such a
// replica, the blocks of its prompt that the replica does not hold yet are
// marked cached at once, speculatively, until now + SpeculativeTTL. A
// BlockStored for a block confirms it (it stays, as any reported block); a
// BlockRemoved or AllBlocksCleared settles it too; one still unconfirmed at
// its deadline is unmarked (the request failed, was cancelled, or went to an
// engine that does not store what it computes).
//
// Expiry is checked whenever the router is given the time (Route,
// CacheStored, ExpireSpeculative): the router has no clock of its own.

// The marks live on the tree's nodes (prefixtree.Tree.SetStamp): a node
// the request's path passes through carries, for the replica, the stamp of
// the latest speculation that marked it, one store per node where a map
// entry per block (specKey, before) cost a fifth of an overloaded e2 run
// (docs/performance.md, "E2 on full caches"). Every block of a node shares
// its node's state, as the per-block map's entries did: a speculation marks
// whole nodes (the path of an inserted prompt ends on a node boundary), an
// event confirms whole nodes (CacheStored's keys are the tail of their
// path) or single isolated blocks (CacheRemoved), and a split gives both
// halves the stamp. So the blocks an entry still holds under its stamp are
// always whole nodes (its spans began and ended on node boundaries, and
// nodes only split since), and expiry uncaches those nodes as they are: it
// cuts no node, and the tree's shape is what routes and engine events made
// of it, as in Preble's and SGLang's radix trees, whose nodes split only
// where prompts diverge (docs/performance.md, "Expired runs as one node").

// specEntry is one routed request's speculative blocks.
type specEntry struct {
	replica int
	// keys are the request's keys (not a copy: the router keeps them for
	// the request's flight too), spans the runs of them marked, in path
	// order: the runs of the nodes marked, which later splits may cut into
	// more nodes.
	keys     []blocks.Key
	spans    []span
	deadline time.Time
	stamp    int64
}

// span is keys[from:to] of a specEntry.
type span struct{ from, to int }

// speculation is the router's pending speculative marks: a FIFO of entries
// in deadline order (the TTL is fixed, and the router is told the time in
// order). A node whose stamp on the entry's replica is not the entry's was
// confirmed, settled, or speculated again with a later deadline.
type speculation struct {
	fifo []specEntry
	head int
	// stamp numbers the deadlines given out: entries with equal deadlines
	// share one, as they shared the per-block map's deadline value.
	stamp int64
	last  time.Time
}

func newSpeculation() speculation { return speculation{} }

// speculate marks the blocks of path (keys, as routed) that replica id does
// not hold as cached on it until now + SpeculativeTTL; blocks already
// pending get the new deadline.
func (r *Router) speculate(id int, keys []blocks.Key, path []*prefixtree.Node, now time.Time) {
	s := &r.spec
	deadline := now.Add(r.cfg.SpeculativeTTL)
	if s.stamp == 0 || !deadline.Equal(s.last) {
		s.stamp++
		s.last = deadline
	}
	var spans []span
	off := 0
	for _, n := range path {
		own := min(n.Own(), len(keys)-off)
		mark := n.Stamp(id) != 0 || !n.Cached(id)
		if mark {
			if k := len(spans) - 1; k >= 0 && spans[k].to == off {
				spans[k].to += own
			} else {
				spans = append(spans, span{off, off + own})
			}
		}
		off += own
		r.tree.SetCached(n, id, true)
		if mark {
			r.tree.SetStamp(n, id, s.stamp)
		}
	}
	if len(spans) > 0 {
		s.fifo = append(s.fifo, specEntry{replica: id, keys: keys, spans: spans, deadline: deadline, stamp: s.stamp})
	}
}

// confirm settles replica id's pending speculation on the nodes of path:
// an event said their blocks were stored (they stay cached).
func (r *Router) confirm(id int, path []*prefixtree.Node) {
	if r.tree.StampedBlocks(id) == 0 {
		return
	}
	for _, n := range path {
		r.tree.SetStamp(n, id, 0)
	}
}

// forget settles every pending speculation on replica id.
func (r *Router) forget(id int) { r.tree.ClearStamps(id) }

// Speculative returns the number of blocks marked speculatively and not yet
// confirmed, on every replica.
func (r *Router) Speculative() int {
	t := 0
	for id := range r.reps {
		t += r.tree.StampedBlocks(id)
	}
	return t
}

// ExpireSpeculative unmarks the speculative blocks whose deadline is at or
// before now and that no event confirmed. Route and CacheStored call it; an
// owner that may go a while without either calls it on a timer
// (cluster.Core.ExpireSpeculative).
func (r *Router) ExpireSpeculative(now time.Time) { r.expireSpeculative(now) }

func (r *Router) expireSpeculative(now time.Time) {
	s := &r.spec
	for s.head < len(s.fifo) {
		e := &s.fifo[s.head]
		if e.deadline.After(now) {
			break
		}
		r.expire(e)
		*e = specEntry{}
		s.head++
	}
	if s.head == len(s.fifo) {
		s.fifo, s.head = s.fifo[:0], 0
	} else if s.head > 1024 && s.head > len(s.fifo)/2 {
		n := copy(s.fifo, s.fifo[s.head:])
		clear(s.fifo[n:])
		s.fifo, s.head = s.fifo[:n], 0
	}
}

// expire unmarks e's blocks that still carry its stamp, a node's run at a
// time, and steps over the runs of nodes that an event or a later
// speculation settled without looking their blocks up. (Until this change
// each block was isolated in a node of its own, as a BlockRemoved would be:
// an artefact of the per-block map, not information from an engine, which
// cut long prompts into thousands of one-block nodes, none of them a prefix
// unit for E2.)
func (r *Router) expire(e *specEntry) {
	for _, sp := range e.spans {
		r.expireSpan(e.replica, e.keys[sp.from:sp.to], e.stamp)
	}
}

// expireSpan unmarks the blocks of keys on replica id that carry stamp,
// each stamped node's run of them as one node: the whole node (see above),
// or, should a stamped run ever end inside a node, that run cut out with
// at most two splits (Tree.IsolateRunAt).
func (r *Router) expireSpan(id int, keys []blocks.Key, stamp int64) {
	for i := 0; i < len(keys) && r.tree.StampedBlocks(id) > 0; {
		n, off, ok := r.tree.Find(keys[i])
		if !ok {
			i++
			continue
		}
		if n.Stamp(id) != stamp {
			// Settled: so is the rest of n's run that keys hold.
			nk := n.Keys()
			for i++; off+1 < len(nk) && i < len(keys) && nk[off+1] == keys[i]; i++ {
				off++
			}
			continue
		}
		// Stamped, so cached on id: uncache the run keys share with n.
		nk := n.Keys()
		c := 1
		for off+c < len(nk) && i+c < len(keys) && nk[off+c] == keys[i+c] {
			c++
		}
		x := r.tree.IsolateRunAt(n, off, c)
		r.tree.SetCached(x, id, false)
		i += c
	}
}
