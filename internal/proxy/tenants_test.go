package proxy

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

func keyDigest(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

// threshold is the queue's predicted-wait threshold in force.
func threshold(p *Proxy) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.gate.StateLocked().Threshold
}

// TestUntrustedClassHeaders (issue 26, D6): by default no client's class
// headers are believed. A client's 2ns (or 1ns) TTFT SLO leaves the pool's
// predicted-wait threshold alone, its priority does not jump the queue,
// its tenant header does not make it that tenant; each is counted. From a
// trusted proxy the SLO is believed, floored at min_ttft_slo, and the
// threshold falls no lower than slo_fraction of that floor.
func TestUntrustedClassHeaders(t *testing.T) {
	p, srv, g := queueProxy(t, func(c *Config) { c.Tenants.TrustedProxies = nil })
	ctx := context.Background()
	first := send(ctx, srv.URL, "first", nil)
	<-g.arrived
	if got := threshold(p); got != admission.DefaultMaxPredictedWait {
		t.Fatalf("threshold %v at start", got)
	}
	var answers []<-chan answer
	for i, h := range []map[string]string{
		{"x-prefixlb-ttft-slo": "1ns"},
		{"x-prefixlb-ttft-slo": "2ns", "x-prefixlb-priority": "1000"},
		{"x-prefixlb-tenant": "acme", "x-prefixlb-priority": "7"},
	} {
		answers = append(answers, send(ctx, srv.URL, fmt.Sprint("c", i), h))
		waitQueued(t, p, i+1) // queued, not shed for its 1ns deadline
	}
	if got := threshold(p); got != admission.DefaultMaxPredictedWait {
		t.Errorf("untrusted SLO headers moved the threshold to %v", got)
	}
	for i := 0; i < 4; i++ {
		g.release <- struct{}{}
		if i < 3 {
			<-g.arrived
		}
	}
	<-first
	for _, a := range answers {
		if r := <-a; r.status != http.StatusOK {
			t.Errorf("status %d: %s", r.status, r.body)
		}
	}
	if got := fmt.Sprint(g.served()); got != "[first c0 c1 c2]" {
		t.Errorf("served %s: an untrusted priority reordered the queue", got)
	}
	metrics := get(t, srv.URL+"/metrics")
	for h, n := range map[string]int{"x-prefixlb-ttft-slo": 2, "x-prefixlb-priority": 2, "x-prefixlb-tenant": 1} {
		if want := fmt.Sprintf("prefixlb_untrusted_headers_total{header=%q} %d", h, n); !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if strings.Contains(metrics, `tenant="acme"`) {
		t.Error("an untrusted tenant header named a metric series")
	}

	// From a trusted proxy the SLO is believed, floored.
	p2, srv2, g2 := queueProxy(t, nil)
	first = send(ctx, srv2.URL, "first", nil)
	<-g2.arrived
	late := send(ctx, srv2.URL, "late", map[string]string{"x-prefixlb-ttft-slo": "2ns"})
	if r := <-late; r.status != http.StatusTooManyRequests {
		t.Errorf("trusted 2ns SLO behind a request in flight: %d, want 429 (deadline)", r.status)
	}
	if got, want := threshold(p2), time.Duration(admission.DefaultSLOFraction*float64(admission.DefaultMinTTFTSLO)); got != want {
		t.Errorf("trusted 2ns SLO: threshold %v, want %v (slo_fraction of min_ttft_slo)", got, want)
	}
	g2.release <- struct{}{}
	<-first
}

// countQueueSeries counts the queue's metric series on /metrics.
func countQueueSeries(t *testing.T, url string) int {
	n := 0
	for _, line := range strings.Split(get(t, url+"/metrics"), "\n") {
		if strings.HasPrefix(line, "prefixlb_queue_") {
			n++
		}
	}
	return n
}

// TestQueueSeriesBounded (issue 26, D6: 6 → 366 series after 20 queued
// requests): 200 clients with distinct API keys and tenant headers, all
// queued, add the series of one tenant label ("other") and one priority,
// not one per client.
func TestQueueSeriesBounded(t *testing.T) {
	p, srv, g := queueProxy(t, func(c *Config) {
		c.Tenants.TrustedProxies = nil
		c.Queue.Admission.MaxQueue = 512
		c.Tenants.Tenants = []tenant.Tenant{{Name: "acme", APIKeySHA256: []string{keyDigest("sk-acme")}}}
	})
	ctx := context.Background()
	first := send(ctx, srv.URL, "first", nil)
	<-g.arrived
	before := countQueueSeries(t, srv.URL)
	const n = 200
	var answers []<-chan answer
	for i := range n {
		h := map[string]string{"Authorization": fmt.Sprintf("Bearer sk-%d", i), "x-prefixlb-tenant": fmt.Sprint("t", i)}
		answers = append(answers, send(ctx, srv.URL, fmt.Sprint("q", i), h))
	}
	answers = append(answers, send(ctx, srv.URL, "acme", map[string]string{"x-api-key": "sk-acme"}))
	waitQueued(t, p, n+1)
	for i := 0; i <= n+1; i++ {
		g.release <- struct{}{}
		if i <= n {
			<-g.arrived
		}
	}
	<-first
	for _, a := range answers {
		<-a
	}
	after := countQueueSeries(t, srv.URL)
	// Two tenant labels (other, acme) at priority 0: the length gauge, the
	// wait histogram (13 buckets, +Inf, sum, count) and the dispatched
	// counter each.
	if want := before + 2*(1+16+1); after != want {
		t.Errorf("queue series %d before, %d after %d clients: want %d", before, after, n, want)
	}
	if m := get(t, srv.URL+"/metrics"); strings.Contains(m, `tenant="t1"`) || strings.Contains(m, `tenant="key-`) {
		t.Error("a client-chosen tenant is a label")
	}
}

func TestRequireTenant(t *testing.T) {
	rep := newFakeReplica(t, "r")
	c := testConfig(rep)
	c.Tenants = tenant.Config{RequireTenant: true, Tenants: []tenant.Tenant{{Name: "acme", APIKeySHA256: []string{keyDigest("sk-acme")}}}}
	_, srv := startProxy(t, c)
	for key, want := range map[string]int{"sk-acme": 200, "sk-nope": 401, "": 401} {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/completions", strings.NewReader(plainBody))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp)
		if resp.StatusCode != want {
			t.Errorf("key %q: %d %s, want %d", key, resp.StatusCode, b, want)
		}
	}
	if m := get(t, srv.URL+"/metrics"); !strings.Contains(m, "prefixlb_tenant_unknown_total 2") {
		t.Error("refusals not counted")
	}
}

// TestQuotaSettle: every response of a tenant with a quota carries the
// x-ratelimit-*-tokens headers; an answered request is charged its prompt
// and reported output, a replica's error is refunded.
func TestQuotaSettle(t *testing.T) {
	rep := newFakeReplica(t, "r")
	c := testConfig(rep)
	c.MaxRetries = 0
	c.Tenants.Tenants = []tenant.Tenant{{Name: "acme", APIKeySHA256: []string{keyDigest("sk-acme")}, TokensPerMinute: 60000}}
	_, srv := startProxy(t, c)
	do := func() (*http.Response, []byte) {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/completions", strings.NewReader(plainBody)) // 18 token ids, max_tokens 3
		req.Header.Set("Authorization", "Bearer sk-acme")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp, readAll(t, resp)
	}
	resp, b := do()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// The headers tell the bucket once this request's 18 + 3 tokens were
	// reserved.
	if got := resp.Header.Get("x-ratelimit-remaining-tokens"); got != "59979" || resp.Header.Get("x-ratelimit-limit-tokens") != "60000" ||
		resp.Header.Get("x-ratelimit-reset-tokens") == "" {
		t.Errorf("rate headers %v", resp.Header)
	}
	// Settled: 18 prompt tokens and the 3 the replica reported.
	if m := get(t, srv.URL+"/metrics"); !strings.Contains(m, `prefixlb_quota_tokens_total{tenant="acme"} 21`) {
		t.Errorf("charged: %s", grep(m, "prefixlb_quota_tokens_total"))
	}
	rep.mode.Store(modeStatus)
	if resp, b = do(); resp.StatusCode != 503 || resp.Header.Get("x-ratelimit-remaining-tokens") == "" {
		t.Errorf("replica error: %d %s", resp.StatusCode, b)
	}
	if m := get(t, srv.URL+"/metrics"); !strings.Contains(m, `prefixlb_quota_tokens_total{tenant="acme"} 21`) {
		t.Errorf("a failed request was charged: %s", grep(m, "prefixlb_quota_tokens_total"))
	}
}

// slotEngine is an in-process engine of fixed capacity: slots requests at
// a time, each a prefill of prefill then one token every step, streamed,
// with its usage; a request beyond the slots waits for one (an engine's
// waiting queue). The sleeps model the engine's service time.
type slotEngine struct {
	srv           *httptest.Server
	slots         chan struct{}
	prefill, step time.Duration
}

func newSlotEngine(t *testing.T, slots int, prefill, step time.Duration) *slotEngine {
	e := &slotEngine{slots: make(chan struct{}, slots), prefill: prefill, step: step}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/v1/completions", e.complete)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *slotEngine) complete(w http.ResponseWriter, r *http.Request) {
	var b struct {
		MaxTokens int `json:"max_tokens"`
	}
	_ = json.NewDecoder(r.Body).Decode(&b)
	ctx := r.Context()
	select {
	case e.slots <- struct{}{}:
		defer func() { <-e.slots }()
	case <-ctx.Done():
		return
	}
	wait := func(d time.Duration) bool {
		tm := time.NewTimer(d)
		defer tm.Stop()
		select {
		case <-tm.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	if !wait(e.prefill) {
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	n := max(b.MaxTokens, 1)
	for i := range n {
		if i > 0 && !wait(e.step) {
			return
		}
		fmt.Fprintf(w, `data: {"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"t%d","finish_reason":null}]}`+"\n\n", i)
		fl.Flush()
	}
	fmt.Fprintf(w, `data: {"id":"c","object":"text_completion","model":"m","choices":[],"usage":{"prompt_tokens":16,"completion_tokens":%d,"total_tokens":%d}}`+"\n\ndata: [DONE]\n\n", n, 16+n)
	fl.Flush()
}

// streamTTFT posts a streamed completion of 16 token ids for 4 tokens with
// key and returns its status, its time to the first event, and its 429's
// Retry-After.
func streamTTFT(ctx context.Context, url, key string, seq int) (status int, ttft time.Duration, retryAfter string, err error) {
	body := fmt.Sprintf(`{"model":"m","prompt":[%d,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, 1000+seq)
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return resp.StatusCode, 0, resp.Header.Get("Retry-After"), nil
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data:") {
			if ttft == 0 {
				ttft = time.Since(start)
			}
			if strings.Contains(sc.Text(), "[DONE]") {
				break
			}
		}
	}
	return 200, ttft, "", sc.Err()
}

// quotaRun is one phase of TestQuotaIsolation.
type quotaRun struct {
	bTTFT     []time.Duration
	bFailed   int
	aOK, a429 int
	retry     []string
}

func pct(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

// TestQuotaIsolation (issue 26 target: "a tenant at 4× its quota gets
// 429s while a tenant within quota sees no change in TTFT"). One engine of
// one slot (a 40 ms prefill, 4 tokens 5 ms apart: about 18 requests a
// second); tenant A's quota is 8 of its requests a second, B sends 5 a
// second. B's TTFT is measured with A at its quota (1×), at 4× its quota
// (32 a second, beyond the engine's capacity), and at 4× with no quota.
func TestQuotaIsolation(t *testing.T) {
	if testing.Short() {
		t.Skip("timed phases")
	}
	const (
		phase  = 2500 * time.Millisecond
		aQuota = 8.0 // A's requests a second under its quota
		bRate  = 5.0
		perReq = 16 + 4 // tokens of one request: 16 prompt ids, 4 output
	)
	run := func(t *testing.T, aRate float64, quota bool) quotaRun {
		e := newSlotEngine(t, 1, 40*time.Millisecond, 5*time.Millisecond)
		c := testConfig()
		c.Backends = []Backend{{Name: "e", URL: e.srv.URL, Kind: "vllm"}}
		c.Tenants.Tenants = []tenant.Tenant{{Name: "a", APIKeySHA256: []string{keyDigest("sk-a")}}, {Name: "b", APIKeySHA256: []string{keyDigest("sk-b")}}}
		if quota {
			c.Tenants.Tenants[0].TokensPerMinute = int64(aQuota * perReq * 60)
			c.Tenants.Tenants[0].BurstTokens = 2 * perReq
			c.Tenants.Tenants[1].TokensPerMinute = 1_000_000
		}
		p, srv := startProxy(t, c)
		runLoops(t, p)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var mu sync.Mutex
		var res quotaRun
		var wg, bwg sync.WaitGroup // A's requests, B's
		start := time.Now()
		// Open-loop arrivals: A's at aRate, B's at bRate, each at its time.
		type arrival struct {
			at time.Duration
			b  bool
			i  int
		}
		var plan []arrival
		for i := range int(aRate * phase.Seconds()) {
			plan = append(plan, arrival{time.Duration(float64(i) / aRate * float64(time.Second)), false, i})
		}
		for j := range int(bRate * phase.Seconds()) {
			plan = append(plan, arrival{time.Duration((float64(j) + 0.5) / bRate * float64(time.Second)), true, 1_000_000 + j})
		}
		slices.SortFunc(plan, func(x, y arrival) int { return int(x.at - y.at) })
		for _, a := range plan {
			time.Sleep(time.Until(start.Add(a.at)))
			if a.b {
				bwg.Add(1)
				go func() {
					defer bwg.Done()
					st, ttft, _, err := streamTTFT(ctx, srv.URL, "sk-b", a.i)
					mu.Lock()
					defer mu.Unlock()
					if err != nil || st != 200 {
						res.bFailed++
					} else {
						res.bTTFT = append(res.bTTFT, ttft)
					}
				}()
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				st, _, ra, err := streamTTFT(ctx, srv.URL, "sk-a", a.i)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
				case st == 200:
					res.aOK++
				case st == 429:
					res.a429++
					res.retry = append(res.retry, ra)
				}
			}()
		}
		// Every B request ends (behind A's backlog, without a quota), then
		// what A still has queued is dropped.
		bDone := make(chan struct{})
		go func() { bwg.Wait(); close(bDone) }()
		select {
		case <-bDone:
		case <-time.After(30 * time.Second):
			t.Error("B's requests did not end within 30s")
		}
		cancel()
		wg.Wait()
		return res
	}
	atQuota := run(t, aQuota, true)
	flood := run(t, 4*aQuota, true)
	noQuota := run(t, 4*aQuota, false)
	for _, ph := range []struct {
		name string
		r    quotaRun
	}{{"A at 1×", atQuota}, {"A at 4×", flood}, {"A at 4×, no quota", noQuota}} {
		name, r := ph.name, ph.r
		t.Logf("%s: B p50 TTFT %v p90 %v (%d requests, %d failed); A %d served, %d refused 429",
			name, pct(r.bTTFT, 0.5).Round(time.Millisecond), pct(r.bTTFT, 0.9).Round(time.Millisecond), len(r.bTTFT), r.bFailed, r.aOK, r.a429)
	}
	if flood.bFailed > 0 || atQuota.bFailed > 0 {
		t.Errorf("B failed %d requests with A at 4×, %d at 1×: want none", flood.bFailed, atQuota.bFailed)
	}
	// A at 4×: most of its requests refused, each told a Retry-After of a
	// second or two (the bucket covers one request every 1/aQuota s).
	if total := flood.aOK + flood.a429; total == 0 || float64(flood.a429)/float64(total) < 0.5 {
		t.Errorf("A at 4× its quota: %d served, %d refused, want most refused", flood.aOK, flood.a429)
	}
	for _, ra := range flood.retry {
		if n, err := strconv.Atoi(ra); err != nil || n < 1 || n > 2 {
			t.Errorf("Retry-After %q, want 1 or 2 seconds", ra)
			break
		}
	}
	// B's TTFT does not change with A's flood (margin for a loaded 2-core
	// machine under -race), while without the quota it does.
	p50At, p50Flood, p50No := pct(atQuota.bTTFT, 0.5), pct(flood.bTTFT, 0.5), pct(noQuota.bTTFT, 0.5)
	if p50Flood > p50At*3/2+30*time.Millisecond {
		t.Errorf("B's p50 TTFT %v with A at 4× its quota, %v with A at its quota: want no change", p50Flood, p50At)
	}
	if p50No < 2*p50Flood {
		t.Errorf("without the quota B's p50 TTFT is %v, with it %v: the flood should hurt B without the quota", p50No, p50Flood)
	}
}

func TestTenantsConfig(t *testing.T) {
	c, err := ParseConfig([]byte(`
backends: [{url: "http://127.0.0.1:1"}]
trusted_proxies: [10.0.0.0/8, "::1"]
anonymous_tokens_per_minute: 5000
require_tenant: true
tenants:
  - name: acme
    api_key_sha256: [`+keyDigest("k")+`]
    tokens_per_minute: 100000
    burst_tokens: 20000
queue:
  min_ttft_slo: 250ms
  classes:
    - {tenant: acme, priority: 5}
`), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	tc := c.Tenants
	if len(tc.TrustedProxies) != 2 || tc.AnonymousTokensPerMinute != 5000 || !tc.RequireTenant || len(tc.Tenants) != 1 ||
		tc.Tenants[0].BurstTokens != 20000 || c.Queue.Admission.MinTTFTSLO != 250*time.Millisecond {
		t.Errorf("parsed %+v, min_ttft_slo %v", tc, c.Queue.Admission.MinTTFTSLO)
	}
	if fmt.Sprint(c.Queue.Tenants) != "[acme]" {
		t.Errorf("queue's tenants %v", c.Queue.Tenants)
	}
	for _, bad := range []string{
		"tenants: [{name: acme, api_key_sha256: [xyz]}]",
		"trusted_proxies: [not-an-ip]",
		"tenants: [{name: acme, tokens: 5}]",
		"queue: {min_ttft_slo: -1s}",
	} {
		c, err := ParseConfig([]byte("backends: [{url: \"http://127.0.0.1:1\"}]\n"+bad), DefaultConfig())
		if err == nil {
			err = c.Validate()
		}
		if err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	// Defaults: nothing trusted, the SLO floor on.
	d := DefaultConfig()
	if len(d.Tenants.TrustedProxies) != 0 || d.Tenants.TrustClientHeaders || d.Queue.Admission.MinTTFTSLO != admission.DefaultMinTTFTSLO {
		t.Errorf("defaults %+v", d.Tenants)
	}
}
