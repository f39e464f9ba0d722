package policy

import (
	"math"
	"time"

	"github.com/cespare/xxhash/v2"
)

// RoundRobin sends requests to the up replicas in turn. It is the baseline
// Preble compares against (SGLang behind a round-robin balancer).
type RoundRobin struct {
	next int
}

var _ Policy = (*RoundRobin)(nil)

// Name implements Policy.
func (p *RoundRobin) Name() string { return "round-robin" }

// Route implements Policy.
func (p *RoundRobin) Route(req *Request, v *View, now time.Time) (Decision, error) {
	n := len(v.Replicas)
	for i := 0; i < n; i++ {
		r := (p.next + i) % n
		if v.Replicas[r].Up {
			p.next = r + 1
			return Decision{Replica: r, Branch: "round-robin", MatchedTokens: v.MatchedTokens(r, req)}, nil
		}
	}
	return Decision{}, ErrNoReplica
}

// Random picks an up replica uniformly at random from v.Rand.
type Random struct{}

var _ Policy = Random{}

// Name implements Policy.
func (Random) Name() string { return "random" }

// Route implements Policy.
func (Random) Route(req *Request, v *View, now time.Time) (Decision, error) {
	up := v.Up()
	if up == 0 {
		return Decision{}, ErrNoReplica
	}
	k := v.Rand.IntN(up)
	for i := range v.Replicas {
		if !v.Replicas[i].Up {
			continue
		}
		if k == 0 {
			return Decision{Replica: i, Branch: "random", MatchedTokens: v.MatchedTokens(i, req)}, nil
		}
		k--
	}
	return Decision{}, ErrNoReplica
}

// LeastLoad picks the up replica with the fewest in-flight requests (ties to
// the lowest ID).
type LeastLoad struct{}

var _ Policy = LeastLoad{}

// Name implements Policy.
func (LeastLoad) Name() string { return "least-load" }

// Route implements Policy.
func (LeastLoad) Route(req *Request, v *View, now time.Time) (Decision, error) {
	r, err := argmin(v, func(r int) float64 { return float64(v.Replicas[r].InFlight) })
	if err != nil {
		return Decision{}, err
	}
	return Decision{Replica: r, Branch: "least-load", MatchedTokens: v.MatchedTokens(r, req)}, nil
}

// PowerOfTwo samples two distinct up replicas at random and takes the one
// with fewer in-flight requests (Mitzenmacher, "The Power of Two Choices in
// Randomized Load Balancing", 2001).
type PowerOfTwo struct{}

var _ Policy = PowerOfTwo{}

// Name implements Policy.
func (PowerOfTwo) Name() string { return "power-of-two" }

// Route implements Policy.
func (PowerOfTwo) Route(req *Request, v *View, now time.Time) (Decision, error) {
	up := v.Up()
	if up == 0 {
		return Decision{}, ErrNoReplica
	}
	a := v.Rand.IntN(up)
	b := a
	if up > 1 {
		b = v.Rand.IntN(up - 1)
		if b >= a {
			b++
		}
	}
	ra, rb := nthUp(v, a), nthUp(v, b)
	r := ra
	if v.Replicas[rb].InFlight < v.Replicas[ra].InFlight ||
		(v.Replicas[rb].InFlight == v.Replicas[ra].InFlight && rb < ra) {
		r = rb
	}
	return Decision{Replica: r, Branch: "power-of-two", MatchedTokens: v.MatchedTokens(r, req)}, nil
}

func nthUp(v *View, k int) int {
	for i := range v.Replicas {
		if v.Replicas[i].Up {
			if k == 0 {
				return i
			}
			k--
		}
	}
	return -1
}

// Session pins each session to a replica by rendezvous (highest random
// weight) hashing of the session key over the up replicas (Thaler and Ravishankar,
// 1998): a replica leaving moves only its own sessions. Requests without a
// session key are keyed by their first block, else sent round-robin.
type Session struct {
	rr RoundRobin
}

var _ Policy = (*Session)(nil)

// Name implements Policy.
func (p *Session) Name() string { return "session" }

// Route implements Policy.
func (p *Session) Route(req *Request, v *View, now time.Time) (Decision, error) {
	var key uint64
	switch {
	case req.Session != "":
		key = xxhash.Sum64String(req.Session)
	case len(req.Keys) > 0:
		key = uint64(req.Keys[0])
	default:
		d, err := p.rr.Route(req, v, now)
		d.Branch = "session-none"
		return d, err
	}
	best, bestW := -1, uint64(0)
	for i := range v.Replicas {
		if !v.Replicas[i].Up {
			continue
		}
		w := mix64(key ^ mix64(uint64(i)+1))
		if best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	if best < 0 {
		return Decision{}, ErrNoReplica
	}
	return Decision{Replica: best, Branch: "session", MatchedTokens: v.MatchedTokens(best, req)}, nil
}

// mix64 is SplitMix64's finaliser (Steele et al., 2014).
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Prefix sends a request to the replica that caches the longest part of its
// prompt when that part is at least Threshold of the prompt, and to the least
// loaded replica otherwise: pure cache affinity, the "stick" end of the
// trade-off that Preble's E2 balances.
type Prefix struct {
	Threshold float64
}

var _ Policy = (*Prefix)(nil)

// NewPrefix returns a Prefix policy (threshold clamped to [0,1]).
func NewPrefix(threshold float64) *Prefix {
	if !finite(threshold) || threshold < 0 {
		threshold = 0
	}
	return &Prefix{Threshold: math.Min(threshold, 1)}
}

// Name implements Policy.
func (p *Prefix) Name() string { return "prefix" }

// Route implements Policy.
func (p *Prefix) Route(req *Request, v *View, now time.Time) (Decision, error) {
	best, bestM := -1, -1
	for i := range v.Replicas {
		if !v.Replicas[i].Up {
			continue
		}
		m := v.MatchedTokens(i, req)
		if m > bestM || (m == bestM && v.Replicas[i].InFlight < v.Replicas[best].InFlight) {
			best, bestM = i, m
		}
	}
	if best < 0 {
		return Decision{}, ErrNoReplica
	}
	if req.PromptTokens > 0 && bestM > 0 && float64(bestM) >= p.Threshold*float64(req.PromptTokens) {
		return Decision{Replica: best, Branch: "prefix", MatchedTokens: bestM}, nil
	}
	d, err := LeastLoad{}.Route(req, v, now)
	d.Branch = "least-load"
	return d, err
}
