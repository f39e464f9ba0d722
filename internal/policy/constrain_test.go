package policy_test

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestConstrained checks each constraint on a literal 4-replica cluster
// with round-robin inside (which would otherwise pick replica 0 first).
func TestConstrained(t *testing.T) {
	tests := []struct {
		name    string
		set     func(c *policy.Constrained)
		want    int
		wantErr bool
		branch  string
	}{
		{name: "none", set: func(c *policy.Constrained) {}, want: 0, branch: "round-robin"},
		{name: "exclude 0 and 1", set: func(c *policy.Constrained) { c.Exclude = []int{0, 1} }, want: 2, branch: "round-robin"},
		{name: "restrict to 3", set: func(c *policy.Constrained) { c.Restrict, c.Allowed = true, []int{3} }, want: 3, branch: "round-robin"},
		{name: "restrict to nothing", set: func(c *policy.Constrained) { c.Restrict = true }, wantErr: true},
		{name: "restrict and exclude", set: func(c *policy.Constrained) {
			c.Restrict, c.Allowed, c.Exclude = true, []int{1, 2}, []int{1}
		}, want: 2, branch: "round-robin"},
		{name: "force 3", set: func(c *policy.Constrained) { c.Force = 3 }, want: 3, branch: "served"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := policy.NewConstrained(&policy.RoundRobin{})
			tt.set(c)
			cl := newCluster(t, 4, bigKV)
			req, v := cl.request(toks(1, 64), at(0))
			d, err := c.Route(req, v, at(0))
			if tt.wantErr {
				if err == nil {
					t.Fatalf("got replica %d, want an error", d.Replica)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica != tt.want || d.Branch != tt.branch {
				t.Errorf("got %d (%s), want %d (%s)", d.Replica, d.Branch, tt.want, tt.branch)
			}
			for i := range v.Replicas {
				if !v.Replicas[i].Up {
					t.Errorf("the caller's view was changed: replica %d marked down", i)
				}
			}
		})
	}
}

// TestConstrainedSpeculative: the wrapper passes the inner policy's wish
// for speculative entries through.
func TestConstrainedSpeculative(t *testing.T) {
	e2, err := policy.New("e2", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	if !policy.NewConstrained(e2).Speculative() {
		t.Error("e2 wrapped: Speculative() = false, want true")
	}
	if policy.NewConstrained(&policy.RoundRobin{}).Speculative() {
		t.Error("round-robin wrapped: Speculative() = true, want false")
	}
}
