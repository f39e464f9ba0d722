package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// queueEngine is a fake OpenAI engine with slots slots: a request waits for
// a free slot, holds it for service (its prefill), then streams its tokens
// over vLLM's SSE chunks. Its TTFT grows with the requests in flight once
// they outnumber the slots: it serves slots/service requests per second,
// and beyond that its queue grows for as long as the load lasts.
type queueEngine struct {
	slots    chan struct{}
	service  time.Duration
	inflight atomic.Int64
	peak     atomic.Int64
}

func newQueueEngine(slots int, service time.Duration) *queueEngine {
	return &queueEngine{slots: make(chan struct{}, slots), service: service}
}

func (e *queueEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/completions" {
		http.NotFound(w, r)
		return
	}
	var body struct {
		MaxTokens int `json:"max_tokens"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	n := e.inflight.Add(1)
	defer e.inflight.Add(-1)
	for p := e.peak.Load(); n > p && !e.peak.CompareAndSwap(p, n); p = e.peak.Load() {
	}
	select {
	case e.slots <- struct{}{}:
	case <-r.Context().Done():
		return
	}
	defer func() { <-e.slots }()
	select {
	case <-time.After(e.service):
	case <-r.Context().Done():
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	send := func(data string) {
		fmt.Fprintf(w, "data: %s\n\n", data)
		w.(http.Flusher).Flush()
	}
	for i := range max(body.MaxTokens, 1) {
		send(fmt.Sprintf(`{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":" w%d","finish_reason":null}]}`, i))
	}
	send(fmt.Sprintf(`{"id":"c","object":"text_completion","model":"m","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":%d,"total_tokens":%d}}`, body.MaxTokens, body.MaxTokens+10))
	send("[DONE]")
}

// sloConfig is a bench --slo run of short shared-prefix requests (40
// prompt tokens, 2 output tokens, so that building and sending them costs
// little even under the race detector) against url.
func sloConfig(url, ramp, slo string) Config {
	c := Config{Workload: workload.DefaultFlags(), Load: loadgen.DefaultConfig(), Mode: "completions", SLO: slo}
	c.Workload.Spec = workload.DefaultSpec("shared-prefix")
	sp := &c.Workload.Spec.SharedPrefix
	sp.Groups, sp.SystemTokens, sp.QuestionTokens, sp.Output = 4, 30, 10, 2
	c.Workload.Ramp = ramp
	c.Load.Target, c.Load.Model, c.Load.Policy = url, "m", "fake"
	return c
}

// TestRunSLOFindsTheCapacityBetweenTwoStages drives a fake engine that
// serves 4 / 100 ms = 40 requests/s through a ramp of 5, 10 and 80
// requests/s (then 160): at 10 req/s (a quarter of its throughput) p90
// TTFT stays near the 100 ms prefill; at 80, twice its throughput, the
// queue grows by 40 requests a second and p90 TTFT passes a second. The
// capacity at ttft_p90=500ms must be 10, the 80 stage must miss and end
// the run before the 160 stage is judged.
func TestRunSLOFindsTheCapacityBetweenTwoStages(t *testing.T) {
	eng := newQueueEngine(4, 100*time.Millisecond)
	srv := httptest.NewServer(eng)
	defer srv.Close()
	dir := t.TempDir()
	c := sloConfig(srv.URL, "5:2s,10:2s,80:1.5s,160:0.5s", "ttft_p90=500ms")
	c.JSONPath = filepath.Join(dir, "r.json")
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	fh, err := os.Open(c.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	file, err := report.ReadJSON(fh)
	if err != nil {
		t.Fatal(err)
	}
	rs := file.Results
	if len(rs) != 3 {
		t.Fatalf("%d stages judged, want 3 (the run stops after the 160 stage misses)", len(rs))
	}
	wantMet := []bool{true, true, false}
	for i, r := range rs {
		if r.SLO != "ttft_p90=500ms" || r.SLOMet == nil || r.GoodputRPS == nil || r.CapacityRPS == nil || len(r.SLOObserved) != 1 {
			t.Fatalf("stage %d lacks the SLO fields: %+v", i, r)
		}
		if *r.SLOMet != wantMet[i] {
			t.Errorf("stage %d (rate %g): slo_met %v, want %v (ttft p90 %v ms)", i, r.Rate, *r.SLOMet, wantMet[i], r.TTFT.P90)
		}
		if *r.CapacityRPS != 10 {
			t.Errorf("stage %d: capacity_rps %g, want 10", i, *r.CapacityRPS)
		}
		if r.AtCapacity != (r.Rate == 10) {
			t.Errorf("stage %d (rate %g): at_capacity %v", i, r.Rate, r.AtCapacity)
		}
		if r.Errors != 0 {
			t.Errorf("stage %d: %d errors", i, r.Errors)
		}
	}
	// Goodput: (nearly) all of the 10 stage within the limit, a minority
	// of the 80 stage's requests (those sent before the queue passed
	// 500 ms), and that stage's throughput capped by the engine's 40.
	if g := *rs[1].GoodputRPS; g < 5 || g > 15 {
		t.Errorf("10 req/s stage: goodput %g req/s", g)
	}
	if g, th := *rs[2].GoodputRPS, rs[2].ThroughputRPS; !(g < th/2) || th > 45 {
		t.Errorf("80 req/s stage: goodput %g, throughput %g: want the goodput below half the throughput, and the throughput at most the engine's 40", g, th)
	}
	out := stdout.String()
	for _, want := range []string{"capacity_rps 10: the highest stage rate that met ttft_p90=500ms, every lower stage meeting it too",
		"met *", "not judged: stopped after a stage missed"} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q", want)
		}
	}
	if n := strings.Count(stderr.String(), "\nstage "); n < 3 {
		t.Errorf("stderr has %d stage lines, want one per stage:\n%s", n, stderr.String())
	}
}

// TestRunSLOKeepGoing judges every stage after a miss and still reports the
// capacity below the first one: 5 met, 80 and 120 missed.
func TestRunSLOKeepGoing(t *testing.T) {
	srv := httptest.NewServer(newQueueEngine(4, 100*time.Millisecond))
	defer srv.Close()
	c := sloConfig(srv.URL, "5:2s,80:1s,120:0.3s", "ttft_p90=500ms")
	c.SLOKeepGoing, c.JSONPath = true, "-"
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	file, err := report.ReadJSON(&stdout)
	if err != nil {
		t.Fatal(err)
	}
	if len(file.Results) != 3 {
		t.Fatalf("%d stages, want all 3", len(file.Results))
	}
	for i, want := range []bool{true, false, false} {
		r := file.Results[i]
		if *r.SLOMet != want || *r.CapacityRPS != 5 {
			t.Errorf("stage %d (rate %g): met %v, capacity %g; want %v, 5", i, r.Rate, *r.SLOMet, *r.CapacityRPS, want)
		}
	}
}

func TestRunSLOErrors(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.SLO = "ttft=2s" }, "bench: --slo: slo: target"},
		{func(c *Config) { c.Workload.Ramp = "" }, "bench: --slo needs --ramp"},
		{func(c *Config) { c.Duration = time.Second }, "bench: --duration and --slo"},
		{func(c *Config) { c.Workload.Arrival.Process = "poisson" }, "bench: --arrival poisson and --slo"},
		{func(c *Config) { c.Workload.Ramp = "5:1s,5:1s" }, "stage rates must rise (stage 2: 5 after 5)"},
		{func(c *Config) { c.Workload.Ramp = "5:1s,x" }, "bench: --ramp: "},
		{func(c *Config) { c.Workload.Spec.Requests, c.RequestsGiven = 1, true }, "stage 2 (2 req/s for 10s) has no requests: the workload has 1"},
	} {
		c := sloConfig("http://127.0.0.1:1", "1:1s,2:10s", "ttft_p90=1s")
		tc.edit(&c)
		if err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want %q", err, tc.want)
		}
	}
}

func TestSplitStages(t *testing.T) {
	stages := []workload.Stage{{Rate: 1, Duration: time.Second}, {Rate: 2, Duration: 2 * time.Second}}
	var reqs []workload.Request
	for _, ms := range []int{0, 999, 1000, 2999, 3000} {
		reqs = append(reqs, workload.Request{ID: len(reqs), Arrival: time.Duration(ms) * time.Millisecond})
	}
	got := SplitStages(reqs, stages)
	if len(got) != 2 || len(got[0]) != 2 || len(got[1]) != 2 || got[1][0].ID != 2 || got[1][1].ID != 3 {
		t.Errorf("got %v", got)
	}
}
