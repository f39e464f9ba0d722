package epp

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// constraint wraps the configured policy so that one decision can be held
// to a set of replicas (the gateway's subset hint, the ready ones) or
// forced onto one (the endpoint that actually served), without marking
// the others down in the core, which would tell the policy they left the
// pool. The Picker sets its fields under its lock around Route.
type constraint struct {
	inner    policy.Policy
	obs      policy.Observer // inner as an Observer, or nil
	restrict bool            // only allowed replicas may be chosen
	allowed  []int
	force    int              // ≥ 0: the decision is this replica
	reps     []policy.Replica // scratch copy of the view's replicas
}

var (
	_ policy.Policy   = (*constraint)(nil)
	_ policy.Observer = (*constraint)(nil)
)

func newConstraint(inner policy.Policy) *constraint {
	c := &constraint{inner: inner, force: -1}
	c.obs, _ = inner.(policy.Observer)
	return c
}

// Name implements policy.Policy.
func (c *constraint) Name() string { return c.inner.Name() }

// Route implements policy.Policy.
func (c *constraint) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	if c.force >= 0 {
		return policy.Decision{Replica: c.force, Branch: "served", MatchedTokens: v.MatchedTokens(c.force, req)}, nil
	}
	if !c.restrict {
		return c.inner.Route(req, v, now)
	}
	c.reps = append(c.reps[:0], v.Replicas...)
	for i := range c.reps {
		c.reps[i].Up = false
	}
	for _, id := range c.allowed {
		if id >= 0 && id < len(c.reps) {
			c.reps[id].Up = v.Replicas[id].Up
		}
	}
	vv := *v
	vv.Replicas = c.reps
	return c.inner.Route(req, &vv, now)
}

// Routed implements policy.Observer.
func (c *constraint) Routed(req *policy.Request, d *policy.Decision, v *policy.View, now time.Time) {
	if c.obs != nil {
		c.obs.Routed(req, d, v, now)
	}
}

// FirstToken implements policy.Observer.
func (c *constraint) FirstToken(id uint64, replica int, ttft time.Duration, now time.Time) {
	if c.obs != nil {
		c.obs.FirstToken(id, replica, ttft, now)
	}
}

// Finished implements policy.Observer.
func (c *constraint) Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time) {
	if c.obs != nil {
		c.obs.Finished(id, replica, outputTokens, ok, now)
	}
}

// ReplicaDown implements policy.Observer.
func (c *constraint) ReplicaDown(replica int, now time.Time) {
	if c.obs != nil {
		c.obs.ReplicaDown(replica, now)
	}
}
