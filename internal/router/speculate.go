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

// specKey is one block on one replica.
type specKey struct {
	replica int
	key     blocks.Key
}

// specEntry is one routed request's speculative blocks.
type specEntry struct {
	replica  int
	keys     []blocks.Key
	deadline time.Time
}

// speculation is the router's pending speculative marks: a FIFO of entries
// in deadline order (the TTL is fixed, and the router is told the time in
// order) and, per block and replica, the deadline of its latest speculation.
// A block whose pending deadline is not its entry's was confirmed, settled,
// or speculated again later.
type speculation struct {
	fifo    []specEntry
	head    int
	pending map[specKey]time.Time
}

func newSpeculation() speculation {
	return speculation{pending: make(map[specKey]time.Time)}
}

// speculate marks the blocks of path (keys, as routed) that replica id does
// not hold as cached on it until now + SpeculativeTTL; blocks already
// pending get the new deadline.
func (r *Router) speculate(id int, keys []blocks.Key, path []*prefixtree.Node, now time.Time) {
	deadline := now.Add(r.cfg.SpeculativeTTL)
	var mine []blocks.Key
	off := 0
	for _, n := range path {
		own := min(n.Own(), len(keys)-off)
		for _, k := range keys[off : off+own] {
			sk := specKey{id, k}
			if _, pend := r.spec.pending[sk]; pend || !n.Cached(id) {
				r.spec.pending[sk] = deadline
				mine = append(mine, k)
			}
		}
		off += own
		r.tree.SetCached(n, id, true)
	}
	if len(mine) > 0 {
		r.spec.fifo = append(r.spec.fifo, specEntry{replica: id, keys: mine, deadline: deadline})
	}
}

// confirm settles replica id's pending speculation on keys: an event said
// they were stored (they stay cached) or removed.
func (s *speculation) confirm(id int, keys []blocks.Key) {
	if len(s.pending) == 0 {
		return
	}
	for _, k := range keys {
		delete(s.pending, specKey{id, k})
	}
}

// forget settles every pending speculation on replica id.
func (s *speculation) forget(id int) {
	for k := range s.pending {
		if k.replica == id {
			delete(s.pending, k)
		}
	}
}

// Speculative returns the number of blocks marked speculatively and not yet
// confirmed, on every replica.
func (r *Router) Speculative() int { return len(r.spec.pending) }

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
		for _, k := range e.keys {
			sk := specKey{e.replica, k}
			if d, ok := s.pending[sk]; ok && d.Equal(e.deadline) {
				delete(s.pending, sk)
				r.uncache(e.replica, k)
			}
		}
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
