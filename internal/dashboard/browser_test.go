package dashboard

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"html"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The browser tests drive headless Chromium (Debian's chromium package) at
// the dashboard served by an httptest server. They skip when no Chromium is
// installed; PREFIXLB_CHROMIUM names another binary.
//
// -screenshots rewrites docs/dashboard.png (see docs/dashboard.md):
//
//	go test ./internal/dashboard -run Screenshot -screenshots
var screenshots = flag.Bool("screenshots", false, "write docs/dashboard.png from a scripted dashboard")

func chromiumPath(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("PREFIXLB_CHROMIUM"); p != "" {
		return p
	}
	for _, p := range []string{"/usr/bin/chromium", "/usr/bin/chromium-browser"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Skip("no Chromium (apt-get install chromium, or set PREFIXLB_CHROMIUM)")
	return ""
}

// runChromium loads url headless for budget of virtual time (timers and
// polls run at once; the clock advances only while nothing is pending) and
// returns its output: the DOM with --dump-dom, and the browser's log.
func runChromium(t *testing.T, url string, budget time.Duration, extra ...string) (stdout, log string) {
	t.Helper()
	bin := chromiumPath(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
		"--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
		"--user-data-dir=" + t.TempDir(), "--enable-logging=stderr", "--v=0",
		"--virtual-time-budget=" + strconv.Itoa(int(budget.Milliseconds()))}
	args = append(args, extra...)
	args = append(args, url)
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium: %v\n%s", err, errb.String())
	}
	return out.String(), errb.String()
}

// consoleErrors returns every console message of the page from Chromium's
// log (lines with "CONSOLE"): the dashboard writes none when all is well, so
// any message (console.error, an uncaught exception, a CSP refusal, a failed
// fetch) is an error.
func consoleErrors(log string) []string {
	var errs []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, ":CONSOLE") {
			errs = append(errs, line)
		}
	}
	return errs
}

// scriptedSource plays a scripted cluster: every call to Snapshot is one
// second later. Load rises on every call; from call downAt on, replica r1
// is down; from call replicateAt on, the hot prefix is replicated to r2.
type scriptedSource struct {
	mu                  sync.Mutex // guards calls
	calls               int
	downAt, replicateAt int
	replicas            int
}

func (s *scriptedSource) Calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

func (s *scriptedSource) Snapshot() Snapshot {
	s.mu.Lock()
	s.calls++
	n := s.calls
	s.mu.Unlock()
	t0 := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	now := t0.Add(time.Duration(n) * time.Second)
	snap := Snapshot{Time: now, Policy: "e2", RateWindowS: 10, Branches: map[string]float64{}}
	names := make([]string, s.replicas)
	for i := range names {
		names[i] = fmt.Sprintf("r%d", i)
	}
	for i, name := range names {
		r := Replica{Name: name, Up: true, InFlight: 10*n + i, Waiting: (n + i) % 4, Running: 8 + i,
			KVUsage: 0.3 + 0.05*float64(i) + 0.01*float64(n%10), HitRatio: 0.6 + 0.05*float64(i), LoadSeconds: 0.4 * float64(n+i),
			PendingPrefillS: 0.05 * float64(i+1), CachedBlocks: 20000 + 1000*i + 37*n,
			Kind: "vllm", PredictionErrorTokens: float64(16 * (i - 1))}
		// Calibrated on llama3.1-8b-h100: each replica slower than its
		// profile says, by its own factor, the fit settling as samples come.
		r.Profile, r.Calibrated = "llama3.1-8b-h100", true
		r.ProfilePrefillSPer1K, r.ProfileDecodeStepS = 0.0315, 0.00894
		r.PrefillSPer1K = r.ProfilePrefillSPer1K * (2.2 + 0.4*float64(i))
		r.DecodeStepS = r.ProfileDecodeStepS * (1.3 + 0.1*float64(i))
		r.PrefillError, r.DecodeError = 0.02+0.3/float64(n+2), 0.01+0.2/float64(n+2)
		r.CalibrationSamples = int64(14*n + 3*i)
		if i == s.replicas-1 { // a llama.cpp replica: a slot cache, mirrored from reports
			r.Kind, r.Slots, r.CachedBlocks = "llamacpp", 4, 96
			r.PredictionErrorTokens, r.CapacityTokens, r.Corrections = 310-float64(n%7)*20, 16384, n/3
			r.Profile, r.ProfilePrefillSPer1K, r.ProfileDecodeStepS = "llamacpp-tiny-cpu", 9.8, 0.071
			r.PrefillSPer1K, r.DecodeStepS = 12.4, 0.083
		}
		if i == 1 && n >= s.downAt {
			r.Up, r.InFlight = false, 0
		}
		snap.Replicas = append(snap.Replicas, r)
	}
	hot := Prefix{ID: "9f3a61c0d2b4e5f7", Tokens: 6144, Requests: 40 * n, RequestsPerS: 4 + float64(n)/2,
		Assigned: []string{"r0"}, CachedOn: []string{"r0"}}
	if n >= s.replicateAt && s.replicas > 2 {
		hot.Assigned = append(hot.Assigned, "r2")
		hot.CachedOn = append(hot.CachedOn, "r2")
	}
	snap.Prefixes = []Prefix{hot,
		{ID: "0c1d2e3f40516273", Tokens: 2048, Requests: 12, RequestsPerS: 1.2, Assigned: []string{"r1"}, CachedOn: []string{"r1", "r3"}},
		{ID: "77aa55cc33ee1100", Tokens: 1024, Requests: 6, RequestsPerS: 0.6, Assigned: []string{names[s.replicas-1]}, CachedOn: nil},
	}
	snap.Branches["exploit"] = 6 + float64(n%5)
	snap.Branches["explore"] = 2 + float64(n%3)
	if n >= s.replicateAt {
		snap.Branches["rebalance"] = 0.5
	}
	for _, v := range snap.Branches {
		snap.DecisionsPerS += v
	}
	snap.CachePrediction = CachePrediction{PredictedTokens: int64(n) * 41000, ReportedTokens: int64(n) * 40000,
		Checked: 9 * n, ExactRatio: 0.93}
	snap.Totals = Totals{Routed: 9 * n, Finished: 9*n - 30, InFlight: 30}
	for k := range 8 {
		snap.Recent = append(snap.Recent, Decision{Time: now.Add(-time.Duration(k) * 100 * time.Millisecond),
			Replica: names[k%s.replicas], Branch: "exploit", MatchedTokens: 6144, PromptTokens: 6400,
			Explain: fmt.Sprintf("branch=exploit; matched=6144; r0=0.%03d(L=0.1,M=0,P=0.02,m=6144); r1=0.9(L=0.3,M=0,P=0.6,m=0)", k)})
	}
	return snap
}

// TestBrowserDashboard loads the dashboard in headless Chromium for a few
// seconds of (virtual) time: no console error, every replica shown, the
// page updates by itself, shows the load rising, the replica that went
// down and the prefix that was replicated.
func TestBrowserDashboard(t *testing.T) {
	chromiumPath(t)
	src := &scriptedSource{downAt: 3, replicateAt: 4, replicas: 4}
	srv := httptest.NewServer(Handler(src))
	defer srv.Close()
	dom, log := runChromium(t, srv.URL+"/ui/", 8*time.Second, "--dump-dom")
	if errs := consoleErrors(log); len(errs) > 0 {
		t.Errorf("console errors:\n%s", strings.Join(errs, "\n"))
	}
	if !strings.Contains(dom, `<div id="errors" role="alert" hidden="">`) {
		t.Errorf("the page reported errors: %s", regexp.MustCompile(`(?s)<div id="errors".*?</div>`).FindString(dom))
	}
	m := regexp.MustCompile(`data-updates="(\d+)"`).FindStringSubmatch(dom)
	if m == nil {
		t.Fatalf("no update counter in the DOM:\n%s", dom)
	}
	updates, _ := strconv.Atoi(m[1])
	t.Logf("%d updates, %d polls", updates, src.Calls())
	if updates < 5 || src.Calls() < updates {
		t.Fatalf("%d updates for %d polls, want ≥ 5", updates, src.Calls())
	}
	for i := range 4 {
		if !strings.Contains(dom, fmt.Sprintf(`data-replica="r%d"`, i)) {
			t.Errorf("replica r%d not shown", i)
		}
	}
	if !strings.Contains(dom, `<tr class="down" data-replica="r1" data-up="false">`) {
		t.Errorf("r1 not shown down:\n%s", regexp.MustCompile(`(?s)<table id="replicas">.*?</table>`).FindString(dom))
	}
	// The in-flight figure of r0 is the last poll's (10 per poll), not the first's.
	row := regexp.MustCompile(`(?s)data-replica="r0".*?</tr>`).FindString(dom)
	want := fmt.Sprintf("</span>%d</td>", 10*updates)
	if !strings.Contains(row, want) {
		t.Errorf("r0 row does not show in-flight %d after %d updates: %s", 10*updates, updates, row)
	}
	for _, want := range []string{"replica r1 went down", "replicated to r2", `class="replicated" data-prefix="9f3a61c0d2b4e5f7"`,
		`<tr class="speed" data-speed="r0">`, `<tr class="speed down" data-speed="r1">`, "prefill 69.3 ms/1k (profile 31.5)",
		"decode 11.6 ms (profile 8.94)", "prefill 12.4 s/1k (profile 9.8)",
		`data-series="exploit"`, `data-series="rebalance"`, `data-series="predicted"`, "branch=exploit; matched=6144", "policy e2"} {
		if !strings.Contains(dom, want) {
			t.Errorf("DOM lacks %q", want)
		}
	}
}

// TestBrowserDashboardUnauthorized: when state.json refuses, the page says
// so instead of failing silently.
func TestBrowserDashboardUnauthorized(t *testing.T) {
	chromiumPath(t)
	h := Handler(&scriptedSource{downAt: 99, replicateAt: 99, replicas: 2})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "state.json") {
			w.WriteHeader(401)
			return
		}
		h.ServeHTTP(w, r)
	}))
	defer srv.Close()
	dom, _ := runChromium(t, srv.URL+"/ui/", 3*time.Second, "--dump-dom")
	if !strings.Contains(dom, `class="status err">state.json: HTTP 401`) {
		t.Errorf("status not shown: %s", regexp.MustCompile(`<span id="status"[^<]*</span>`).FindString(dom))
	}
}

// smallSource plays a quiet cluster of llama.cpp replicas with long names:
// in-flight counts of 0 and 1, a few tenths of a decision per second, a
// token or two of cache per second — the small ranges whose chart ticks
// once read "1, 1, 1, 0, 0" — and hot prefixes assigned to three replicas
// and cached on four, whose chips once overflowed their card.
type smallSource struct {
	mu    sync.Mutex // guards calls
	calls int
}

func (s *smallSource) Snapshot() Snapshot {
	s.mu.Lock()
	s.calls++
	n := s.calls
	s.mu.Unlock()
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC).Add(time.Duration(n) * time.Second)
	snap := Snapshot{Time: now, Policy: "e2", RateWindowS: 10,
		Branches: map[string]float64{"exploit": 0.1 + 0.05*float64(n%3), "explore": 0.1}}
	var names []string
	for i := range 4 {
		name := fmt.Sprintf("replica-%d", i)
		names = append(names, name)
		r := Replica{Name: name, Up: true, InFlight: (n + i) % 2, Running: (n + i) % 2,
			KVUsage: 0.01 * float64(i), HitRatio: 0.5, LoadSeconds: 0.01, CachedBlocks: 3 + i,
			Kind: "llamacpp", Slots: 2, PredictionErrorTokens: -12.4 + 40*float64(i), CapacityTokens: 8192, Corrections: n,
			Profile: "llamacpp-tiny-cpu", Calibrated: true, ProfilePrefillSPer1K: 9.8, ProfileDecodeStepS: 0.071}
		r.PrefillSPer1K, r.DecodeStepS = r.ProfilePrefillSPer1K, r.ProfileDecodeStepS
		switch i {
		case 0: // learnt: prefill in ms against a profile's in s
			r.PrefillSPer1K, r.DecodeStepS, r.PrefillError, r.DecodeError, r.CalibrationSamples = 0.942, 0.0134, 0.036, 0.017, 120
		case 1: // calibrating, nothing learnt yet
		case 2: // calibration off
			r.Calibrated = false
		case 3: // learnt, a long profile name (a YAML file) and one sample
			r.Profile = "/etc/prefixlb/profiles/llama-server-q4-k-m-ryzen-9-7950x-16-threads.yaml:time_scale=1.5"
			r.PrefillSPer1K, r.DecodeStepS, r.PrefillError, r.CalibrationSamples = 31.4, 0.212, 1.25, 1
		}
		snap.Replicas = append(snap.Replicas, r)
	}
	for k := range 6 {
		snap.Prefixes = append(snap.Prefixes, Prefix{ID: fmt.Sprintf("%016x", 0x9f3a61c0d2b4e5f7+uint64(k)), Tokens: 512,
			Requests: 3, RequestsPerS: 0.1, Assigned: names[:3], CachedOn: names})
	}
	snap.DecisionsPerS = snap.Branches["exploit"] + snap.Branches["explore"]
	snap.CachePrediction = CachePrediction{PredictedTokens: int64(n), ReportedTokens: int64(n), Checked: n, ExactRatio: 1}
	snap.Totals = Totals{Routed: n, Finished: n}
	return snap
}

// layoutHarness is a page of the test server's own (so without the
// dashboard's Content-Security-Policy) that shows the dashboard in a
// 1400 px frame and, once it has updated %d times, measures it from the
// same origin and writes what it found into #result as JSON: elements
// sticking out of their card, each chart's y tick labels, the text of
// replica-0's row, and each replica's speed line with the number of lines
// it takes.
const layoutHarness = `<!DOCTYPE html>
<html><body style="margin:0">
<iframe id="f" src="/ui/" style="width:1400px;height:1600px;border:0"></iframe>
<pre id="result"></pre>
<script>
const want = %d;
const f = document.getElementById("f");
function check() {
  const d = f.contentDocument, app = d && d.getElementById("app");
  if (!app || Number(app.dataset.updates) < want) { setTimeout(check, 100); return; }
  const res = { width: d.documentElement.clientWidth, overflow: [], ticks: {}, row: "", speed: {}, speedLines: {} };
  for (const card of d.querySelectorAll(".card")) {
    const c = card.getBoundingClientRect();
    const title = card.querySelector("h2").firstChild.textContent.trim();
    for (const e of card.querySelectorAll("*")) {
      const r = e.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) continue;
      if (r.right > c.right + 0.5 || r.left < c.left - 0.5) {
        const cls = typeof e.className === "string" && e.className ? " class=" + e.className : "";
        res.overflow.push(title + ": <" + e.tagName.toLowerCase() + cls + "> " + JSON.stringify((e.textContent || "").slice(0, 40)) +
          " spans x " + r.left.toFixed(0) + "–" + r.right.toFixed(0) + ", its card " + c.left.toFixed(0) + "–" + c.right.toFixed(0));
      }
    }
  }
  for (const s of d.querySelectorAll("svg.chart")) res.ticks[s.id] = [...s.querySelectorAll("text.ytick")].map((t) => t.textContent);
  const row = d.querySelector('tr[data-replica="replica-0"]');
  res.row = row ? row.textContent : "";
  for (const tr of d.querySelectorAll("tr.speed")) {
    const parts = [...tr.querySelectorAll(".part")];
    res.speed[tr.dataset.speed] = tr.textContent;
    res.speedLines[tr.dataset.speed] = new Set(parts.map((p) => Math.round(p.getBoundingClientRect().top))).size;
  }
  document.getElementById("result").textContent = JSON.stringify(res);
}
check();
</script>
</body></html>`

// TestBrowserLayout loads the dashboard of a quiet cluster at 1400 px wide
// and checks its layout from JavaScript: no element of any card (the
// hottest prefixes' chips and the replicas' speed lines above all) sticks
// out of its card, no chart has two adjacent tick labels that read the
// same, the replicas table shows each replica's kind, slots, prediction
// error and learned capacity, and each replica's speed line its fitted and
// profile figures in fitting units (calibrated, learning, or off), on one
// line unless its profile's name is long.
func TestBrowserLayout(t *testing.T) {
	chromiumPath(t)
	const updates = 6
	ui := Handler(&smallSource{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/harness" {
			w.Header().Set("Content-Type", "text/html; charset=utf-8")
			fmt.Fprintf(w, layoutHarness, updates)
			return
		}
		ui.ServeHTTP(w, r)
	}))
	defer srv.Close()
	dom, log := runChromium(t, srv.URL+"/harness", 20*time.Second, "--dump-dom", "--window-size=1400,1600")
	if errs := consoleErrors(log); len(errs) > 0 {
		t.Errorf("console errors:\n%s", strings.Join(errs, "\n"))
	}
	m := regexp.MustCompile(`(?s)<pre id="result">(.*?)</pre>`).FindStringSubmatch(dom)
	if m == nil || m[1] == "" {
		t.Fatalf("the harness measured nothing (fewer than %d updates?):\n%s", updates, dom)
	}
	var res struct {
		Width      int                 `json:"width"`
		Overflow   []string            `json:"overflow"`
		Ticks      map[string][]string `json:"ticks"`
		Row        string              `json:"row"`
		Speed      map[string]string   `json:"speed"`
		SpeedLines map[string]int      `json:"speedLines"`
	}
	if err := json.Unmarshal([]byte(html.UnescapeString(m[1])), &res); err != nil {
		t.Fatalf("harness result: %v\n%s", err, m[1])
	}
	if res.Width != 1400 {
		t.Errorf("dashboard laid out %d px wide, want 1400", res.Width)
	}
	if n := len(res.Overflow); n > 0 {
		t.Errorf("%d elements stick out of their card at 1400 px, first ones:\n%s", n, strings.Join(res.Overflow[:min(n, 8)], "\n"))
	}
	for _, id := range []string{"chart-inflight", "chart-branches", "chart-cache", "chart-hit"} {
		ticks := res.Ticks[id]
		if len(ticks) < 2 {
			t.Errorf("%s: ticks %q, want at least 2", id, ticks)
		}
		for i := 1; i < len(ticks); i++ {
			if ticks[i] == ticks[i-1] {
				t.Errorf("%s: ticks %q repeat %q", id, ticks, ticks[i])
				break
			}
		}
	}
	t.Logf("ticks %v", res.Ticks)
	for _, want := range []string{"llamacpp · 2 slots", "−12", "8192"} {
		if !strings.Contains(res.Row, want) {
			t.Errorf("replica-0's row %q lacks %q", res.Row, want)
		}
	}
	t.Logf("speed lines %q, lines %v", res.Speed, res.SpeedLines)
	for _, tc := range []struct {
		replica string
		want    []string
		lines   int // at most
	}{
		{"replica-0", []string{"speed prefill 942 ms/1k (profile 9.8 s) · decode 13.4 ms (profile 71) · fit error 4% · 120 samples · profile llamacpp-tiny-cpu"}, 1},
		{"replica-1", []string{"prefill 9.8 s/1k · decode 71 ms · learning: no samples yet · profile llamacpp-tiny-cpu"}, 1},
		{"replica-2", []string{"prefill 9.8 s/1k · decode 71 ms · profile only: llamacpp-tiny-cpu"}, 1},
		{"replica-3", []string{"prefill 31.4 s/1k (profile 9.8)", "decode 212 ms (profile 71)", "fit error 125% · 1 sample · profile /etc/"}, 2},
	} {
		got, ok := res.Speed[tc.replica]
		if !ok {
			t.Errorf("%s: no speed line", tc.replica)
			continue
		}
		for _, want := range tc.want {
			if !strings.Contains(got, want) {
				t.Errorf("%s: speed line %q lacks %q", tc.replica, got, want)
			}
		}
		if n := res.SpeedLines[tc.replica]; n < 1 || n > tc.lines {
			t.Errorf("%s: speed line on %d lines, want 1–%d", tc.replica, n, tc.lines)
		}
	}
	if strings.Contains(res.Speed["replica-1"], "(profile") || strings.Contains(res.Speed["replica-2"], "(profile") {
		t.Errorf("unlearnt replicas show the profile's figures twice: %q", res.Speed)
	}
}

// TestScreenshotDashboard writes docs/dashboard.png with -screenshots.
func TestScreenshotDashboard(t *testing.T) {
	if !*screenshots {
		t.Skip("-screenshots not set")
	}
	chromiumPath(t)
	src := &scriptedSource{downAt: 40, replicateAt: 30, replicas: 4}
	srv := httptest.NewServer(Handler(src))
	defer srv.Close()
	out, err := filepath.Abs("../../docs/dashboard.png")
	if err != nil {
		t.Fatal(err)
	}
	_, log := runChromium(t, srv.URL+"/ui/", 45*time.Second, "--hide-scrollbars", "--window-size=1400,1500", "--screenshot="+out)
	if _, err := os.Stat(out); err != nil {
		t.Fatalf("no screenshot: %v\n%s", err, log)
	}
	t.Logf("wrote %s", out)
}
