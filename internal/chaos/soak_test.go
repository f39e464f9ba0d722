package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
)

// soakSample is one reading of the cluster's resources.
type soakSample struct {
	At               time.Duration
	RouterRSS        int64
	RouterFDs        int
	RouterGoroutines int
	EnginesRSS       int64
	EnginesFDs       int
	RouterInflight   int
	TreeBlocks       int
}

// soakMinute is one minute of load.
type soakMinute struct {
	Minute                  int
	Workload                string
	Sent, Completed, Errors int
	TTFT, Latency           report.Summary
	Hit                     float64
}

// soakRouterFlags override the suite's router flags for the soak.
var soakRouterFlags = []string{
	"--idle-timeout", "30s",
	"--response-header-timeout", "30s",
	"--request-timeout", "60s",
	"--tree-max-blocks", "100000",
}

// soakWorkloads are cycled minute by minute.
var soakWorkloads = []string{"toolbench", "shared-prefix", "agent"}

// TestSoak runs mixed workloads against three engines and the router for
// -soak (skipped when 0) and records the router's and the engines' memory,
// file descriptors and goroutines every 10 s, and latency per minute, in
// CSV files and a summary under -soak-out. Growth that does not level off
// (the last quarter of the run well above the second) fails the test.
func TestSoak(t *testing.T) {
	if *soakDuration <= 0 {
		t.Skip("soak: run with -soak=DURATION, e.g. go test ./internal/chaos -run Soak -soak=1h -v")
	}
	dir := *soakOut
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "prefixlb-soak-"); err != nil {
			t.Fatal(err)
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// The soak looks for leaks, not for faults: the router runs with
	// production-like timeouts (the suite's 3 s idle timeout turns a
	// scheduling stall on a busy 2-core machine into an error) and a
	// prefix tree bounded at 100k blocks (about 8 MiB), so that the tree
	// reaches its bound within the hour and the memory it holds levels off
	// where a user would see it level off.
	c := newCluster(t, clusterOpts{routerFlags: soakRouterFlags})
	ctx, cancel := context.WithTimeout(context.Background(), *soakDuration+5*time.Minute)
	defer cancel()
	start := time.Now()

	// The sampler: owned by this test, stopped by cancelSampler and waited.
	var (
		mu      sync.Mutex // guards samples
		samples []soakSample
	)
	sctx, cancelSampler := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(10 * time.Second)
		defer tick.Stop()
		for {
			s, err := sampleCluster(c, time.Since(start))
			if err != nil {
				t.Logf("soak: sample: %v", err)
			} else {
				mu.Lock()
				samples = append(samples, s)
				mu.Unlock()
			}
			select {
			case <-sctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	defer func() { cancelSampler(); wg.Wait() }()

	var minutes []soakMinute
	for m := 0; time.Since(start) < *soakDuration; m++ {
		name := soakWorkloads[m%len(soakWorkloads)]
		d := min(time.Minute, *soakDuration-time.Since(start))
		reqs := genWorkload(t, name, int(10*d.Seconds())+20, 10, int64(m+1))
		_, _, wait := runLoad(ctx, c.router.url(), reqs, d)
		out, err := wait()
		if err != nil {
			t.Fatalf("soak: minute %d: %v", m, err)
		}
		mm := soakMinute{Minute: m, Workload: name, Sent: len(out.Records), Completed: out.Result.Completed,
			Errors: out.Result.Errors, TTFT: out.Result.TTFT, Latency: out.Result.Latency, Hit: out.Result.PrefixHitRatio}
		minutes = append(minutes, mm)
		t.Logf("soak: minute %d %-13s sent=%d completed=%d errors=%d ttft p50/p99 %.1f/%.1f ms latency p50/p99 %.0f/%.0f ms hit %.2f",
			m, name, mm.Sent, mm.Completed, mm.Errors, mm.TTFT.P50, mm.TTFT.P99, mm.Latency.P50, mm.Latency.P99, mm.Hit)
		if mm.Errors > 0 {
			t.Errorf("soak: minute %d: %d errors without any fault: %v", m, mm.Errors, firstErrors(out.Records, 3))
		}
	}
	cancelSampler()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if err := writeSoak(dir, samples, minutes); err != nil {
		t.Fatal(err)
	}
	summary := soakSummary(samples, minutes, time.Since(start))
	if err := os.WriteFile(filepath.Join(dir, "summary.txt"), []byte(summary), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("soak: results in %s\n%s", dir, summary)
	for _, g := range growth(samples) {
		t.Errorf("soak: %s", g)
	}
}

// sampleCluster reads the router's and engines' resources.
func sampleCluster(c *cluster, at time.Duration) (soakSample, error) {
	s := soakSample{At: at}
	ps, err := readProcStats(c.router.p.pid())
	if err != nil {
		return s, err
	}
	s.RouterRSS, s.RouterFDs = ps.RSSBytes, ps.FDs
	m, err := c.router.metrics()
	if err != nil {
		return s, err
	}
	s.RouterGoroutines = int(m["go_goroutines"])
	s.RouterInflight = int(m["prefixlb_inflight"])
	s.TreeBlocks = int(m["prefixlb_tree_blocks"])
	for _, e := range c.engines {
		ps, err := readProcStats(e.p.pid())
		if err != nil {
			return s, err
		}
		s.EnginesRSS += ps.RSSBytes
		s.EnginesFDs += ps.FDs
	}
	return s, nil
}

// firstErrors returns up to n distinct error texts of recs.
func firstErrors(recs []report.RequestRecord, n int) []string {
	var out []string
	for _, r := range recs {
		if r.Error != "" && !slices.Contains(out, r.Error) {
			out = append(out, r.Error)
			if len(out) == n {
				break
			}
		}
	}
	return out
}

// writeSoak writes samples.csv and minutes.csv under dir.
func writeSoak(dir string, samples []soakSample, minutes []soakMinute) error {
	var b strings.Builder
	b.WriteString("elapsed_s,router_rss_mib,router_fds,router_goroutines,router_inflight,tree_blocks,engines_rss_mib,engines_fds\n")
	for _, s := range samples {
		fmt.Fprintf(&b, "%.0f,%.1f,%d,%d,%d,%d,%.1f,%d\n", s.At.Seconds(), mib(s.RouterRSS), s.RouterFDs, s.RouterGoroutines,
			s.RouterInflight, s.TreeBlocks, mib(s.EnginesRSS), s.EnginesFDs)
	}
	if err := os.WriteFile(filepath.Join(dir, "samples.csv"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	b.Reset()
	b.WriteString("minute,workload,sent,completed,errors,ttft_p50_ms,ttft_p99_ms,latency_p50_ms,latency_p99_ms,hit_ratio\n")
	for _, m := range minutes {
		fmt.Fprintf(&b, "%d,%s,%d,%d,%d,%.1f,%.1f,%.1f,%.1f,%.3f\n", m.Minute, m.Workload, m.Sent, m.Completed, m.Errors,
			m.TTFT.P50, m.TTFT.P99, m.Latency.P50, m.Latency.P99, m.Hit)
	}
	return os.WriteFile(filepath.Join(dir, "minutes.csv"), []byte(b.String()), 0o644)
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// soakSummary renders the run's figures: resources at the start, middle and
// end, and latency over all minutes.
func soakSummary(samples []soakSample, minutes []soakMinute, elapsed time.Duration) string {
	var b strings.Builder
	sent, completed, errs := 0, 0, 0
	var p99 []float64
	for _, m := range minutes {
		sent, completed, errs = sent+m.Sent, completed+m.Completed, errs+m.Errors
		p99 = append(p99, m.Latency.P99)
	}
	fmt.Fprintf(&b, "soak %v: %d minutes of %s at 10 req/s; sent %d, completed %d, errors %d\n",
		elapsed.Round(time.Second), len(minutes), strings.Join(soakWorkloads, "/"), sent, completed, errs)
	if len(samples) > 0 {
		for _, s := range []soakSample{samples[0], samples[len(samples)/2], samples[len(samples)-1]} {
			fmt.Fprintf(&b, "t=%5.0fs router rss %.1f MiB fds %d goroutines %d tree %d blocks | engines rss %.1f MiB fds %d\n",
				s.At.Seconds(), mib(s.RouterRSS), s.RouterFDs, s.RouterGoroutines, s.TreeBlocks, mib(s.EnginesRSS), s.EnginesFDs)
		}
	}
	if len(p99) > 0 {
		fmt.Fprintf(&b, "latency p99 per minute: min %.0f ms, max %.0f ms\n", slices.Min(p99), slices.Max(p99))
	}
	return b.String()
}

// growth returns a line for each resource whose median over the last
// quarter of the run is well above its median over the second quarter
// (the first quarter is warm-up): growth that did not level off.
func growth(samples []soakSample) []string {
	if len(samples) < 8 {
		return nil
	}
	q := len(samples) / 4
	second, last := samples[q:2*q], samples[len(samples)-q:]
	med := func(ss []soakSample, f func(soakSample) float64) float64 {
		v := make([]float64, len(ss))
		for i, s := range ss {
			v[i] = f(s)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	var out []string
	check := func(name string, f func(soakSample) float64, ratio, slack float64) {
		a, z := med(second, f), med(last, f)
		if z > a*ratio+slack {
			out = append(out, fmt.Sprintf("%s grew from %.1f to %.1f (median of the second quarter to the last)", name, a, z))
		}
	}
	check("router goroutines", func(s soakSample) float64 { return float64(s.RouterGoroutines) }, 1.25, 20)
	check("router fds", func(s soakSample) float64 { return float64(s.RouterFDs) }, 1.25, 20)
	check("router rss MiB", func(s soakSample) float64 { return mib(s.RouterRSS) }, 1.5, 16)
	check("engines fds", func(s soakSample) float64 { return float64(s.EnginesFDs) }, 1.25, 20)
	check("engines rss MiB", func(s soakSample) float64 { return mib(s.EnginesRSS) }, 1.5, 32)
	return out
}
