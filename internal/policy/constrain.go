package policy

import "time"

// Constrained wraps a policy so that one decision can be held to some
// replicas without marking the others down in the router (which would tell
// the policy they left the pool and drop their placements): the proxy
// excludes replicas a request already failed on, the endpoint picker holds
// a decision to the gateway's subset hint or forces the endpoint that
// actually served. Set the fields under the router's lock around Route and
// reset them after. It passes every observation and Speculative through.
type Constrained struct {
	// Inner is the policy that decides.
	Inner Policy
	// Exclude lists replicas this decision must not choose.
	Exclude []int
	// Restrict, when true, lets this decision choose only among Allowed.
	Restrict bool
	Allowed  []int
	// Force ≥ 0 makes the decision this replica, without asking Inner.
	Force int

	obs  Observer  // Inner as an Observer, or nil
	reps []Replica // scratch copy of the view's replicas
}

var (
	_ Policy     = (*Constrained)(nil)
	_ Observer   = (*Constrained)(nil)
	_ Speculator = (*Constrained)(nil)
)

// NewConstrained wraps inner with no constraint in force.
func NewConstrained(inner Policy) *Constrained {
	c := &Constrained{Inner: inner, Force: -1}
	c.obs, _ = inner.(Observer)
	return c
}

// Name implements Policy.
func (c *Constrained) Name() string { return c.Inner.Name() }

// Speculative implements Speculator for Inner.
func (c *Constrained) Speculative() bool {
	sp, ok := c.Inner.(Speculator)
	return ok && sp.Speculative()
}

// Route implements Policy: Inner sees the replicas it may not choose as
// down, for this decision only.
func (c *Constrained) Route(req *Request, v *View, now time.Time) (Decision, error) {
	if c.Force >= 0 {
		return Decision{Replica: c.Force, Branch: "served", MatchedTokens: v.MatchedTokens(c.Force, req)}, nil
	}
	if !c.Restrict && len(c.Exclude) == 0 {
		return c.Inner.Route(req, v, now)
	}
	c.reps = append(c.reps[:0], v.Replicas...)
	if c.Restrict {
		for i := range c.reps {
			c.reps[i].Up = false
		}
		for _, id := range c.Allowed {
			if id >= 0 && id < len(c.reps) {
				c.reps[id].Up = v.Replicas[id].Up
			}
		}
	}
	for _, id := range c.Exclude {
		if id >= 0 && id < len(c.reps) {
			c.reps[id].Up = false
		}
	}
	vv := *v
	vv.Replicas = c.reps
	return c.Inner.Route(req, &vv, now)
}

// Routed implements Observer.
func (c *Constrained) Routed(req *Request, d *Decision, v *View, now time.Time) {
	if c.obs != nil {
		c.obs.Routed(req, d, v, now)
	}
}

// FirstToken implements Observer.
func (c *Constrained) FirstToken(id uint64, replica int, ttft time.Duration, now time.Time) {
	if c.obs != nil {
		c.obs.FirstToken(id, replica, ttft, now)
	}
}

// Finished implements Observer.
func (c *Constrained) Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time) {
	if c.obs != nil {
		c.obs.Finished(id, replica, outputTokens, ok, now)
	}
}

// ReplicaDown implements Observer.
func (c *Constrained) ReplicaDown(replica int, now time.Time) {
	if c.obs != nil {
		c.obs.ReplicaDown(replica, now)
	}
}
