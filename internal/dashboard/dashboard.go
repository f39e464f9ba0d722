// Package dashboard is the operator's live view of a running router: a
// self-contained page at /ui (HTML, CSS and JavaScript embedded in the
// binary, no CDN, no external URL, so it works offline and behind an
// air gap) that polls /ui/state.json, a [Snapshot] of the router, every
// second. state.json is a stable JSON document that scripts may read too
// (docs/dashboard.md).
//
// The package knows nothing about the proxy: a [Source] hands it snapshots.
// It starts no goroutines; the browser does the polling.
package dashboard

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"time"
)

// Snapshot is the router as the dashboard shows it: the body of
// GET /ui/state.json. Field names and units are stable; new fields may be
// added.
type Snapshot struct {
	// Time is when the snapshot was taken (RFC 3339, the router's clock).
	Time time.Time `json:"time"`
	// Policy names the routing policy.
	Policy string `json:"policy"`
	// Replicas lists every replica, in configuration order.
	Replicas []Replica `json:"replicas"`
	// Prefixes are the hottest prefix units (most requests in the policy's
	// window first); empty for policies that keep no prefix placement (only
	// e2 and e2-preble do).
	Prefixes []Prefix `json:"prefixes"`
	// Branches is the rate of decisions per branch (exploit, explore,
	// mixing, rebalance, or a baseline policy's own branch names), in
	// decisions per second over the last RateWindowS seconds.
	Branches map[string]float64 `json:"branches"`
	// DecisionsPerS is the rate of all decisions over the same window.
	DecisionsPerS float64 `json:"decisions_per_s"`
	// RateWindowS is the span, in seconds, that the rates are measured over.
	RateWindowS float64 `json:"rate_window_s"`
	// CachePrediction compares the cached tokens the router predicted with
	// what the replicas reported, since start.
	CachePrediction CachePrediction `json:"cache_prediction"`
	// Totals counts requests since start.
	Totals Totals `json:"totals"`
	// Recent lists the latest decisions, newest first.
	Recent []Decision `json:"recent"`
	// Queue is the router-side queue (docs/overload.md); absent when the
	// queue is off.
	Queue *Queue `json:"queue,omitempty"`
}

// Queue is the router-side queue's state.
type Queue struct {
	// Saturated says the pool is saturated now: arrivals wait.
	Saturated bool `json:"saturated"`
	// Waiting counts the requests waiting now.
	Waiting int `json:"waiting"`
	// MinWaitS is the least predicted wait for a first token among the
	// replicas that take requests, in seconds.
	MinWaitS float64 `json:"min_wait_s"`
	// Flows are the waiting requests per priority and tenant, highest
	// priority first.
	Flows []QueueFlow `json:"flows"`
	// Passed, Queued, Dispatched and Cancelled count requests since start:
	// let through at once, made to wait, let through after waiting, left by
	// their client while waiting.
	Passed     int64 `json:"passed"`
	Queued     int64 `json:"queued"`
	Dispatched int64 `json:"dispatched"`
	Cancelled  int64 `json:"cancelled"`
	// Shed counts requests shed since start, per reason (queue_full,
	// timeout, deadline, pool_down).
	Shed map[string]int64 `json:"shed"`
}

// QueueFlow is one priority and tenant's waiting requests.
type QueueFlow struct {
	Priority int    `json:"priority"`
	Tenant   string `json:"tenant"`
	Waiting  int    `json:"waiting"`
	// OldestWaitS is how long the oldest of them has waited, in seconds.
	OldestWaitS float64 `json:"oldest_wait_s"`
}

// Replica is one replica's state.
type Replica struct {
	// Name is the replica's name (its configured name or address).
	Name string `json:"name"`
	// Up is false while health checks keep it out of routing.
	Up bool `json:"up"`
	// InFlight counts the requests routed to it and not finished.
	InFlight int `json:"in_flight"`
	// Waiting and Running are the engine's own queue figures from its
	// /metrics; -1 when unknown.
	Waiting int `json:"waiting"`
	Running int `json:"running"`
	// KVUsage is the engine's KV-cache usage in [0,1]; -1 when unknown.
	KVUsage float64 `json:"kv_usage"`
	// HitRatio is the share of prompt tokens routed to it that it had
	// cached, over the policy's hit-ratio window (e2: 30 s; other policies:
	// the recent decisions), in [0,1].
	HitRatio float64 `json:"hit_ratio"`
	// LoadSeconds is E2's load L for the replica: the prefill GPU seconds
	// routed to it in the window (0 for other policies).
	LoadSeconds float64 `json:"load_seconds"`
	// PendingPrefillS is the predicted prefill GPU time still owed by its
	// in-flight requests, in seconds.
	PendingPrefillS float64 `json:"pending_prefill_s"`
	// CachedBlocks is the number of prefix blocks the router believes the
	// replica caches.
	CachedBlocks int `json:"cached_blocks"`
	// Kind is the replica's engine: "vllm", "sglang", "llamacpp" or
	// "unknown" (detected from its endpoints, or configured).
	Kind string `json:"kind"`
	// Slots is its number of prompt slots for a slot cache (llama.cpp's
	// -np); 0 for a block cache.
	Slots int `json:"slots"`
	// Role is its role in a disaggregated cluster: "both" (it prefills
	// and decodes its own requests), "prefill" or "decode" (docs/pd.md).
	Role string `json:"role"`
	// Transfers counts the disaggregated requests whose KV is moving from
	// or to it (routed, no token out of their decode yet).
	Transfers int `json:"transfers"`
	// PredictionErrorTokens is the moving average of the router's
	// predicted minus the replica's reported cached tokens (positive: the
	// router believes the replica caches more than it does).
	PredictionErrorTokens float64 `json:"prediction_error_tokens"`
	// CapacityTokens is the router's current estimate of the replica's
	// cache capacity, learned from those reports (block caches mirrored
	// without KV events).
	CapacityTokens int `json:"capacity_tokens"`
	// Corrections counts reports that changed the router's view of the
	// replica's cache.
	Corrections int `json:"corrections"`
	// Profile names the replica's configured cost profile.
	Profile string `json:"profile"`
	// Calibrated is true when the router learns the replica's prefill and
	// decode speed from the requests it serves (internal/calibrate), with
	// its profile as the prior; false when it prices with the profile
	// alone (the speed figures below are then the profile's).
	Calibrated bool `json:"calibrated"`
	// PrefillSPer1K is the time, in seconds, the router prices a cold
	// prefill of 1,000 tokens at on the replica (fitted when Calibrated),
	// and ProfilePrefillSPer1K the profile's.
	PrefillSPer1K        float64 `json:"prefill_s_per_1k"`
	ProfilePrefillSPer1K float64 `json:"profile_prefill_s_per_1k"`
	// DecodeStepS is the time, in seconds, of one decode step of one
	// sequence with 1,000 tokens of context (fitted when Calibrated), and
	// ProfileDecodeStepS the profile's.
	DecodeStepS        float64 `json:"decode_step_s"`
	ProfileDecodeStepS float64 `json:"profile_decode_step_s"`
	// PrefillError and DecodeError are the fit's recent relative error:
	// |predicted/observed − 1|, a moving average over about the last 20
	// observations, each predicted before the fit learnt from it; 0 before
	// any observation and when not Calibrated.
	PrefillError float64 `json:"prefill_error"`
	DecodeError  float64 `json:"decode_error"`
	// CalibrationSamples counts the prefill and decode observations the
	// fit learnt from (0 when not Calibrated).
	CalibrationSamples int64 `json:"calibration_samples"`
}

// Prefix is one prefix unit of the router's tree with its placement.
type Prefix struct {
	// ID names the unit: the hex chain key of its first block. It is
	// stable while the unit lives.
	ID string `json:"id"`
	// Tokens is the prefix's length, from the prompt's start, in tokens.
	Tokens int `json:"tokens"`
	// Requests is the number of requests for it in the policy's window.
	Requests int `json:"requests"`
	// RequestsPerS is Requests over the window's span (or the time since
	// the first decision, when shorter).
	RequestsPerS float64 `json:"requests_per_s"`
	// Assigned names the replicas the policy assigned it to; two or more
	// means it is replicated.
	Assigned []string `json:"assigned"`
	// CachedOn names the replicas that cache its last block.
	CachedOn []string `json:"cached_on"`
}

// CachePrediction compares predicted with reported cached tokens.
type CachePrediction struct {
	// PredictedTokens and ReportedTokens sum, over finished requests whose
	// replica reported cached tokens, the router's prediction and the
	// replica's report.
	PredictedTokens int64 `json:"predicted_tokens"`
	ReportedTokens  int64 `json:"reported_tokens"`
	// Checked counts those requests; ExactRatio is the share of them
	// predicted within one block (0 when none).
	Checked    int     `json:"checked"`
	ExactRatio float64 `json:"exact_ratio"`
}

// Totals counts requests since start.
type Totals struct {
	Routed   int `json:"routed"`
	Finished int `json:"finished"`
	Failed   int `json:"failed"`
	InFlight int `json:"in_flight"`
}

// Decision is one routing decision.
type Decision struct {
	// Time is when it was made.
	Time time.Time `json:"time"`
	// Replica names the chosen replica.
	Replica string `json:"replica"`
	// Branch names the rule that decided.
	Branch string `json:"branch"`
	// MatchedTokens is how many prompt tokens the chosen replica cached.
	MatchedTokens int `json:"matched_tokens"`
	// PromptTokens is the prompt's length in tokens.
	PromptTokens int `json:"prompt_tokens"`
	// Explain is the decision's explanation, as in the x-prefixlb-route
	// response header.
	Explain string `json:"explain"`
}

// Source produces snapshots. Snapshot is called once per request for
// state.json, from the HTTP server's goroutines: it must be safe for
// concurrent use and should not hold locks the router needs for long.
type Source interface {
	Snapshot() Snapshot
}

//go:embed assets
var assets embed.FS

// page is the dashboard's one HTML document, with its CSS and JavaScript
// inlined, and csp the Content-Security-Policy that allows exactly that
// script and style (by hash) and fetches from the same origin only.
var page, csp = buildPage()

// buildPage inlines assets/app.css and assets/app.js into assets/index.html.
func buildPage() ([]byte, string) {
	read := func(name string) string {
		b, err := assets.ReadFile("assets/" + name)
		if err != nil {
			panic(fmt.Sprintf("dashboard: embedded %s: %v", name, err)) // the build embeds them
		}
		return string(b)
	}
	css, js := read("app.css"), read("app.js")
	hash := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(h[:]) + "'"
	}
	html := read("index.html")
	html = strings.Replace(html, "<!--CSS-->", "<style>"+css+"</style>", 1)
	html = strings.Replace(html, "<!--JS-->", "<script>"+js+"</script>", 1)
	policy := "default-src 'none'; connect-src 'self'; img-src 'self' data:; " +
		"style-src " + hash(css) + "; script-src " + hash(js) + "; base-uri 'none'; form-action 'none'"
	return []byte(html), policy
}

// Handler serves the dashboard of src: GET /ui (redirected to /ui/), GET
// /ui/ (the page) and GET /ui/state.json (the Snapshot). It matches the end
// of the path, so it can be mounted under any prefix that ends in /ui.
func Handler(src Source) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		path := r.URL.Path
		switch {
		case strings.HasSuffix(path, "/ui"):
			target := "ui/"
			if r.URL.RawQuery != "" {
				target += "?" + r.URL.RawQuery
			}
			http.Redirect(w, r, target, http.StatusFound)
		case strings.HasSuffix(path, "/ui/"):
			h := w.Header()
			h.Set("Content-Type", "text/html; charset=utf-8")
			h.Set("Content-Security-Policy", csp)
			h.Set("X-Content-Type-Options", "nosniff")
			h.Set("Referrer-Policy", "no-referrer") // the URL may carry ?token=
			h.Set("Cache-Control", "no-store")
			http.ServeContent(w, r, "index.html", time.Time{}, bytes.NewReader(page))
		case strings.HasSuffix(path, "/ui/state.json"):
			b, err := json.Marshal(normalize(src.Snapshot()))
			if err != nil {
				http.Error(w, "dashboard: encode snapshot: "+err.Error(), http.StatusInternalServerError)
				return
			}
			h := w.Header()
			h.Set("Content-Type", "application/json")
			h.Set("Cache-Control", "no-store")
			_, _ = w.Write(append(b, '\n'))
		default:
			http.NotFound(w, r)
		}
	})
}

// normalize replaces nil lists and maps by empty ones, so that scripts see
// [] and {} rather than null, non-finite numbers (which JSON cannot carry)
// by 0 and an unset replica kind by "unknown". It copies the maps it
// changes, never the caller's.
func normalize(s Snapshot) Snapshot {
	if s.Replicas == nil {
		s.Replicas = []Replica{}
	}
	for i := range s.Replicas {
		r := &s.Replicas[i]
		r.KVUsage, r.HitRatio = finite(r.KVUsage), finite(r.HitRatio)
		r.LoadSeconds, r.PendingPrefillS = finite(r.LoadSeconds), finite(r.PendingPrefillS)
		r.PredictionErrorTokens = finite(r.PredictionErrorTokens)
		r.PrefillSPer1K, r.ProfilePrefillSPer1K = finite(r.PrefillSPer1K), finite(r.ProfilePrefillSPer1K)
		r.DecodeStepS, r.ProfileDecodeStepS = finite(r.DecodeStepS), finite(r.ProfileDecodeStepS)
		r.PrefillError, r.DecodeError = finite(r.PrefillError), finite(r.DecodeError)
		if r.Kind == "" {
			r.Kind = "unknown"
		}
	}
	if s.Prefixes == nil {
		s.Prefixes = []Prefix{}
	}
	for i := range s.Prefixes {
		s.Prefixes[i].RequestsPerS = finite(s.Prefixes[i].RequestsPerS)
		if s.Prefixes[i].Assigned == nil {
			s.Prefixes[i].Assigned = []string{}
		}
		if s.Prefixes[i].CachedOn == nil {
			s.Prefixes[i].CachedOn = []string{}
		}
	}
	branches := make(map[string]float64, len(s.Branches))
	for k, v := range s.Branches {
		branches[k] = finite(v)
	}
	s.Branches = branches
	s.DecisionsPerS, s.RateWindowS = finite(s.DecisionsPerS), finite(s.RateWindowS)
	s.CachePrediction.ExactRatio = finite(s.CachePrediction.ExactRatio)
	if s.Recent == nil {
		s.Recent = []Decision{}
	}
	return s
}

// finite maps NaN and ±Inf to 0.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}
