package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/engine/enginetest"
	"github.com/prefixlb/prefixlb/internal/promtest"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
)

// This file checks calibration (internal/calibrate) through prefixlb
// serve's front door: real modelled replicas (internal/engine) on loopback
// of two GPU generations, the proxy told one profile for both, streamed
// completions over real HTTP and SSE, and what the router learnt read back
// from GET /debug/replicas and /metrics.

// calScale is the engines' time scale in the calibration tests: every
// modelled duration runs this many times faster, so a router sees each
// engine's profile with its times divided by calScale (wallSpec). Slow
// enough that a prefill and a decode step (7 ms of real time on
// llama3.1-8b-h100) dwarf what the path adds to them — the loopback, the
// timers' slack of up to a millisecond per engine iteration, JSON under the
// race detector on two busy cores — and the test takes about 2 s.
const calScale = 1.25

// startProfiledEngine runs one modelled replica of profile spec at time
// scale scale on loopback until the test ends, named name.
func startProfiledEngine(t *testing.T, name, spec string, scale float64) Backend {
	t.Helper()
	prof := enginetest.Profile(t, spec)
	b := startEngines(t, 1, func(c *engine.Config) {
		c.Replica.Profile = prof
		c.TimeScale = scale
	})[0]
	b.Name = name
	return b
}

// calTokens is request k's prompt length: 768 to 1279 tokens, spread so
// that the fit sees prefills around its 1,000-token reference point.
func calTokens(k int) int { return 768 + (k*197)%512 }

// debugReplicas reads GET /debug/replicas, by replica name.
func debugReplicas(t *testing.T, client *http.Client, url string) map[string]ReplicaStatus {
	t.Helper()
	resp, err := client.Get(url + "/debug/replicas")
	if err != nil {
		t.Fatalf("GET /debug/replicas: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /debug/replicas: status %d", resp.StatusCode)
	}
	var body struct {
		Replicas []ReplicaStatus `json:"replicas"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("GET /debug/replicas: %v", err)
	}
	out := make(map[string]ReplicaStatus, len(body.Replicas))
	for _, r := range body.Replicas {
		out[r.Name] = r
	}
	return out
}

// settled polls GET /debug/replicas until no request is in flight (a
// client sees a stream's end before the proxy records it), for up to 5s,
// and returns the last answer.
func settled(t *testing.T, client *http.Client, url string) map[string]ReplicaStatus {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		reps := debugReplicas(t, client, url)
		busy := 0
		for _, r := range reps {
			busy += r.InFlight
		}
		if busy == 0 {
			return reps
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests still in flight 5s after the last response", busy)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// relDiff is |a/b − 1|.
func relDiff(a, b float64) float64 { return math.Abs(a/b - 1) }

// calProxy starts a proxy over backends with round-robin (each replica
// gets the same traffic, whatever it has learnt), told profile told.
func calProxy(t *testing.T, backends []Backend, told string, calibrate bool) (*Proxy, string, *http.Client) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.Policy = "round-robin"
	cfg.Profile = told
	cfg.Calibrate = calibrate
	cfg.BackendKind = upstream.VLLM
	cfg.HealthInterval = time.Hour // the engines are up; no checks needed
	cfg.ScrapeInterval = 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, srv := startProxy(t, cfg)
	return p, srv.URL, srv.Client()
}

// calStreamed is what a client saw of one streamed completion.
type calStreamed struct {
	replica string
	ttft    time.Duration   // from sending the request to the first token
	gaps    []time.Duration // between consecutive tokens
	err     error
}

// calStream posts body (a streamed completion) to the proxy and reads the
// stream to its end, timing its tokens as they arrive.
func calStream(ctx context.Context, client *http.Client, url, body string, maxTokens int) calStreamed {
	var res calStreamed
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	res.replica = resp.Header.Get(HeaderReplica)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		res.err = fmt.Errorf("status %d: %s", resp.StatusCode, msg)
		return res
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	tokens, last, done := 0, start, false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var c chunkInfo
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			res.err = fmt.Errorf("event %q: %v", data, err)
			return res
		}
		if len(c.Choices) == 0 || c.Choices[0].Text == nil || *c.Choices[0].Text == "" {
			continue
		}
		now := time.Now()
		if tokens == 0 {
			res.ttft = now.Sub(start)
		} else {
			res.gaps = append(res.gaps, now.Sub(last))
		}
		tokens, last = tokens+1, now
	}
	switch {
	case !done:
		res.err = fmt.Errorf("stream ended before [DONE]: %v", sc.Err())
	case tokens != maxTokens:
		res.err = fmt.Errorf("%d tokens streamed, want %d", tokens, maxTokens)
	}
	return res
}

// median returns the median of ds (0 for none).
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestCalibrationMixedCluster runs an H100 and an A100 replica (modelled,
// package engine) behind the proxy told llama3.1-8b-h100 for both, and
// checks that streamed traffic teaches the router each replica's own
// prefill and decode speed: the A100's fitted figures come out well above
// the H100's and nearer its true profile than the told one is, each
// replica's agree with the first-token times and token gaps a client
// measures, and /metrics says what /debug/replicas says.
func TestCalibrationMixedCluster(t *testing.T) {
	const (
		sequential = 8 // requests one at a time
		bursts     = 4 // then bursts of burstSize at once
		burstSize  = 4
		maxTokens  = 8 // 7 gaps between streamed tokens: decode is observed
	)
	begin := time.Now()
	fastSpec, slowSpec := costmodel.Llama31_8BH100, costmodel.Llama31_8BA100
	backends := []Backend{
		startProfiledEngine(t, "h100", fastSpec, calScale),
		startProfiledEngine(t, "a100", slowSpec, calScale),
	}
	toldSpec := enginetest.WallSpec(costmodel.Llama31_8BH100, calScale)
	_, url, client := calProxy(t, backends, toldSpec, true)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// What the client sees of each replica, one request at a time: its
	// first-token times (~1,000-token prompts) and token gaps.
	ttfts := map[string][]time.Duration{}
	gaps := map[string][]time.Duration{}
	k := 0
	for range sequential {
		k++
		r := calStream(ctx, client, url, enginetest.UniquePrompt(k, calTokens(k), maxTokens, true), maxTokens)
		if r.err != nil {
			t.Fatalf("request %d: %v", k, r.err)
		}
		ttfts[r.replica] = append(ttfts[r.replica], r.ttft)
		gaps[r.replica] = append(gaps[r.replica], r.gaps...)
	}
	enginetest.Bursts(t, k, bursts, burstSize, func(k int) error {
		return calStream(ctx, client, url, enginetest.UniquePrompt(k, calTokens(k), maxTokens, true), maxTokens).err
	})
	reps := settled(t, client, url)

	truth := map[string]calibrate.Fit{
		"h100": calibrate.FitOf(enginetest.Profile(t, enginetest.WallSpec(fastSpec, calScale))),
		"a100": calibrate.FitOf(enginetest.Profile(t, enginetest.WallSpec(slowSpec, calScale))),
	}
	told := calibrate.FitOf(enginetest.Profile(t, toldSpec))
	for _, name := range []string{"h100", "a100"} {
		r, ok := reps[name]
		if !ok {
			t.Fatalf("/debug/replicas has no %s: %v", name, reps)
		}
		sp, tr := r.Speed, truth[name]
		seenTTFT, seenGap := median(ttfts[name]).Seconds(), median(gaps[name]).Seconds()
		t.Logf("%s: prefill/1k %.2f ms (true %.2f, told %.2f, client's TTFT %.2f; %d samples), decode step %.3f ms (true %.3f, told %.3f, client's gap %.3f; %d samples); stats %+v",
			name, 1e3*sp.PrefillSecondsPer1K, 1e3*tr.PrefillSecondsPer1K, 1e3*sp.PriorPrefillSecondsPer1K, 1e3*seenTTFT, sp.PrefillSamples,
			1e3*sp.DecodeStepSeconds, 1e3*tr.DecodeStepSeconds, 1e3*sp.PriorDecodeStepSeconds, 1e3*seenGap, sp.DecodeSamples, r.Learnt)
		if !r.Calibrated || r.Learnt == nil {
			t.Fatalf("%s: calibrated %v, calibration %v; want calibrated with its observations", name, r.Calibrated, r.Learnt)
		}
		if r.Profile != toldSpec {
			t.Errorf("%s: profile %q, want the told %q", name, r.Profile, toldSpec)
		}
		if sp.PriorPrefillSecondsPer1K != told.PrefillSecondsPer1K || sp.PriorDecodeStepSeconds != told.DecodeStepSeconds {
			t.Errorf("%s: profile figures %v, %v; want the told profile's %v, %v", name,
				sp.PriorPrefillSecondsPer1K, sp.PriorDecodeStepSeconds, told.PrefillSecondsPer1K, told.DecodeStepSeconds)
		}
		if st := r.Learnt; st.PrefillPeriods < 3 || st.DecodeITL < 3 || sp.PrefillSamples != st.PrefillPeriods+st.PrefillTimings ||
			sp.DecodeSamples != st.DecodeITL+st.DecodeTimings+st.DecodeRequests {
			t.Errorf("%s: %d prefill and %d decode samples from %+v; want ≥ 3 of each, from busy periods and token gaps",
				name, sp.PrefillSamples, sp.DecodeSamples, *st)
		}
		// What the router learnt is what the replica does, as a client
		// sees it. (The engine's iterations run a little longer than its
		// profile says, by the timers' slack: up to a millisecond each.)
		// A prefill is observed from routing to the first token, inside
		// the client's TTFT, which adds the proxy's parsing and keying of
		// the body: the fit is at most a little above it (prompts of
		// 768–1,279 tokens against the fit's 1,000) and may be well below.
		if r := sp.PrefillSecondsPer1K / seenTTFT; r < 0.6 || r > 1.15 {
			t.Errorf("%s: fitted prefill %.2f ms is %.2f× the client's median TTFT %.2f ms (~1,000-token prompts); want 0.6–1.15×",
				name, 1e3*sp.PrefillSecondsPer1K, r, 1e3*seenTTFT)
		}
		if e := relDiff(sp.DecodeStepSeconds, seenGap); e > 0.25 {
			t.Errorf("%s: fitted decode step %.3f ms is %.0f%% off the client's median token gap %.3f ms; want within 25%%",
				name, 1e3*sp.DecodeStepSeconds, 100*e, 1e3*seenGap)
		}
	}
	fast, slow := reps["h100"].Speed, reps["a100"].Speed
	// The A100 is 3.1× slower at prefill, 1.5× at a decode step.
	// (Both are also measured with the path's own overhead, a few ms
	// under the race detector: the margins leave room for it.)
	if fast.PrefillSecondsPer1K*1.5 > slow.PrefillSecondsPer1K {
		t.Errorf("fitted prefill: a100 %.2f ms, h100 %.2f ms; want the a100's over 1.5× the h100's",
			1e3*slow.PrefillSecondsPer1K, 1e3*fast.PrefillSecondsPer1K)
	}
	if fast.DecodeStepSeconds*1.2 > slow.DecodeStepSeconds {
		t.Errorf("fitted decode step: a100 %.3f ms, h100 %.3f ms; want the a100's over 1.2× the h100's",
			1e3*slow.DecodeStepSeconds, 1e3*fast.DecodeStepSeconds)
	}
	// The A100's figures come nearer its true profile than the told one.
	// (The H100 was told the truth; the check above holds it to it.)
	tr := truth["a100"]
	if d, dt := math.Abs(slow.PrefillSecondsPer1K-tr.PrefillSecondsPer1K), math.Abs(told.PrefillSecondsPer1K-tr.PrefillSecondsPer1K); d >= dt {
		t.Errorf("a100: fitted prefill %.2f ms is %.2f ms off the true %.2f ms, no nearer than the told profile (%.2f ms off)",
			1e3*slow.PrefillSecondsPer1K, 1e3*d, 1e3*tr.PrefillSecondsPer1K, 1e3*dt)
	}
	if d, dt := math.Abs(slow.DecodeStepSeconds-tr.DecodeStepSeconds), math.Abs(told.DecodeStepSeconds-tr.DecodeStepSeconds); d >= dt {
		t.Errorf("a100: fitted decode step %.3f ms is %.3f ms off the true %.3f ms, no nearer than the told profile (%.3f ms off)",
			1e3*slow.DecodeStepSeconds, 1e3*d, 1e3*tr.DecodeStepSeconds, 1e3*dt)
	}

	fams := promtest.Scrape(t, client, url+"/metrics")
	for name, r := range reps {
		promtest.CheckPricing(t, fams, name, r.Pricing)
	}
	t.Logf("%d requests in %v", k, time.Since(begin).Round(time.Millisecond))
}

// TestCalibrationOff: with Config.Calibrate false (--calibrate=false) the
// router prices every replica with its configured profile — the config's,
// or the backend's own — learns nothing from the traffic, and says so in
// GET /debug/replicas and /metrics (the speed gauges are the profile's; no
// error or observation series).
func TestCalibrationOff(t *testing.T) {
	const maxTokens = 8
	backends := startEngines(t, 2) // llama3.1-8b-h100, 100× real time
	backends[1].Profile = costmodel.Llama31_8BA100
	_, url, client := calProxy(t, backends, costmodel.Llama31_8BH100, false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for k := range 6 {
		if r := calStream(ctx, client, url, enginetest.UniquePrompt(k, calTokens(k), maxTokens, true), maxTokens); r.err != nil {
			t.Fatalf("request %d: %v", k, r.err)
		}
	}
	reps := settled(t, client, url)
	want := map[string]string{backends[0].Name: costmodel.Llama31_8BH100, backends[1].Name: costmodel.Llama31_8BA100}
	for name, spec := range want {
		r, ok := reps[name]
		if !ok {
			t.Fatalf("/debug/replicas has no %s: %v", name, reps)
		}
		if r.Calibrated || r.Learnt != nil {
			t.Errorf("%s: calibrated %v, calibration %+v; want false and none", name, r.Calibrated, r.Learnt)
		}
		if r.Profile != spec {
			t.Errorf("%s: profile %q, want %q", name, r.Profile, spec)
		}
		if fit := calibrate.FitOf(enginetest.Profile(t, spec)); r.Speed != fit {
			t.Errorf("%s: speed %+v, want the profile's own figures %+v", name, r.Speed, fit)
		}
	}
	fams := promtest.Scrape(t, client, url+"/metrics")
	for name, r := range reps {
		promtest.CheckPricing(t, fams, name, r.Pricing)
	}
	for _, name := range []string{"prefixlb_replica_calibration_error_ratio", "prefixlb_replica_calibration_profile_error_ratio",
		"prefixlb_replica_calibration_observations_total", "prefixlb_replica_calibration_skipped_total"} {
		if f := fams[name]; len(f.GetMetric()) > 0 {
			t.Errorf("/metrics has %d %s series without calibration, want none", len(f.GetMetric()), name)
		}
	}
}

// TestCalibrationNonStreamedSkipped: a non-streamed completion shows the
// router no first token, so its prefill cannot be told from its decode:
// each is counted in prefixlb_replica_calibration_skipped_total with reason
// no_first_token, and the fit stays at the profile.
func TestCalibrationNonStreamedSkipped(t *testing.T) {
	const n = 5
	backends := startEngines(t, 1)
	_, url, client := calProxy(t, backends, costmodel.Llama31_8BH100, true)
	for k := range n {
		resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(enginetest.UniquePrompt(k, calTokens(k), 8, false)))
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d, %v: %s", k, resp.StatusCode, err, body)
		}
	}
	name := backends[0].Name
	r := settled(t, client, url)[name]
	if !r.Calibrated || r.Learnt == nil {
		t.Fatalf("%s: calibrated %v, calibration %v; want calibrated", name, r.Calibrated, r.Learnt)
	}
	if got := r.Learnt.Skipped[calibrate.SkipNoFirstToken]; got != n {
		t.Errorf("%s: skipped %v, want %s: %d", name, r.Learnt.Skipped, calibrate.SkipNoFirstToken, n)
	}
	if r.Speed.PrefillSamples != 0 || r.Speed.DecodeSamples != 0 ||
		r.Speed.PrefillSecondsPer1K != r.Speed.PriorPrefillSecondsPer1K || r.Speed.DecodeStepSeconds != r.Speed.PriorDecodeStepSeconds {
		t.Errorf("%s: speed %+v after non-streamed requests only; want no samples and the profile's figures", name, r.Speed)
	}
	fams := promtest.Scrape(t, client, url+"/metrics")
	if v, ok := promtest.Series(fams, "prefixlb_replica_calibration_skipped_total", "replica", name, "reason", calibrate.SkipNoFirstToken); !ok || v != n {
		t.Errorf("prefixlb_replica_calibration_skipped_total{replica=%q,reason=%q} = %v (present %v), want %d",
			name, calibrate.SkipNoFirstToken, v, ok, n)
	}
	promtest.CheckPricing(t, fams, name, r.Pricing)
}

// TestParseConfigCalibration: the YAML keys calibrate, calibration and a
// backend's profile, and the errors that name a bad one.
func TestParseConfigCalibration(t *testing.T) {
	def := calibrate.DefaultConfig()
	forget := def
	forget.Forget = 0.99
	for _, tc := range []struct {
		name, yaml    string
		wantCalibrate bool
		wantCal       calibrate.Config
		wantProfiles  []string // backends' profiles
		parseErr      []string // ParseConfig's error names these ("" none)
		validateErr   []string // Validate's
		newErr        []string // New's
	}{
		{name: "defaults", yaml: "policy: e2\n", wantCalibrate: true, wantCal: def},
		{name: "off", yaml: "calibrate: false\n", wantCal: def},
		{name: "on", yaml: "calibrate: true\n", wantCalibrate: true, wantCal: def},
		{name: "tuned", yaml: "calibration:\n  forget: 0.99\n", wantCalibrate: true, wantCal: forget},
		{name: "empty block", yaml: "calibration:\n", wantCalibrate: true, wantCal: def},
		{name: "unknown key", yaml: "calibration:\n  forgett: 0.99\n", parseErr: []string{"calibration", `"forgett"`}},
		{name: "not a map", yaml: "calibration: 3\n", parseErr: []string{"calibration"}},
		{name: "bad forget", yaml: "calibration:\n  forget: 2\n", wantCalibrate: true,
			wantCal: calibrate.Config{}, validateErr: []string{"calibration", "forget", "got 2"}},
		{name: "bad min_decode_tokens", yaml: "calibration:\n  min_decode_tokens: 0\n", wantCalibrate: true,
			validateErr: []string{"calibration", "min_decode_tokens"}},
		{name: "backend profiles", yaml: "backends:\n  - url: http://127.0.0.1:1\n  - url: http://127.0.0.1:2\n    profile: llama3.1-8b-a100:time_scale=2\n",
			wantCalibrate: true, wantCal: def, wantProfiles: []string{"", "llama3.1-8b-a100:time_scale=2"}},
		{name: "bad backend profile", yaml: "backends:\n  - url: http://127.0.0.1:1\n  - url: http://127.0.0.1:2\n    profile: llama3.1-8b-z100\n",
			wantCalibrate: true, wantCal: def, wantProfiles: []string{"", "llama3.1-8b-z100"},
			newErr: []string{"backends[1].profile", "llama3.1-8b-z100"}},
		{name: "bad backend profile setting", yaml: "backends:\n  - url: http://127.0.0.1:1\n    profile: llama3.1-8b-h100:tme_scale=2\n",
			wantCalibrate: true, wantCal: def, wantProfiles: []string{"llama3.1-8b-h100:tme_scale=2"},
			newErr: []string{"backends[0].profile", "tme_scale"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := DefaultConfig()
			base.Backends = []Backend{{URL: "http://127.0.0.1:1"}}
			base.Logger = slog.New(slog.DiscardHandler)
			c, err := ParseConfig([]byte(tc.yaml), base)
			if !errorNames(t, "ParseConfig", err, tc.parseErr) {
				return
			}
			if c.Calibrate != tc.wantCalibrate {
				t.Errorf("calibrate = %v, want %v", c.Calibrate, tc.wantCalibrate)
			}
			if tc.wantCal != (calibrate.Config{}) && c.Calibration != tc.wantCal {
				t.Errorf("calibration = %+v, want %+v", c.Calibration, tc.wantCal)
			}
			if tc.wantProfiles != nil {
				var got []string
				for _, b := range c.Backends {
					got = append(got, b.Profile)
				}
				if !slices.Equal(got, tc.wantProfiles) {
					t.Errorf("backends' profiles %q, want %q", got, tc.wantProfiles)
				}
			}
			if !errorNames(t, "Validate", c.Validate(), tc.validateErr) {
				return
			}
			p, err := New(c)
			if p != nil {
				p.Close()
			}
			errorNames(t, "New", err, tc.newErr)
		})
	}
}

// errorNames checks that err is nil when want is empty, else an error whose
// message contains each of want; it reports whether err was nil.
func errorNames(t *testing.T, op string, err error, want []string) bool {
	t.Helper()
	switch {
	case len(want) == 0 && err != nil:
		t.Errorf("%s: %v, want no error", op, err)
	case len(want) > 0 && err == nil:
		t.Errorf("%s: no error, want one naming %q", op, want)
	case err != nil:
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not name %q", op, err, w)
			}
		}
	}
	return err == nil
}
