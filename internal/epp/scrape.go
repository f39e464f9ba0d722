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
// Metric names of another engine than r's detected one make r due a new
// detection (Config.BackendKind auto).
func (p *Picker) scrape(ctx context.Context, client *http.Client, r *replica) {
	l, err := fetchLoad(ctx, client, r.MetricsURL)
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.log.Debug("epp: metrics scrape failed", "replica", r.Name, "err", err)
		p.m.scrapeErr.WithLabelValues(r.Name).Inc()
		l = proxy.Load{Waiting: -1, Running: -1, KVUsage: -1, KVTokens: -1}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byName[r.Name] != r {
		return
	}
	_ = p.rt.ReplicaLoad(r.id, l.Waiting, l.Running, l.KVUsage)
	r.kvTokens = l.KVTokens
	if p.kind == proxy.BackendAuto && l.Kind != "" && l.Kind != r.kind && !r.kindDue {
		p.markKindDue(r) // another engine answers there now
	}
}

// fetchLoad GETs url and reads vLLM's, SGLang's or llama.cpp's gauges with
// the proxy's parser (proxy.ParseLoad): counts summed over series, KV usage
// averaged; -1 for what it does not find.
func fetchLoad(ctx context.Context, client *http.Client, url string) (proxy.Load, error) {
	unknown := proxy.Load{Waiting: -1, Running: -1, KVUsage: -1, KVTokens: -1}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return unknown, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return unknown, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return unknown, fmt.Errorf("epp: scrape %s: status %d", url, resp.StatusCode)
	}
	l, err := proxy.ParseLoad(io.LimitReader(resp.Body, maxScrapeBytes))
	if err != nil {
		return unknown, fmt.Errorf("epp: scrape %s: %w", url, err)
	}
	return l, nil
}
