package epp

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// maxScrapeBytes bounds a replica's /metrics page (vLLM's is ~100 KiB).
const maxScrapeBytes = 16 << 20

// scrapeLoop reads r's load every ScrapeInterval until ctx ends.
func (p *Picker) scrapeLoop(ctx context.Context, r *replica) {
	client := &http.Client{Timeout: p.cfg.ScrapeTimeout}
	t := time.NewTicker(p.cfg.ScrapeInterval)
	defer t.Stop()
	for {
		p.scrape(ctx, client, r)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// scrape reads r's queue and KV usage once; a failure makes them unknown.
func (p *Picker) scrape(ctx context.Context, client *http.Client, r *replica) {
	waiting, running, kv, err := fetchLoad(ctx, client, r.MetricsURL)
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.log.Debug("epp: metrics scrape failed", "replica", r.Name, "err", err)
		waiting, running, kv = -1, -1, -1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byName[r.Name] == r {
		_ = p.rt.ReplicaLoad(r.id, waiting, running, kv)
	}
}

// Metric names of the engines' load gauges (INTERFACES.md §2); the same
// as internal/proxy's (unexported there).
var (
	runningNames = []string{"vllm:num_requests_running", "sglang:num_running_reqs"}
	waitingNames = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
	kvNames      = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}
)

// fetchLoad GETs url and reads vLLM's or SGLang's gauges: counts summed
// over series, KV usage averaged; -1 for what it does not find.
func fetchLoad(ctx context.Context, client *http.Client, url string) (waiting, running int, kv float64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return -1, -1, -1, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return -1, -1, -1, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return -1, -1, -1, fmt.Errorf("epp: scrape %s: status %d", url, resp.StatusCode)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, maxScrapeBytes))
	if err != nil {
		return -1, -1, -1, fmt.Errorf("epp: scrape %s: %w", url, err)
	}
	read := func(names []string, mean bool) (float64, bool) {
		for _, name := range names {
			f, ok := fams[name]
			if !ok {
				continue
			}
			sum, n := 0.0, 0
			for _, m := range f.GetMetric() {
				var v float64
				switch {
				case m.Gauge != nil:
					v = m.GetGauge().GetValue()
				case m.Untyped != nil:
					v = m.GetUntyped().GetValue()
				case m.Counter != nil:
					v = m.GetCounter().GetValue()
				default:
					continue
				}
				if !math.IsNaN(v) && !math.IsInf(v, 0) && v >= 0 {
					sum += v
					n++
				}
			}
			if n > 0 {
				if mean {
					return sum / float64(n), true
				}
				return sum, true
			}
		}
		return 0, false
	}
	waiting, running, kv = -1, -1, -1
	if v, ok := read(runningNames, false); ok {
		running = int(math.Round(v))
	}
	if v, ok := read(waitingNames, false); ok {
		waiting = int(math.Round(v))
	}
	if v, ok := read(kvNames, true); ok {
		kv = min(max(v, 0), 1)
	}
	return waiting, running, kv, nil
}
