package proxy

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/dashboard"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
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
	for _, r := range s.Replicas { // calibrating by default (TestDashboardSnapshotSpeed checks the figures)
		if r.Profile != cfg.Profile || !r.Calibrated || !(r.PrefillSPer1K > 0) || !(r.ProfileDecodeStepS > 0) {
			t.Errorf("%s: profile %q, calibrated %v, prefill %v s/1k, profile's decode step %v s", r.Name, r.Profile, r.Calibrated,
				r.PrefillSPer1K, r.ProfileDecodeStepS)
		}
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
	// The queue (on by default) let all four through at once.
	if q := s.Queue; q == nil || q.Passed != 4 || q.Waiting != 0 || q.Saturated || q.Queued != 0 || len(q.Shed) == 0 {
		t.Errorf("queue %+v, want 4 passed, none waiting, shed reasons listed", q)
	}
	cfg.Queue.On = false
	_, off := startProxy(t, cfg)
	if _, body := getState(t, off.URL+"/ui/state.json", "s3cret"); strings.Contains(string(body), `"queue"`) {
		t.Errorf("queue off: state.json has a queue: %s", body)
	}

	// A replica ejected shows down.
	p.checked(p.backendAt(1), false, true)
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

// TestDashboardSnapshotSpeed: each replica's speed in state.json is what
// the router prices it with. With calibration on, replica a serves
// requests whose llama.cpp timings say its prefill takes 3× and its decode
// steps 1.5× its profile's, and the snapshot shows the fit that learnt it
// beside the profile's figures; b serves none and shows its profile's
// figures, calibrated but with no samples. With calibration off, both show
// their profile's figures whatever a served.
func TestDashboardSnapshotSpeed(t *testing.T) {
	const prefillX, decodeX, n = 3.0, 1.5, 60
	for _, calibrated := range []bool{true, false} {
		t.Run(fmt.Sprintf("calibrate=%v", calibrated), func(t *testing.T) {
			cfg := testConfig(newFakeReplica(t, "a"), newFakeReplica(t, "b"))
			cfg.Calibrate = calibrated
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			prof := p.rt.Profile(0)
			profFit := calibrate.FitOf(prof)

			// Drive the router as the proxy would, on a clock of the test's
			// own: one request at a time, all on a (b is down meanwhile).
			var fitA calibrate.Fit
			func() {
				p.mu.Lock()
				defer p.mu.Unlock()
				now := time.Now()
				if err := p.rt.SetUp(1, false, now); err != nil {
					t.Fatal(err)
				}
				bt := p.cfg.BlockTokens
				for i := range n {
					prompt, out := 256*(1+i%8), 32+16*(i%3)
					keys := make([]blocks.Key, prompt/bt)
					for j := range keys {
						keys[j] = blocks.Key(uint64(i+1)<<32 | uint64(j+1))
					}
					d, err := p.rt.Route(policy.Request{ID: uint64(i + 1), Keys: keys, PromptTokens: prompt, OutputTokens: out}, now)
					if err != nil || d.Replica != 0 {
						t.Fatalf("route %d: replica %d, %v", i, d.Replica, err)
					}
					prefill := time.Duration(prefillX * float64(prof.Prefill(prompt, prompt)))
					step := decodeX * prof.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: prompt + out/2}).Seconds()
					decode := time.Duration(step * float64(out-1) * float64(time.Second))
					now = now.Add(prefill)
					if err := p.rt.FirstToken(uint64(i+1), now); err != nil {
						t.Fatal(err)
					}
					now = now.Add(decode)
					tm := &calibrate.Timings{PromptN: prompt, PromptMs: float64(prefill) / 1e6, PredictedN: out, PredictedMs: float64(decode) / 1e6}
					if err := p.rt.Finish(uint64(i+1), router.Finish{OutputTokens: out, CachedTokens: 0, OK: true, Timings: tm}, now); err != nil {
						t.Fatal(err)
					}
				}
				if err := p.rt.SetUp(1, true, now); err != nil {
					t.Fatal(err)
				}
				fitA, _, _ = p.rt.Calibration(0)
			}()

			w := httptest.NewRecorder()
			dashboard.Handler(p).ServeHTTP(w, httptest.NewRequest("GET", "/ui/state.json", nil))
			var s dashboard.Snapshot
			if err := json.Unmarshal(w.Body.Bytes(), &s); err != nil {
				t.Fatalf("state.json: %v\n%s", err, w.Body)
			}
			if len(s.Replicas) != 2 {
				t.Fatalf("replicas %+v", s.Replicas)
			}
			a, b := s.Replicas[0], s.Replicas[1]
			for _, r := range []dashboard.Replica{a, b} {
				if r.Profile != costmodel.Llama31_8BH100 || r.Calibrated != calibrated ||
					r.ProfilePrefillSPer1K != profFit.PrefillSecondsPer1K || r.ProfileDecodeStepS != profFit.DecodeStepSeconds ||
					!(r.ProfilePrefillSPer1K > 0) || !(r.ProfileDecodeStepS > 0) {
					t.Errorf("%s: profile %q calibrated %v, profile's prefill %v s/1k and decode step %v s, want %q %v %v %v",
						r.Name, r.Profile, r.Calibrated, r.ProfilePrefillSPer1K, r.ProfileDecodeStepS,
						costmodel.Llama31_8BH100, calibrated, profFit.PrefillSecondsPer1K, profFit.DecodeStepSeconds)
				}
			}
			// Without calibration neither learnt anything.
			if !calibrated {
				for _, r := range []dashboard.Replica{a, b} {
					if r.PrefillSPer1K != r.ProfilePrefillSPer1K || r.DecodeStepS != r.ProfileDecodeStepS ||
						r.PrefillError != 0 || r.DecodeError != 0 || r.CalibrationSamples != 0 {
						t.Errorf("%s learnt nothing, but shows %+v", r.Name, r)
					}
				}
				return
			}
			// b served nothing: it has no samples and prices as its pool
			// (the replicas told the same profile: a) has learnt.
			fitB, _, _ := p.rt.Calibration(1)
			if b.CalibrationSamples != 0 || b.PrefillError != 0 || b.DecodeError != 0 ||
				b.PrefillSPer1K != fitB.PrefillSecondsPer1K || b.DecodeStepS != fitB.DecodeStepSeconds ||
				b.PrefillSPer1K == b.ProfilePrefillSPer1K {
				t.Errorf("b learnt nothing itself and should price as its pool, but shows %+v (the router's %+v)", b, fitB)
			}
			if a.PrefillSPer1K != fitA.PrefillSecondsPer1K || a.DecodeStepS != fitA.DecodeStepSeconds ||
				a.PrefillError != fitA.PrefillError || a.DecodeError != fitA.DecodeError ||
				a.CalibrationSamples != fitA.PrefillSamples+fitA.DecodeSamples {
				t.Errorf("a shows %+v, the router's fit is %+v", a, fitA)
			}
			// Every request is one prefill and one decode observation.
			if a.CalibrationSamples != 2*n {
				t.Errorf("a: %d samples, want %d", a.CalibrationSamples, 2*n)
			}
			if got := a.PrefillSPer1K / a.ProfilePrefillSPer1K; math.Abs(got/prefillX-1) > 0.05 {
				t.Errorf("a: prefill %.4f s/1k, %.2f× its profile's, want %.1f×", a.PrefillSPer1K, got, prefillX)
			}
			if got := a.DecodeStepS / a.ProfileDecodeStepS; math.Abs(got/decodeX-1) > 0.05 {
				t.Errorf("a: decode step %.4f s, %.2f× its profile's, want %.1f×", a.DecodeStepS, got, decodeX)
			}
			// The errors started at the profile's (2/3 and 1/3) and fell
			// as the fit learnt.
			if !(a.PrefillError > 0 && a.PrefillError < 0.2) || !(a.DecodeError > 0 && a.DecodeError < 0.2) {
				t.Errorf("a: prefill error %v, decode error %v, want in (0, 0.2)", a.PrefillError, a.DecodeError)
			}
			t.Logf("a: prefill %.1f ms/1k (profile %.1f), decode %.2f ms (profile %.2f), errors %.3f %.3f, %d samples",
				1e3*a.PrefillSPer1K, 1e3*a.ProfilePrefillSPer1K, 1e3*a.DecodeStepS, 1e3*a.ProfileDecodeStepS,
				a.PrefillError, a.DecodeError, a.CalibrationSamples)
		})
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
				if _, _, _, err := p.route(req, nil); err != nil {
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
		if _, _, _, err := p.route(policy.Request{ID: uint64(i + 1), Keys: keys, PromptTokens: len(keys) * bt, OutputTokens: 64}, nil); err != nil {
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
