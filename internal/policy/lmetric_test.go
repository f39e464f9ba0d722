package policy_test

import (
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestLMetric: the replica with the fewest uncached prompt tokens × batch
// size wins; ties go to fewer uncached tokens, then the smaller batch.
// The batch is the engine's running count, at least the router's own in
// flight. A 1024-token prompt; replica 1 caches 512 tokens of it, replica
// 2 768: 1024, 512 and 256 uncached.
func TestLMetric(t *testing.T) {
	prompt := toks(30, 1024)
	for _, tt := range []struct {
		name    string
		running []int // scraped running requests (-1 unknown)
		flight  []int // the router's in flight
		want    int
		scores  []float64
	}{
		{"idle cluster: the zero tie goes to the most cached", []int{0, 0, 0}, []int{0, 0, 0}, 2, []float64{0, 0, 0}},
		{"equal batches: the most cached", []int{1, 1, 1}, []int{0, 0, 0}, 2, []float64{1024, 512, 256}},
		{"the best holder is busy: the product picks the next", []int{1, 1, 4}, []int{0, 0, 0}, 1, []float64{1024, 512, 1024}},
		{"an idle replica beats busy holders", []int{0, 3, 5}, []int{0, 0, 0}, 0, []float64{0, 1536, 1280}},
		{"the router's in-flight count when the scrape lags", []int{0, 0, -1}, []int{4, 1, 3}, 1, []float64{4096, 512, 768}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 3, bigKV)
			c.cache(prompt[:512], 1, at(0))
			c.cache(prompt[:768], 2, at(0))
			for i := range c.reps {
				c.reps[i].Running, c.reps[i].InFlight = tt.running[i], tt.flight[i]
			}
			req, v := c.request(prompt, at(1))
			d, err := policy.LMetric{}.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica != tt.want || d.Branch != "lmetric" {
				t.Errorf("got %s → %d, want lmetric → %d (%s)", d.Branch, d.Replica, tt.want, d.Explain())
			}
			for _, cd := range d.Candidates {
				if cd.Score != tt.scores[cd.Replica] {
					t.Errorf("replica %d: score %v, want %v", cd.Replica, cd.Score, tt.scores[cd.Replica])
				}
			}
		})
	}
}

// TestLMetricNoCacheLeastBatch: with nothing cached anywhere the score is
// the prompt × batch, so the smallest batch wins, and a down replica is
// never chosen.
func TestLMetricNoCacheLeastBatch(t *testing.T) {
	c := newCluster(t, 3, bigKV)
	c.reps[0].Running, c.reps[1].Running, c.reps[2].Running = 5, 2, 0
	c.reps[2].Up = false
	req, v := c.request(toks(31, 500), at(1))
	d, err := policy.LMetric{}.Route(req, v, at(1))
	if err != nil || d.Replica != 1 {
		t.Fatalf("got %d, %v; want replica 1 (%s)", d.Replica, err, d.Explain())
	}
	for i := range c.reps {
		c.reps[i].Up = false
	}
	if _, err := (policy.LMetric{}).Route(req, v, at(1)); err == nil {
		t.Error("no replica up: want an error")
	}
}
