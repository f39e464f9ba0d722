package engine

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The metrics are written in Prometheus' text exposition format 0.0.4 by
// hand rather than through prometheus/client_golang: the module's go.sum does
// not carry client_golang's dependencies (client_model, procfs, protobuf),
// and a dozen series of one engine need no registry. Names, types, labels and
// histogram buckets are vLLM v1's (vllm/v1/metrics/loggers.py), so that a
// scraper written for vLLM reads the engine unchanged. Each Engine has its
// own metrics; several engines in one process do not share series.

// Histogram buckets of vLLM v1, in seconds.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	e2eBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
		30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	// pullBuckets span a one-block pull over an idle 400 Gb/s link (1 ms
	// latency, tens of µs of bytes) to a 128k-token prompt of a 70B model
	// (40 GB, ~1 s) shared with a few others. They are prefixlb's, not
	// vLLM's (its NixlConnector reports transfer durations in
	// vllm:nixl_xfer_time_seconds, per NIXL transfer).
	pullBuckets = []float64{0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2,
		0.5, 1.0, 2.0, 5.0, 10.0, 30.0}
)

// histogram is a Prometheus histogram: counts per bucket (not cumulative).
type histogram struct {
	bounds []float64
	counts []uint64 // counts[i]: observations in (bounds[i-1], bounds[i]]; the last is +Inf
	sum    float64
	n      uint64
}

func newHistogram(bounds []float64) histogram {
	return histogram{bounds: bounds, counts: make([]uint64, len(bounds)+1)}
}

func (h *histogram) observe(v float64) {
	i := len(h.bounds)
	for j, b := range h.bounds {
		if v <= b {
			i = j
			break
		}
	}
	h.counts[i]++
	h.sum += v
	h.n++
}

// metrics are the engine's own series; the replica's gauges and counters are
// read from its Stats when scraped.
type metrics struct {
	mu           sync.Mutex // guards the fields below
	ttft         histogram
	itl          histogram
	e2e          histogram
	promptTokens int64
	// The P/D decode legs' pulls (pd.go).
	pullSeconds  histogram
	pulls        int64
	pulledBlocks int64
	pulledBytes  float64
	recomputed   int64 // decode legs whose params allowed no pull
}

func (m *metrics) init() {
	m.ttft = newHistogram(ttftBuckets)
	m.itl = newHistogram(itlBuckets)
	m.e2e = newHistogram(e2eBuckets)
	m.pullSeconds = newHistogram(pullBuckets)
}

// pulled records a pull that has arrived.
func (m *metrics) pulled(d time.Duration, nBlocks int, bytes float64) {
	m.mu.Lock()
	m.pullSeconds.observe(d.Seconds())
	m.pulls++
	m.pulledBlocks += int64(nBlocks)
	m.pulledBytes += bytes
	m.mu.Unlock()
}

// pullRecomputed records a decode leg served without a pull.
func (m *metrics) pullRecomputed() {
	m.mu.Lock()
	m.recomputed++
	m.mu.Unlock()
}

// pullSnapshot is a copy of the pull metrics.
type pullSnapshot struct {
	seconds    histogram
	n, blocks  int64
	bytes      float64
	recomputed int64
}

func (m *metrics) pullSnapshot() pullSnapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.pullSeconds
	h.counts = append([]uint64(nil), h.counts...)
	return pullSnapshot{seconds: h, n: m.pulls, blocks: m.pulledBlocks, bytes: m.pulledBytes, recomputed: m.recomputed}
}

func (m *metrics) firstToken(ttft time.Duration, prompt int) {
	m.mu.Lock()
	m.ttft.observe(ttft.Seconds())
	m.promptTokens += int64(prompt)
	m.mu.Unlock()
}

func (m *metrics) token(itl time.Duration) {
	m.mu.Lock()
	m.itl.observe(itl.Seconds())
	m.mu.Unlock()
}

func (m *metrics) finished(e2e time.Duration) {
	m.mu.Lock()
	m.e2e.observe(e2e.Seconds())
	m.mu.Unlock()
}

// snapshot copies the metrics.
func (m *metrics) snapshot() (ttft, itl, e2e histogram, promptTokens int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	cp := func(h histogram) histogram {
		h.counts = append([]uint64(nil), h.counts...)
		return h
	}
	return cp(m.ttft), cp(m.itl), cp(m.e2e), m.promptTokens
}

func (e *Engine) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	bw := bufio.NewWriter(w)
	e.writeMetrics(bw)
	_ = bw.Flush()
}

// writeMetrics writes every series in the text exposition format.
func (e *Engine) writeMetrics(w io.Writer) {
	st := e.Stats()
	ttft, itl, e2e, promptTokens := e.met.snapshot()
	model := `model_name="` + escapeLabel(e.cfg.Model) + `"`
	p := expo{w: w}

	p.family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
	p.sample("vllm:num_requests_running", model, float64(st.Running))
	p.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
	p.sample("vllm:num_requests_waiting", model, float64(st.Waiting))
	p.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
	p.sample("vllm:kv_cache_usage_perc", model, st.KVUsage)
	p.family("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage (older name of vllm:kv_cache_usage_perc).")
	p.sample("vllm:gpu_cache_usage_perc", model, st.KVUsage)

	p.family("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.")
	p.sample("vllm:prefix_cache_queries_total", model, float64(st.PrefixCacheQueries))
	p.family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.")
	p.sample("vllm:prefix_cache_hits_total", model, float64(st.PrefixCacheHits))
	p.family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.")
	p.sample("vllm:num_preemptions_total", model, float64(st.Preemptions))
	p.family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
	p.sample("vllm:prompt_tokens_total", model, float64(promptTokens))
	p.family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
	p.sample("vllm:generation_tokens_total", model, float64(st.GenerationTokens))
	p.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
	for _, r := range []struct {
		reason string
		n      int64
	}{{"abort", st.Cancelled}, {"length", st.Finished}, {"stop", 0}} {
		p.sample("vllm:request_success_total", `finished_reason="`+r.reason+`",`+model, float64(r.n))
	}

	p.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.")
	p.sample("vllm:cache_config_info", fmt.Sprintf(`block_size="%d",enable_prefix_caching="True",%s,num_gpu_blocks="%d"`,
		e.cfg.Replica.BlockSize, model, st.TotalBlocks), 1)

	if len(e.cfg.LoRAModules) > 0 {
		// vLLM with --enable-lora: one series per label set, set to the
		// time it was last seen (vllm/v1/metrics/loggers.py,
		// PrometheusStatLogger.record, gauge_lora_info
		// .set_to_current_time(); vllm-project/vllm @
		// 005a810bc40faa25b8870fbc8559c3462581eee3). Only the current one
		// is written: readers take the newest series (upstream.LoRAInfo).
		e.statsMu.Lock()
		l := e.lora
		e.statsMu.Unlock()
		p.family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
		p.sample("vllm:lora_requests_info", fmt.Sprintf(`max_lora="%d",waiting_lora_adapters="%s",running_lora_adapters="%s"`,
			e.cfg.Replica.MaxLoras, escapeLabel(strings.Join(l.waiting, ",")), escapeLabel(strings.Join(l.running, ","))),
			float64(l.at.UnixNano())/1e9)
	}

	p.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", model, &ttft)
	p.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", model, &itl)
	p.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", model, &e2e)

	// P/D (pd.go): what this engine pulled as a decode engine, in real
	// (scaled) time like the latencies above.
	ps := e.met.pullSnapshot()
	p.family("prefixlb_engine_kv_pull_total", "counter", "Pulls of a prefill engine's KV completed by decode legs.")
	p.sample("prefixlb_engine_kv_pull_total", model, float64(ps.n))
	p.family("prefixlb_engine_kv_pull_blocks_total", "counter", "KV blocks pulled: those of the prompt this engine did not cache.")
	p.sample("prefixlb_engine_kv_pull_blocks_total", model, float64(ps.blocks))
	p.family("prefixlb_engine_kv_pull_bytes_total", "counter", "KV bytes pulled: blocks x block size x the profile's KV bytes per token.")
	p.sample("prefixlb_engine_kv_pull_bytes_total", model, ps.bytes)
	p.family("prefixlb_engine_kv_pull_recomputed_total", "counter", "Decode legs (do_remote_prefill) served without a pull: no remote_engine_id or remote blocks, or no KV size in the profile.")
	p.sample("prefixlb_engine_kv_pull_recomputed_total", model, float64(ps.recomputed))
	p.histogram("prefixlb_engine_kv_pull_seconds", "Histogram of a pull's modelled duration over the engine's link (latency plus bytes at its share of the bandwidth), in seconds.", model, &ps.seconds)
}

// expo writes the text exposition format.
type expo struct{ w io.Writer }

func (p expo) family(name, typ, help string) {
	fmt.Fprintf(p.w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}

func (p expo) sample(name, labels string, v float64) {
	fmt.Fprintf(p.w, "%s{%s} %s\n", name, labels, formatFloat(v))
}

func (p expo) histogram(name, help, labels string, h *histogram) {
	p.family(name, "histogram", help)
	var cum uint64
	for i, b := range h.bounds {
		cum += h.counts[i]
		fmt.Fprintf(p.w, "%s_bucket{%s,le=\"%s\"} %d\n", name, labels, formatFloat(b), cum)
	}
	fmt.Fprintf(p.w, "%s_bucket{%s,le=\"+Inf\"} %d\n", name, labels, h.n)
	fmt.Fprintf(p.w, "%s_sum{%s} %s\n", name, labels, formatFloat(h.sum))
	fmt.Fprintf(p.w, "%s_count{%s} %d\n", name, labels, h.n)
}

// formatFloat formats a sample value as client_golang does.
func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

// labelEscaper escapes a label value for the text format.
var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// escapeLabel escapes a label value for the text format.
func escapeLabel(s string) string { return labelEscaper.Replace(s) }
