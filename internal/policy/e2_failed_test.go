package policy_test

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// e2State is what E2's window shows at a time: each replica's windowed
// prefill load and mix-window hit ratio, each prefix unit's count and
// placement, and the cost terms of a probe request priced then.
func e2State(t *testing.T, p *policy.E2, c *cluster, probe []uint32, now time.Time) string {
	t.Helper()
	var b strings.Builder
	for r := range c.reps {
		hist, ratio := p.Window(r)
		fmt.Fprintf(&b, "r%d hist=%.9f mix=%.9f\n", r, hist, ratio)
	}
	var prefixes []string
	p.Prefixes(func(n *prefixtree.Node, count int) {
		prefixes = append(prefixes, fmt.Sprintf("prefix of %d tokens: count=%d assigned=%v", (n.Depth()+n.Own())*bt, count, members(&n.Assigned)))
	})
	sort.Strings(prefixes)
	b.WriteString(strings.Join(prefixes, "\n"))
	req, v := c.request(probe, now)
	req.Explain = true
	d, err := p.Route(req, v, now)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "\nprobe: %s\n%s", d.Explain(), d.ExplainTerms())
	return b.String()
}

// TestE2FailedRequestsLeaveTheWindow: requests that fail before their
// first token (a connection error, a 5xx, a cancel while queued) leave
// E2's window when they finish, not minutes later: every replica's
// windowed load and mix ratio, every prefix's count and placement, and the
// cost terms of the next decision are what they were before them. A
// request that failed after its first token stays: its prefill ran.
func TestE2FailedRequestsLeaveTheWindow(t *testing.T) {
	for _, cfg := range []policy.E2Config{policy.PrebleE2Config(), policy.DefaultE2Config()} {
		t.Run(cfg.Name, func(t *testing.T) {
			cfg.Rebalance, cfg.Replicate = false, false // moves are not undone
			p := mustE2(t, cfg)
			c := newCluster(t, 3, bigKV)
			hot, probe := toks(1, 512), cat(toks(1, 512), toks(2, 256))
			// Warm traffic, finished: the window the failures must leave as
			// it is.
			for i := range 6 {
				d, id := c.route(p, cat(hot, toks(uint64(10+i), 128)), at(float64(i)))
				p.FirstToken(id, d.Replica, 50*time.Millisecond, at(float64(i)+0.05))
				p.Finished(id, d.Replica, 20, true, at(float64(i)+1))
			}
			before := e2State(t, p, c, probe, at(10))

			// N requests, on the hot prefix and on new ones, all failing
			// before a first token: routed and committed (Routed), not
			// cached anywhere.
			type flight struct {
				id uint64
				r  int
			}
			var failed []flight
			for i := range 12 {
				prompt := cat(hot, toks(uint64(10+i%6), 128)) // the warm prompts: the tree keeps its shape
				if i%3 == 2 {
					prompt = toks(uint64(100+i), 1024) // a prefix nobody asked for before
				}
				req, v := c.request(prompt, at(10))
				d, err := p.Route(req, v, at(10))
				if err != nil {
					t.Fatal(err)
				}
				p.Routed(req, &d, v, at(10))
				failed = append(failed, flight{req.ID, d.Replica})
			}
			during := e2State(t, p, c, probe, at(10))
			t.Logf("before:\n%s\nduring:\n%s", before, during)
			if during == before {
				t.Fatal("the failing requests changed nothing in the window: the test shows nothing")
			}
			for _, f := range failed {
				p.Finished(f.id, f.r, 0, false, at(10.5))
			}
			if after := e2State(t, p, c, probe, at(10.5)); after != before {
				t.Errorf("after the failures, the window is not what it was before them:\nbefore:\n%s\nafter:\n%s", before, after)
			}

			// One that failed after its first token keeps its place.
			req, v := c.request(cat(hot, toks(10, 128)), at(11))
			d, err := p.Route(req, v, at(11))
			if err != nil {
				t.Fatal(err)
			}
			p.Routed(req, &d, v, at(11))
			p.FirstToken(req.ID, d.Replica, 40*time.Millisecond, at(11.04))
			p.Finished(req.ID, d.Replica, 3, false, at(11.5))
			if kept := e2State(t, p, c, probe, at(11.5)); kept == before {
				t.Error("a request that produced a token and then failed left the window")
			}

			// The failed requests' later expiry counts nothing twice: past
			// the window everything is gone.
			// (Window reads the figures as last expired: a decision expires
			// them.)
			late := at(11.5).Add(cfg.Window + time.Second)
			req, v = c.request(probe, late)
			if _, err := p.Route(req, v, late); err != nil {
				t.Fatal(err)
			}
			for r := range c.reps {
				if hist, ratio := p.Window(r); hist != 0 || ratio != 0 {
					t.Errorf("r%d past the window: hist=%v mix ratio=%v, want 0, 0", r, hist, ratio)
				}
			}
			p.Prefixes(func(n *prefixtree.Node, count int) {
				t.Errorf("prefix of %d tokens still counted %d past the window", (n.Depth()+n.Own())*bt, count)
			})
		})
	}
}
