package workload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
)

// ErrShares is returned for a malformed share list.
var ErrShares = errors.New("workload: invalid shares")

// Share is one class and its proportion of the requests.
type Share struct {
	Name  string
	Share float64
}

// ParseShares parses "NAME:SHARE,..." (shares > 0, not necessarily summing
// to 1: they are proportions); "" is no classes.
func ParseShares(s string) ([]Share, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []Share
	seen := map[string]bool{}
	for part := range strings.SplitSeq(s, ",") {
		name, v, ok := strings.Cut(strings.TrimSpace(part), ":")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return nil, fmt.Errorf("%w: %q is not NAME:SHARE", ErrShares, part)
		}
		x, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || !(x > 0) || math.IsInf(x, 0) {
			return nil, fmt.Errorf("%w: share of %q must be a number > 0, got %q", ErrShares, name, v)
		}
		if seen[name] {
			return nil, fmt.Errorf("%w: %q given twice", ErrShares, name)
		}
		seen[name] = true
		out = append(out, Share{Name: name, Share: x})
	}
	return out, nil
}

// PriorityOf is a priority's value: an integer, or high (1), normal (0),
// low (-1).
func PriorityOf(name string) (int, error) {
	switch strings.ToLower(name) {
	case "high":
		return 1, nil
	case "normal":
		return 0, nil
	case "low":
		return -1, nil
	}
	p, err := strconv.Atoi(name)
	if err != nil {
		return 0, fmt.Errorf("%w: priority %q is not an integer nor high, normal, low", ErrShares, name)
	}
	return p, nil
}

// ParsePriorities parses the --priorities list into priority values, in
// order.
func ParsePriorities(s string) ([]int, error) {
	sh, err := ParseShares(s)
	if err != nil {
		return nil, err
	}
	out := make([]int, len(sh))
	for i, x := range sh {
		if out[i], err = PriorityOf(x.Name); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// AssignClasses gives reqs priorities and tenants drawn in the proportions
// of the share lists (ParseShares; "" leaves the field alone), from a
// source seeded by seed. The requests of one session get one draw, so a
// conversation keeps its class; a request without a session gets its own.
func AssignClasses(reqs []Request, priorities, tenants string, seed int64) error {
	ps, err := ParseShares(priorities)
	if err != nil {
		return err
	}
	pv, err := ParsePriorities(priorities)
	if err != nil {
		return err
	}
	ts, err := ParseShares(tenants)
	if err != nil {
		return err
	}
	if len(ps) == 0 && len(ts) == 0 {
		return nil
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 0xc1a55e5))
	type class struct {
		p int
		t string
	}
	bySession := map[string]class{}
	for i := range reqs {
		r := &reqs[i]
		c, ok := bySession[r.Session]
		if !ok || r.Session == "" {
			c = class{p: r.Priority, t: r.Tenant}
			if len(ps) > 0 {
				c.p = pv[draw(rng, ps)]
			}
			if len(ts) > 0 {
				c.t = ts[draw(rng, ts)].Name
			}
			if r.Session != "" {
				bySession[r.Session] = c
			}
		}
		r.Priority, r.Tenant = c.p, c.t
	}
	return nil
}

// draw picks an index of sh with probability proportional to its share.
func draw(rng *rand.Rand, sh []Share) int {
	var sum float64
	for _, s := range sh {
		sum += s.Share
	}
	x := rng.Float64() * sum
	for i, s := range sh {
		if x < s.Share {
			return i
		}
		x -= s.Share
	}
	return len(sh) - 1
}
