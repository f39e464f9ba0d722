package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"
)

// watch checks replica b's health every HealthInterval and scrapes its load
// every ScrapeInterval until ctx ends. After a good check it detects the
// replica's backend kind and probes its tokenizer when they are due (at
// start and on re-admission). It is Run's per-replica goroutine.
func (p *Proxy) watch(ctx context.Context, b *backend) {
	hc := time.NewTicker(p.cfg.HealthInterval)
	defer hc.Stop()
	var scrapeC <-chan time.Time
	if p.cfg.ScrapeInterval > 0 {
		t := time.NewTicker(p.cfg.ScrapeInterval)
		defer t.Stop()
		scrapeC = t.C
		p.scrape(ctx, b)
	}
	if p.check(ctx, b) {
		p.detect(ctx, b)
		p.probeTokenizer(ctx, b)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-hc.C:
			if p.check(ctx, b) {
				p.detect(ctx, b) // the probe speaks the engine's /tokenize
				p.probeTokenizer(ctx, b)
			}
		case <-scrapeC:
			p.scrape(ctx, b)
		}
	}
}

// check polls b's health endpoint once and records the result; it reports
// whether the check passed.
func (p *Proxy) check(ctx context.Context, b *backend) bool {
	err := p.get(ctx, b, p.cfg.HealthPath, func(io.Reader) error { return nil })
	if ctx.Err() != nil {
		return false // stopping: not the replica's fault
	}
	result := "ok"
	if err != nil {
		result = "fail"
		p.log.Debug("health check failed", "replica", b.name, "err", err)
	}
	p.m.health.WithLabelValues(b.name, result).Inc()
	p.checked(b.id, err == nil, false)
	return err == nil
}

// scrape reads b's load from its /metrics and gives it to the core. A
// failed scrape makes the load unknown (the policies fall back on the
// router's own counts).
func (p *Proxy) scrape(ctx context.Context, b *backend) {
	l := upstream.UnknownLoad
	err := p.get(ctx, b, p.cfg.MetricsPath, func(r io.Reader) error {
		var err error
		l, err = upstream.ParseLoad(io.LimitReader(r, upstream.MaxScrapeBytes))
		return err
	})
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.m.ScrapeErrs.WithLabelValues(b.name).Inc()
		p.log.Debug("metrics scrape failed", "replica", b.name, "err", err)
		l = upstream.UnknownLoad
	}
	p.mu.Lock()
	err = p.rt.ReplicaLoad(b.id, l.Waiting, l.Running, l.KVUsage)
	e := &p.engines[b.id]
	e.kvTokens = l.KVTokens
	if e.configured == upstream.Auto && l.Kind != "" && l.Kind != e.kind {
		e.due = true // another engine answers there now: detect it again
	}
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("router replica load", "replica", b.name, "err", err)
	}
}

// get GETs path on b (bounded by HealthTimeout) and hands a 2xx body to
// read.
func (p *Proxy) get(ctx context.Context, b *backend, path string, read func(io.Reader) error) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.HealthTimeout)
	defer cancel()
	u := *b.url
	u.Path = upstream.TrimSlash(b.url.Path) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.name, err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4, application/json, */*")
	resp, err := p.checks.Do(req)
	if err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return fmt.Errorf("proxy: get %s from %s: status %d", path, b.name, resp.StatusCode)
	}
	if err := read(resp.Body); err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.name, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return nil
}
