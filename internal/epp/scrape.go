package epp

import (
	"context"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"
)

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
	l, err := upstream.FetchLoad(ctx, client, r.MetricsURL)
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.log.Debug("epp: metrics scrape failed", "replica", r.Name, "err", err)
		p.m.ScrapeErrs.WithLabelValues(r.Name).Inc()
		l = upstream.UnknownLoad
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byName[r.Name] != r {
		return
	}
	_ = p.rt.ReplicaLoad(r.id, l.Waiting, l.Running, l.KVUsage)
	r.kvTokens = l.KVTokens
	if p.kind == upstream.Auto && l.Kind != "" && l.Kind != r.kind && !r.kindDue {
		p.markKindDue(r) // another engine answers there now
	}
}
