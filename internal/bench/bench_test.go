package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func TestRequests(t *testing.T) {
	f := workload.DefaultFlags()
	f.Arrival.Rate = 10
	// λd = 100: 100 + 4·10 + 10.
	if got := Requests(&f, 10*time.Second); got != 150 {
		t.Errorf("poisson: %d, want 150", got)
	}
	f.Arrival.Process = workload.ArrivalRamp
	f.Ramp = "2:10s,4:10s"
	// 20 + 40 over the stages, then 4/s for the 10 s left: 100 again.
	if got := Requests(&f, 30*time.Second); got != 150 {
		t.Errorf("ramp: %d, want 150", got)
	}
	// Cut inside the first stage: 2·5 = 10 → ⌈10 + 4√10⌉ + 10.
	if got, want := Requests(&f, 5*time.Second), int(math.Ceil(10+4*math.Sqrt(10)))+10; got != want {
		t.Errorf("ramp, cut: %d, want %d", got, want)
	}
}

func TestOfferedRate(t *testing.T) {
	reqs := []workload.Request{{Arrival: 0}, {Arrival: time.Second}, {Arrival: 2 * time.Second}, {Arrival: 4 * time.Second}}
	if got := OfferedRate(reqs, 0); got != 1 {
		t.Errorf("whole span: %v, want 4 over 4 s", got)
	}
	if got := OfferedRate(reqs, 2*time.Second); got != 1 {
		t.Errorf("cut at 2 s: %v, want 2 over 2 s", got)
	}
	if got := OfferedRate(reqs[:1], 0); got != 0 {
		t.Errorf("no span: %v", got)
	}
}

func TestParseHeaders(t *testing.T) {
	if h, err := ParseHeaders(nil); h != nil || err != nil {
		t.Errorf("none: %v %v", h, err)
	}
	h, err := ParseHeaders([]string{"Authorization: Bearer k:v", " x-a :b", "X-A: c"})
	if err != nil {
		t.Fatal(err)
	}
	if h.Get("Authorization") != "Bearer k:v" || strings.Join(h.Values("X-A"), ",") != "b,c" {
		t.Errorf("got %v", h)
	}
	for _, s := range []string{"bad", ": v"} {
		if _, err := ParseHeaders([]string{s}); err == nil || !strings.Contains(err.Error(), `want "Name: value"`) {
			t.Errorf("%q: %v", s, err)
		}
	}
}

func TestWrite(t *testing.T) {
	out := loadgen.Output{Model: "m", Elapsed: 1500 * time.Millisecond,
		Records: []report.RequestRecord{{ID: 0, Policy: "bench", TTFTMs: 5, LatencyMs: 9, PromptTokens: 10, OutputTokens: 2}}}
	out.Result = report.Build("bench", 1, out.Records, out.Elapsed)
	var b bytes.Buffer
	dir := t.TempDir()
	jsonPath := filepath.Join(dir, "r.json")
	if err := Write(&b, out, jsonPath, dir); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(b.String(), "model m, 1.5s elapsed, 0 delayed by --max-inflight\n") || !strings.Contains(b.String(), "bench") {
		t.Errorf("table:\n%s", b.String())
	}
	for _, name := range []string{"r.json", "results.json", "requests.csv", "chart.svg", "report.html"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Error(err)
		}
	}
	b.Reset()
	if err := Write(&b, out, "-", ""); err != nil {
		t.Fatal(err)
	}
	var f report.File
	if err := json.Unmarshal(b.Bytes(), &f); err != nil || len(f.Results) != 1 {
		t.Errorf("--json -: %v\n%s", err, b.String())
	}
}

func TestRunErrors(t *testing.T) {
	base := func() Config {
		c := Config{Workload: workload.DefaultFlags(), Load: loadgen.DefaultConfig(), Mode: "completions"}
		c.Load.Target = "http://127.0.0.1:1"
		return c
	}
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Workload.Spec.Name = "" }, "bench: give exactly one of --workload NAME, --trace FILE or --dataset NAME FILE"},
		{func(c *Config) { c.Workload.Trace = "x.jsonl" }, "bench: give exactly one of --workload NAME, --trace FILE or --dataset NAME FILE"},
		{func(c *Config) { c.Duration = -time.Second }, "bench: --duration -1s: want ≥ 0"},
		{func(c *Config) { c.Headers = []string{"bad"} }, `bench: --header "bad": want "Name: value"`},
		{func(c *Config) { c.Mode = "grpc" }, "bench: "},
	} {
		c := base()
		tc.edit(&c)
		if err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want %q", err, tc.want)
		}
	}
}

// TestLoRAModels: a lora workload sent over loopback reaches the backend
// with each request's adapter as its model — the names and how often each
// comes as the workload has them — so that serve --lora-adapters routes it
// by adapter.
func TestLoRAModels(t *testing.T) {
	var mu sync.Mutex
	got := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			io.WriteString(w, `{"object":"list","data":[{"id":"base"}]}`)
			return
		}
		var b struct {
			Model string `json:"model"`
		}
		if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
			t.Errorf("decode body: %v", err)
		}
		mu.Lock()
		got[b.Model]++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()

	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec("lora")
	f.Spec.Requests, f.Spec.LoRA.Adapters = 60, 5
	f.Arrival.Rate = 2000
	reqs, _, err := f.Load()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{}
	for _, r := range reqs {
		want[r.Adapter]++
	}
	c := Config{Workload: f, Load: loadgen.DefaultConfig(), Mode: "completions", RequestsGiven: true}
	c.Load.Target = srv.URL
	if err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if len(want) < 2 || want[""] > 0 {
		t.Fatalf("the workload's adapters %v: want several, no base-model request", want)
	}
	if !maps.Equal(got, want) {
		t.Errorf("the backend received models %v, want the workload's adapters %v", got, want)
	}
}
