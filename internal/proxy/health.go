package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"
)

// watch checks replica b's health every HealthInterval until ctx ends:
// the pool's Feed for each replica (its load, engine and tokenizer are the
// pool's own feeds).
func (p *Proxy) watch(ctx context.Context, b *backend) {
	hc := time.NewTicker(p.cfg.HealthInterval)
	defer hc.Stop()
	for {
		p.check(ctx, b)
		select {
		case <-ctx.Done():
			return
		case <-hc.C:
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
		p.log.Debug("health check failed", "replica", b.Name, "err", err)
	}
	p.m.health.WithLabelValues(b.Name, result).Inc()
	p.checked(b, err == nil, false)
	return err == nil
}

// get GETs path on b (bounded by HealthTimeout) and hands a 2xx body to
// read.
func (p *Proxy) get(ctx context.Context, b *backend, path string, read func(io.Reader) error) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.HealthTimeout)
	defer cancel()
	u := *b.Base
	u.Path = upstream.TrimSlash(b.Base.Path) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.Name, err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4, application/json, */*")
	resp, err := p.checks.Do(req)
	if err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return fmt.Errorf("proxy: get %s from %s: status %d", path, b.Name, resp.StatusCode)
	}
	if err := read(resp.Body); err != nil {
		return fmt.Errorf("proxy: get %s from %s: %w", path, b.Name, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return nil
}
