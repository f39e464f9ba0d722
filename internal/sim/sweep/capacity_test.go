package sweep

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/report"
)

func TestRunCapacity(t *testing.T) {
	c := smallConfig()
	c.Workload.Spec.Requests = 200
	c.Workload.Arrival.Rate = 4
	c.SLO = "ttft_p90=2s"
	c.SLOTolerance = 0.1
	c.JSONPath = filepath.Join(t.TempDir(), "out.json")
	c.OutDir = t.TempDir()
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), c, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"capacity at ttft_p90=2s", "capacity_rps", "goodput along each search", "at capacity:"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
	data, err := os.ReadFile(c.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	var f report.File
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	byPolicy := map[string][]report.Result{}
	for _, r := range f.Results {
		byPolicy[r.Policy] = append(byPolicy[r.Policy], r)
	}
	if len(byPolicy) != 2 {
		t.Fatalf("policies %v, want round-robin and e2", len(byPolicy))
	}
	for p, rs := range byPolicy {
		if rs[0].CapacityRPS == nil {
			t.Fatalf("%s: no capacity_rps", p)
		}
		capRPS := *rs[0].CapacityRPS
		atCap, missedNear := 0, false
		for _, r := range rs {
			if r.CapacityRPS == nil || *r.CapacityRPS != capRPS || r.SLOMet == nil || r.GoodputRPS == nil || r.SLO != "ttft_p90=2s" {
				t.Fatalf("%s rate %g: capacity/slo fields %+v", p, r.Rate, r)
			}
			// The verdict agrees with the run's own TTFT p90 (no failures in
			// a simulation, the same percentile method).
			if met := r.TTFT.P90 <= 2000; met != *r.SLOMet || *r.SLOObserved[0].ObservedMs != r.TTFT.P90 {
				t.Errorf("%s rate %g: slo_met %v, ttft p90 %g", p, r.Rate, *r.SLOMet, r.TTFT.P90)
			}
			if *r.GoodputRPS > r.ThroughputRPS+1e-9 {
				t.Errorf("%s rate %g: goodput %g > throughput %g", p, r.Rate, *r.GoodputRPS, r.ThroughputRPS)
			}
			// Capacity is the highest rate that met.
			if *r.SLOMet && r.Rate > capRPS {
				t.Errorf("%s: rate %g met above capacity %g", p, r.Rate, capRPS)
			}
			if !*r.SLOMet && r.Rate > capRPS && r.Rate <= capRPS*(1+c.SLOTolerance)+1e-9 {
				missedNear = true
			}
			if r.AtCapacity {
				atCap++
				if r.Rate != capRPS || !*r.SLOMet {
					t.Errorf("%s: at_capacity run at %g (met %v), capacity %g", p, r.Rate, *r.SLOMet, capRPS)
				}
			}
		}
		if capRPS <= 0 || atCap != 1 || !missedNear {
			t.Errorf("%s: capacity %g, %d runs at capacity, a miss within tolerance above: %v", p, capRPS, atCap, missedNear)
		}
	}
	for _, name := range []string{"results.json", "requests.csv", "chart.svg", "report.html"} {
		if _, err := os.Stat(filepath.Join(c.OutDir, name)); err != nil {
			t.Error(err)
		}
	}
}

func TestRunCapacityErrors(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.SLO = "ttft_p90" }, "sim: --slo: slo: target"},
		{func(c *Config) { c.SLO = "ttft_p90=2s"; c.Rates = "1,2" }, "--rates and --slo"},
		{func(c *Config) { c.SLO = "ttft_p90=2s"; c.SLOMaxRate = 1 }, "max rate 1"},
	} {
		c := smallConfig()
		tc.edit(&c)
		err := Run(context.Background(), c, &bytes.Buffer{}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("got %v, want %q", err, tc.want)
		}
	}
}
