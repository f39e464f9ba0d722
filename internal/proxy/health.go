package proxy

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// maxScrapeBytes bounds a replica's /metrics page (vLLM's is ~100 KiB).
const maxScrapeBytes = 16 << 20

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
	l := unknownLoad
	err := p.get(ctx, b, p.cfg.MetricsPath, func(r io.Reader) error {
		var err error
		l, err = parseLoad(io.LimitReader(r, maxScrapeBytes))
		return err
	})
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		p.m.scrapeErrs.WithLabelValues(b.name).Inc()
		p.log.Debug("metrics scrape failed", "replica", b.name, "err", err)
		l = unknownLoad
	}
	p.mu.Lock()
	err = p.rt.ReplicaLoad(b.id, l.Waiting, l.Running, l.KVUsage)
	e := &p.engines[b.id]
	e.kvTokens = l.KVTokens
	if e.configured == BackendAuto && l.Kind != "" && l.Kind != e.kind {
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
	u.Path = trimSlash(b.url.Path) + path
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

// trimSlash drops a trailing "/".
func trimSlash(s string) string {
	if len(s) > 0 && s[len(s)-1] == '/' {
		return s[:len(s)-1]
	}
	return s
}

// Load is a replica's own load figures, as scraped; -1 is unknown.
type Load struct {
	// Waiting and Running are the engine's queued and running requests
	// (llama.cpp: requests deferred for want of a free slot, and requests
	// processing).
	Waiting, Running int
	// KVUsage is the engine's KV-cache usage in [0,1].
	KVUsage float64
	// KVTokens is the tokens in the engine's KV cache (llama.cpp's
	// llamacpp:kv_cache_tokens; -1 for engines that do not say).
	KVTokens int
	// Kind is the engine the page's metric names belong to (their prefix:
	// llamacpp:, vllm:, sglang:), "" when none is recognised.
	Kind BackendKind
}

// maxLoadCount caps the request counts read from a replica's metrics.
const maxLoadCount = 1 << 30

// unknownLoad is a Load with nothing known.
var unknownLoad = Load{Waiting: -1, Running: -1, KVUsage: -1, KVTokens: -1}

// Metric names of the engines' load gauges (INTERFACES.md §2; llama.cpp:
// examples/server/server.cpp, handle_metrics, at commit c392e50).
var (
	runningNames = []string{"vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"}
	waitingNames = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"}
	kvNames      = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage", "llamacpp:kv_cache_usage_ratio"}
	kvTokenNames = []string{"llamacpp:kv_cache_tokens"}
)

// ParseLoad reads a replica's load from vLLM's, SGLang's or llama.cpp's
// Prometheus text exposition (see parseLoad); the endpoint picker shares
// it.
func ParseLoad(r io.Reader) (Load, error) { return parseLoad(r) }

// parseLoad reads vLLM's, SGLang's or llama.cpp's Prometheus text
// exposition. Counts are summed over series (engines of a data-parallel
// replica); KV usage is the mean over series. Metrics it does not find stay
// unknown. The page's engine is the one most of its metric families name.
func parseLoad(r io.Reader) (Load, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return unknownLoad, fmt.Errorf("parse metrics: %w", err)
	}
	// firstFamily returns the sum (or mean) over the series of the first
	// family in names that has a finite, non-negative value.
	firstFamily := func(names []string, mean bool) (float64, bool) {
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
				if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
					continue
				}
				sum += v
				n++
			}
			if n == 0 {
				continue
			}
			if mean {
				return sum / float64(n), true
			}
			return sum, true
		}
		return 0, false
	}
	l := unknownLoad
	// Counts are capped before the conversion: a float beyond int's range
	// converts to an arbitrary int (math.MinInt64 on amd64), which a
	// replica reporting 1e300 would turn into a negative load.
	if v, ok := firstFamily(runningNames, false); ok {
		l.Running = int(math.Round(min(v, maxLoadCount)))
	}
	if v, ok := firstFamily(waitingNames, false); ok {
		l.Waiting = int(math.Round(min(v, maxLoadCount)))
	}
	if v, ok := firstFamily(kvNames, true); ok {
		l.KVUsage = min(max(v, 0), 1)
	}
	if v, ok := firstFamily(kvTokenNames, false); ok {
		l.KVTokens = int(math.Round(min(v, maxLoadCount)))
	}
	l.Kind = pageKind(fams)
	return l, nil
}

// pageKind is the engine most of a metrics page's families are named for
// ("" none; a tie goes to the first of llamacpp, vllm, sglang).
func pageKind[V any](fams map[string]V) BackendKind {
	counts := make([]int, len(metricPrefixes))
	for name := range fams {
		for i, p := range metricPrefixes {
			if strings.HasPrefix(name, p.prefix) {
				counts[i]++
				break
			}
		}
	}
	best := -1
	for i, n := range counts {
		if n > 0 && (best < 0 || n > counts[best]) {
			best = i
		}
	}
	if best < 0 {
		return ""
	}
	return metricPrefixes[best].kind
}
