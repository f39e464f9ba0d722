package dashboard

import (
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// fixedSource returns the same snapshot every time.
type fixedSource struct{ s Snapshot }

func (f fixedSource) Snapshot() Snapshot { return f.s }

func sampleSnapshot() Snapshot {
	at := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	return Snapshot{
		Time:   at,
		Policy: "e2",
		Replicas: []Replica{
			{Name: "r0", Up: true, InFlight: 3, Waiting: 1, Running: 2, KVUsage: 0.5, HitRatio: 0.75, LoadSeconds: 1.5, PendingPrefillS: 0.25, CachedBlocks: 100,
				Kind: "llamacpp", Slots: 2, PredictionErrorTokens: 96.5, CapacityTokens: 16384, Corrections: 4,
				Profile: "llamacpp-tiny-cpu", Calibrated: true, PrefillSPer1K: 2.5, ProfilePrefillSPer1K: 1.75, DecodeStepS: 0.0625,
				ProfileDecodeStepS: 0.05, PrefillError: 0.125, DecodeError: 0.0625, CalibrationSamples: 120},
			{Name: "r1", Up: false, Waiting: -1, Running: -1, KVUsage: -1, Kind: "vllm",
				Profile: "llama3.1-8b-h100", PrefillSPer1K: 0.03125, ProfilePrefillSPer1K: 0.03125, DecodeStepS: 0.0078125, ProfileDecodeStepS: 0.0078125},
		},
		Prefixes:        []Prefix{{ID: "00000000000000ff", Tokens: 4096, Requests: 12, RequestsPerS: 0.4, Assigned: []string{"r0", "r1"}, CachedOn: []string{"r0"}}},
		Branches:        map[string]float64{"exploit": 2, "explore": 0.5},
		DecisionsPerS:   2.5,
		RateWindowS:     10,
		CachePrediction: CachePrediction{PredictedTokens: 1000, ReportedTokens: 900, Checked: 10, ExactRatio: 0.9},
		Totals:          Totals{Routed: 20, Finished: 17, InFlight: 3},
		Recent:          []Decision{{Time: at, Replica: "r0", Branch: "exploit", MatchedTokens: 4096, PromptTokens: 4200, Explain: "branch=exploit; matched=4096"}},
		Queue: &Queue{Saturated: true, Waiting: 3, MinWaitS: 2.5, Flows: []QueueFlow{{Priority: 1, Tenant: "a", Waiting: 3, OldestWaitS: 0.75}},
			Passed: 10, Queued: 5, Dispatched: 2, Shed: map[string]int64{"deadline": 1, "timeout": 0}},
	}
}

func get(t *testing.T, h http.Handler, path string) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
	return w
}

// TestStateJSONSchema pins the documented field names and types of
// state.json (docs/dashboard.md): scripts depend on them.
func TestStateJSONSchema(t *testing.T) {
	w := get(t, Handler(fixedSource{sampleSnapshot()}), "/ui/state.json")
	if w.Code != 200 || w.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("state.json: %d %q", w.Code, w.Header().Get("Content-Type"))
	}
	var doc map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	type want map[string]string // field -> JSON type
	check := func(where string, obj any, fields want) {
		t.Helper()
		m, ok := obj.(map[string]any)
		if !ok {
			t.Fatalf("%s: not an object: %v", where, obj)
		}
		for f, typ := range fields {
			v, ok := m[f]
			if !ok {
				t.Errorf("%s: missing %q", where, f)
				continue
			}
			got := "null"
			switch v.(type) {
			case string:
				got = "string"
			case float64:
				got = "number"
			case bool:
				got = "bool"
			case []any:
				got = "array"
			case map[string]any:
				got = "object"
			}
			if got != typ {
				t.Errorf("%s.%s: %s, want %s", where, f, got, typ)
			}
		}
		if len(m) != len(fields) {
			var extra []string
			for f := range m {
				if _, ok := fields[f]; !ok {
					extra = append(extra, f)
				}
			}
			t.Errorf("%s: undocumented fields %v (document them and add them here)", where, extra)
		}
	}
	check("snapshot", doc, want{"time": "string", "policy": "string", "replicas": "array", "prefixes": "array",
		"branches": "object", "decisions_per_s": "number", "rate_window_s": "number", "cache_prediction": "object",
		"totals": "object", "recent": "array", "queue": "object"})
	check("queue", doc["queue"], want{"saturated": "bool", "waiting": "number", "min_wait_s": "number", "flows": "array",
		"passed": "number", "queued": "number", "dispatched": "number", "cancelled": "number", "shed": "object"})
	check("queue.flows[0]", doc["queue"].(map[string]any)["flows"].([]any)[0], want{"priority": "number", "tenant": "string",
		"waiting": "number", "oldest_wait_s": "number"})
	check("replicas[0]", doc["replicas"].([]any)[0], want{"name": "string", "up": "bool", "in_flight": "number",
		"waiting": "number", "running": "number", "kv_usage": "number", "hit_ratio": "number", "load_seconds": "number",
		"pending_prefill_s": "number", "cached_blocks": "number", "kind": "string", "slots": "number",
		"role": "string", "transfers": "number", "prediction_error_tokens": "number", "capacity_tokens": "number", "corrections": "number",
		"profile": "string", "calibrated": "bool", "prefill_s_per_1k": "number", "profile_prefill_s_per_1k": "number",
		"decode_step_s": "number", "profile_decode_step_s": "number", "prefill_error": "number", "decode_error": "number",
		"calibration_samples": "number"})
	check("prefixes[0]", doc["prefixes"].([]any)[0], want{"id": "string", "tokens": "number", "requests": "number",
		"requests_per_s": "number", "assigned": "array", "cached_on": "array"})
	check("cache_prediction", doc["cache_prediction"], want{"predicted_tokens": "number", "reported_tokens": "number",
		"checked": "number", "exact_ratio": "number"})
	check("totals", doc["totals"], want{"routed": "number", "finished": "number", "failed": "number", "in_flight": "number"})
	check("recent[0]", doc["recent"].([]any)[0], want{"time": "string", "replica": "string", "branch": "string",
		"matched_tokens": "number", "prompt_tokens": "number", "explain": "string"})
	if b := doc["branches"].(map[string]any); b["exploit"] != 2.0 || b["explore"] != 0.5 {
		t.Errorf("branches %v", b)
	}

	// Round trip: the Go type decodes what it encodes.
	var back Snapshot
	if err := json.Unmarshal(w.Body.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if want := sampleSnapshot(); !back.Time.Equal(want.Time) || back.Replicas[0] != want.Replicas[0] || back.Replicas[1] != want.Replicas[1] ||
		!slices.Equal(back.Prefixes[0].Assigned, want.Prefixes[0].Assigned) || back.CachePrediction != want.CachePrediction {
		t.Errorf("round trip: %+v", back)
	}
}

// TestStateJSONEmpty: an empty snapshot has [] and {} rather than null, and
// non-finite numbers never break the encoding.
func TestStateJSONEmpty(t *testing.T) {
	s := Snapshot{Replicas: []Replica{{Name: "r", HitRatio: math.NaN(), KVUsage: math.Inf(1), LoadSeconds: math.NaN(), PredictionErrorTokens: math.Inf(-1),
		PrefillSPer1K: math.Inf(1), DecodeStepS: math.NaN(), PrefillError: math.NaN()}},
		Prefixes: []Prefix{{ID: "x"}}, Branches: map[string]float64{"explore": math.Inf(1)}}
	w := get(t, Handler(fixedSource{s}), "/ui/state.json")
	if w.Code != 200 {
		t.Fatalf("state.json: %d %s", w.Code, w.Body)
	}
	body := w.Body.String()
	for _, want := range []string{`"recent":[]`, `"assigned":[]`, `"cached_on":[]`, `"hit_ratio":0`, `"explore":0`,
		`"prediction_error_tokens":0`, `"kind":"unknown"`, `"prefill_s_per_1k":0`, `"decode_step_s":0`, `"prefill_error":0`,
		`"profile":""`, `"calibrated":false`} {
		if !strings.Contains(body, want) {
			t.Errorf("state.json lacks %s: %s", want, body)
		}
	}
	if strings.Contains(body, "null") {
		t.Errorf("state.json has null: %s", body)
	}
	w = get(t, Handler(fixedSource{}), "/ui/state.json")
	if body := w.Body.String(); w.Code != 200 || !strings.Contains(body, `"replicas":[]`) || !strings.Contains(body, `"branches":{}`) {
		t.Errorf("zero snapshot: %d %s", w.Code, body)
	}
}

// externalRef matches any reference to another origin: a URL with a
// scheme or a protocol-relative one in an attribute, url() or import.
var externalRef = regexp.MustCompile(`(?i)(src|href|action)\s*=\s*["']?\s*(https?:)?//|url\(\s*["']?(https?:)?//|@import|https?://`)

// TestPageSelfContained: /ui/ serves one HTML document with its CSS and
// JavaScript inlined, refers to no other origin, and is locked to its own
// origin by a Content-Security-Policy.
func TestPageSelfContained(t *testing.T) {
	h := Handler(fixedSource{})
	w := get(t, h, "/ui/")
	if w.Code != 200 || !strings.HasPrefix(w.Header().Get("Content-Type"), "text/html") {
		t.Fatalf("/ui/: %d %q", w.Code, w.Header().Get("Content-Type"))
	}
	page := w.Body.String()
	// The SVG namespace is a name, not a fetched resource: allow it alone.
	scan := strings.ReplaceAll(page, `"http://www.w3.org/2000/svg"`, `""`)
	if m := externalRef.FindString(scan); m != "" {
		t.Errorf("page refers to another origin: %q", m)
	}
	for _, want := range []string{"<style>", "<script>", "state.json", `id="replicas"`} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %s", want)
		}
	}
	if strings.Contains(page, "<!--CSS-->") || strings.Contains(page, "<!--JS-->") || strings.Contains(page, "<script src") {
		t.Error("assets not inlined")
	}
	csp := w.Header().Get("Content-Security-Policy")
	if !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "connect-src 'self'") || !strings.Contains(csp, "script-src 'sha256-") {
		t.Errorf("CSP %q", csp)
	}

	// /ui redirects to /ui/ and keeps the query (the admin token).
	w = get(t, h, "/ui?token=abc")
	if w.Code != http.StatusFound || w.Header().Get("Location") != "/ui/?token=abc" {
		t.Errorf("/ui: %d %q", w.Code, w.Header().Get("Location"))
	}
	// Mounted under a prefix.
	if w := get(t, h, "/admin/ui/state.json"); w.Code != 200 {
		t.Errorf("prefixed state.json: %d", w.Code)
	}
	if w := get(t, h, "/ui/nothing"); w.Code != http.StatusNotFound {
		t.Errorf("/ui/nothing: %d", w.Code)
	}
	r := httptest.NewRequest("POST", "/ui/state.json", nil)
	w = httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d", w.Code)
	}
	_, _ = io.Copy(io.Discard, w.Body)
}
