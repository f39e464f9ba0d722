package epp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/proxy"
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
		p.m.scrapeErr.WithLabelValues(r.Name).Inc()
		waiting, running, kv = -1, -1, -1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byName[r.Name] == r {
		_ = p.rt.ReplicaLoad(r.id, waiting, running, kv)
	}
}

// fetchLoad GETs url and reads vLLM's or SGLang's gauges with the proxy's
// parser (proxy.ParseLoad): counts summed over series, KV usage averaged;
// -1 for what it does not find.
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
	l, err := proxy.ParseLoad(io.LimitReader(resp.Body, maxScrapeBytes))
	if err != nil {
		return -1, -1, -1, fmt.Errorf("epp: scrape %s: %w", url, err)
	}
	waiting, running, kv = l.Waiting, l.Running, l.KVUsage
	return waiting, running, kv, nil
}
