package proxy

import (
	"context"
	"errors"
	"strings"

	"github.com/prefixlb/prefixlb/internal/upstream"
)

// markDue makes a detection due, unless the kind is configured and needs
// nothing read (vLLM, SGLang).
func (e *engineState) markDue() {
	e.due = e.configured == upstream.Auto || e.configured == upstream.LlamaCpp
}

// metricsURL is replica b's Prometheus page ("" when MetricsPath is not a
// path).
func (p *Proxy) metricsURL(b *backend) string {
	if !strings.HasPrefix(p.cfg.MetricsPath, "/") {
		return ""
	}
	u := *b.url
	u.Path = upstream.TrimSlash(u.Path) + p.cfg.MetricsPath
	u.RawPath = ""
	return u.String()
}

// detect finds replica b's backend kind (DetectBackend) if a detection is
// due, and gives the router its cache model: a llama.cpp replica's slot
// count (router.SetCacheSlots), 0 (a block cache) for any other. It runs
// in b's watch loop after a good health check. A replica that did not
// answer stays due.
func (p *Proxy) detect(ctx context.Context, b *backend) {
	p.mu.Lock()
	e := p.engines[b.id]
	p.mu.Unlock()
	if !e.due {
		return
	}
	d, err := upstream.Detect(ctx, p.checks, b.url.String(), p.metricsURL(b), e.configured)
	if ctx.Err() != nil {
		return
	}
	if errors.Is(err, upstream.ErrNoAnswer) {
		p.log.Debug("backend kind: no answer; trying again after the next health check", "replica", b.name, "err", err)
		return
	}
	if err != nil {
		p.log.Warn("backend kind", "replica", b.name, "err", err)
	}
	slots := 0
	if d.Kind.SlotCache() {
		slots = d.Slots
	}
	p.mu.Lock()
	cur := &p.engines[b.id]
	old := cur.kind
	cur.kind, cur.slots, cur.due = d.Kind, slots, false
	serr := p.rt.SetCacheSlots(b.id, slots)
	if old != d.Kind && p.tokProbe != nil {
		p.tokProbe.markDue(b.id) // the probe speaks the engine's /tokenize
	}
	p.mu.Unlock()
	if serr != nil {
		p.log.Error("router cache slots", "replica", b.name, "slots", slots, "err", serr)
	}
	if old != d.Kind || e.slots != slots {
		p.log.Info("replica backend kind", "replica", b.name, "kind", d.Kind, "via", d.Via, "slots", slots)
	}
	if d.Kind.SlotCache() && slots == 0 {
		p.log.Warn("llama.cpp replica did not say its slot count (GET /props total_slots, GET /slots): its cache is mirrored as a block cache",
			"replica", b.name)
	}
	if p.hookDetect != nil {
		p.hookDetect(b.name, d)
	}
}

// engineOf returns replica id's engine state.
func (p *Proxy) engineOf(id int) engineState {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.engines[id]
}
