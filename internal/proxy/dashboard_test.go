package proxy

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/dashboard"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// getState fetches path with the bearer token (none when "").
func getState(t *testing.T, url, token string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp, readAll(t, resp)
}

// TestDashboardSnapshot drives real requests through a proxy over fake
// replicas and reads the dashboard's state.json: replicas, branches, the
// hot prefix and where it is placed, the recent decisions, the admin token.
func TestDashboardSnapshot(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	// The fakes' constant cached_tokens would be reports of a cache that
	// holds nothing, and the router would shrink its mirror of them to
	// match (router.CacheView): these report none, so the mirror holds
	// what was routed.
	a.noCached.Store(true)
	b.noCached.Store(true)
	cfg := testConfig(a, b)
	cfg.AdminToken = "s3cret"
	p, srv := startProxy(t, cfg)

	long := strings.Repeat("shared system prompt. ", 60)
	hot := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, long+"question one?")
	other := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, strings.Repeat("another prompt entirely. ", 60))
	served := map[string]int{}
	for _, body := range []string{hot, hot, hot, other} {
		resp := post(t, srv.URL, "/v1/completions", body)
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("completion: %d", resp.StatusCode)
		}
		served[resp.Header.Get(HeaderReplica)]++
	}

	for _, tc := range []struct {
		path, token string
		want        int
	}{
		{"/ui/state.json", "", http.StatusUnauthorized},
		{"/ui/state.json", "wrong", http.StatusUnauthorized},
		{"/ui/state.json?token=wrong", "", http.StatusUnauthorized},
		{"/ui/", "", http.StatusUnauthorized},
		{"/ui/state.json", "s3cret", http.StatusOK},
		{"/ui/state.json?token=s3cret", "", http.StatusOK},
		{"/ui/?token=s3cret", "", http.StatusOK},
	} {
		resp, _ := getState(t, srv.URL+tc.path, tc.token)
		if resp.StatusCode != tc.want {
			t.Errorf("GET %s (token %q): %d, want %d", tc.path, tc.token, resp.StatusCode, tc.want)
		}
	}

	resp, body := getState(t, srv.URL+"/ui/state.json", "s3cret")
	var s dashboard.Snapshot
	if err := json.Unmarshal(body, &s); err != nil {
		t.Fatalf("state.json: %v\n%s", err, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content type %q", ct)
	}
	if s.Policy != "e2" || len(s.Replicas) != 2 || s.Replicas[0].Name != "a" || s.Replicas[1].Name != "b" ||
		!s.Replicas[0].Up || !s.Replicas[1].Up {
		t.Fatalf("replicas %+v", s.Replicas)
	}
	if s.Totals.Routed != 4 || s.Totals.Finished != 4 || s.Totals.InFlight != 0 {
		t.Errorf("totals %+v", s.Totals)
	}
	if s.Branches["exploit"] <= 0 || s.DecisionsPerS <= 0 || s.RateWindowS < 1 {
		t.Errorf("branches %v, %v/s over %v s", s.Branches, s.DecisionsPerS, s.RateWindowS)
	}
	if len(s.Recent) != 4 || !strings.HasPrefix(s.Recent[0].Explain, "branch=") || s.Recent[0].Time.Before(s.Recent[3].Time) ||
		s.Recent[0].PromptTokens == 0 {
		t.Errorf("recent %+v", s.Recent)
	}
	var blocks int
	for _, r := range s.Replicas {
		blocks += r.CachedBlocks
		if r.HitRatio < 0 || r.HitRatio > 1 {
			t.Errorf("hit ratio %v", r.HitRatio)
		}
	}
	if blocks == 0 {
		t.Error("no cached blocks: the router mirrors what it routed")
	}
	if len(s.Prefixes) == 0 {
		t.Fatal("no prefixes")
	}
	top := s.Prefixes[0]
	if top.Requests != 3 || top.Tokens == 0 || top.RequestsPerS <= 0 || len(top.Assigned) != 1 || !slices.Equal(top.CachedOn, top.Assigned) {
		t.Errorf("hot prefix %+v (served %v)", top, served)
	}
	if served[top.Assigned[0]] < 3 {
		t.Errorf("hot prefix assigned to %v, but served %v", top.Assigned, served)
	}
	if s.CachePrediction.Checked > s.Totals.Finished || s.CachePrediction.ExactRatio < 0 || s.CachePrediction.ExactRatio > 1 {
		t.Errorf("cache prediction %+v", s.CachePrediction)
	}

	// A replica ejected shows down.
	p.checked(1, false, true)
	if s := p.Snapshot(); s.Replicas[1].Up || !s.Replicas[0].Up {
		t.Errorf("after ejecting b: %+v", s.Replicas)
	}
}

// TestDashboardRingWraps: the ring keeps the newest decisions only, and the
// rates stay finite when it wraps within the rate window.
func TestDashboardRingWraps(t *testing.T) {
	var g dashRing
	t0 := time.Unix(1000, 0)
	for i := range dashRingSize + 10 {
		d := policy.Decision{Replica: i % 2, Branch: "explore", MatchedTokens: i}
		g.record(t0.Add(time.Duration(i)*time.Millisecond), 100, &d)
	}
	var got []int
	g.each(func(e *dashEntry) bool {
		got = append(got, e.d.MatchedTokens)
		return true
	})
	if len(got) != dashRingSize || got[0] != dashRingSize+9 || got[len(got)-1] != 10 {
		t.Errorf("ring holds %d entries, %d..%d", len(got), got[0], got[len(got)-1])
	}
}

// BenchmarkRouteWithViewer measures routing decisions through the proxy's
// route path (the lock, the core, the dashboard's ring) with no dashboard
// viewer, and with one that polls a snapshot every 10 ms (ten times as often
// as the page does) and encodes it:
//
//	go test -run '^$' -bench RouteWithViewer ./internal/proxy/
func BenchmarkRouteWithViewer(b *testing.B) {
	for _, viewer := range []bool{false, true} {
		name := "no-viewer"
		if viewer {
			name = "viewer-10ms"
		}
		b.Run(name, func(b *testing.B) {
			reps := []*fakeReplica{newFakeReplica(b, "r0"), newFakeReplica(b, "r1"), newFakeReplica(b, "r2"), newFakeReplica(b, "r3")}
			p, err := New(testConfig(reps...))
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			bt := p.cfg.BlockTokens
			// 64 prefix groups of 48 shared blocks, each prompt with 4 blocks of its own.
			const groups, shared, own = 64, 48, 4
			reqs := make([]policy.Request, 4096)
			for i := range reqs {
				keys := make([]blocks.Key, 0, shared+own)
				g := uint64(i % groups)
				for j := range uint64(shared) {
					keys = append(keys, blocks.Key(g<<32|j+1))
				}
				for j := range uint64(own) {
					keys = append(keys, blocks.Key(1<<63|uint64(i)<<8|j))
				}
				reqs[i] = policy.Request{Keys: keys, PromptTokens: len(keys) * bt, OutputTokens: 64}
			}
			stop := make(chan struct{})
			var wg sync.WaitGroup
			snaps := 0
			if viewer {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tick := time.NewTicker(10 * time.Millisecond)
					defer tick.Stop()
					for {
						select {
						case <-stop:
							return
						case <-tick.C:
							if _, err := json.Marshal(p.Snapshot()); err != nil {
								panic(err)
							}
							snaps++
						}
					}
				}()
			}
			b.ReportAllocs()
			b.ResetTimer()
			start := time.Now()
			const window = 256 // requests in flight
			for i := 0; b.Loop(); i++ {
				req := reqs[i%len(reqs)]
				req.ID = uint64(i + 1)
				if _, err := p.route(req, nil); err != nil {
					b.Fatal(err)
				}
				if i >= window {
					p.finish(uint64(i+1-window), 64, -1, true)
				}
			}
			elapsed := time.Since(start)
			b.StopTimer()
			close(stop)
			wg.Wait()
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
			if viewer {
				b.ReportMetric(float64(snaps), "snapshots")
			}
		})
	}
}

// BenchmarkDashboardSnapshot measures one snapshot of a proxy that routed
// 4096 requests over 64 prefix groups (most of it under p.mu: the time a
// viewer can delay a decision).
func BenchmarkDashboardSnapshot(b *testing.B) {
	reps := []*fakeReplica{newFakeReplica(b, "r0"), newFakeReplica(b, "r1"), newFakeReplica(b, "r2"), newFakeReplica(b, "r3")}
	p, err := New(testConfig(reps...))
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	bt := p.cfg.BlockTokens
	for i := range 4096 {
		var keys []blocks.Key
		for j := range uint64(48) {
			keys = append(keys, blocks.Key(uint64(i%64)<<32|j+1))
		}
		keys = append(keys, blocks.Key(1<<63|uint64(i)))
		if _, err := p.route(policy.Request{ID: uint64(i + 1), Keys: keys, PromptTokens: len(keys) * bt, OutputTokens: 64}, nil); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if s := p.Snapshot(); len(s.Prefixes) == 0 {
			b.Fatal("no prefixes")
		}
	}
}
