package router

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestRouteWithin checks each constraint, and Assign, on a 4-replica
// cluster with round-robin (which would otherwise pick replica 0 first):
// the decision obeys it, the router's replicas stay up, and the request is
// committed where the decision says.
func TestRouteWithin(t *testing.T) {
	tests := []struct {
		name    string
		c       Constraint
		force   int
		want    int
		wantErr bool
		branch  string
	}{
		{name: "none", force: -1, want: 0, branch: "round-robin"},
		{name: "exclude 0 and 1", c: Constraint{Exclude: []int{0, 1}}, force: -1, want: 2, branch: "round-robin"},
		{name: "only 3", c: Constraint{Only: []int{3}}, force: -1, want: 3, branch: "round-robin"},
		{name: "only nothing", c: Constraint{Only: []int{}}, force: -1, wantErr: true},
		{name: "only and exclude", c: Constraint{Only: []int{1, 2}, Exclude: []int{1}}, force: -1, want: 2, branch: "round-robin"},
		{name: "out of range ids are ignored", c: Constraint{Only: []int{-1, 7, 2}, Exclude: []int{9}}, force: -1, want: 2, branch: "round-robin"},
		{name: "assign 3", force: 3, want: 3, branch: "served"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRouter(t, &policy.RoundRobin{}, 0, false, false, false, false)
			var d policy.Decision
			var err error
			if tt.force >= 0 {
				d, err = r.Assign(req(1, toks(1, 64)), tt.force, at(0))
			} else {
				d, err = r.RouteWithin(req(1, toks(1, 64)), at(0), tt.c)
			}
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
			for i := range 4 {
				st, _ := r.Replica(i)
				if !st.Up {
					t.Errorf("replica %d marked down by a constraint", i)
				}
				if want := 0; i == tt.want {
					want = 1
					if st.InFlight != want {
						t.Errorf("replica %d: %d in flight, want %d", i, st.InFlight, want)
					}
				} else if st.InFlight != want {
					t.Errorf("replica %d: %d in flight, want %d", i, st.InFlight, want)
				}
			}
			// The next unconstrained decision sees every replica again.
			if _, err := r.Route(req(2, toks(2, 64)), at(1)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAssignDownReplica: Assign will not commit a request to a replica
// that is down.
func TestAssignDownReplica(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, false, false)
	if n := r.UpCount(); n != 2 {
		t.Fatalf("%d replicas up, want 2", n)
	}
	if err := r.SetUp(1, false, at(0)); err != nil {
		t.Fatal(err)
	}
	if n := r.UpCount(); n != 1 {
		t.Fatalf("%d replicas up after one went down, want 1", n)
	}
	if _, err := r.Assign(req(1, toks(1, 64)), 1, at(0)); err == nil {
		t.Fatal("assigned to a replica that is down")
	}
}
