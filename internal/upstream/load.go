package upstream

import (
	"context"
	"fmt"
	dto "github.com/prometheus/client_model/go"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// TrimSlash drops a trailing "/".
func TrimSlash(s string) string {
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
	Kind Kind
	// LoRA is vLLM's vllm:lora_requests_info (nil: the page has none): the
	// adapters running and waiting on the replica, and its max_loras.
	LoRA *LoRAInfo
	// Capacity is the KV cache size the page states: vLLM's
	// vllm:cache_config_info (num_gpu_blocks × block_size) or SGLang's
	// sglang:max_total_num_tokens; unknown when it states neither
	// (llama.cpp's page does not: FetchCapacity reads its /props).
	Capacity Capacity
}

// LoRAInfo is a replica's LoRA adapters as vLLM reports them: the series of
// vllm:lora_requests_info with the latest value (vLLM sets a series per
// label set to the time it was seen; GIE's picker reads the newest the
// same way), its labels running_lora_adapters and waiting_lora_adapters
// (comma-separated) and max_lora.
type LoRAInfo struct {
	Running, Waiting []string
	MaxLoRAs         int
}

// maxLoadCount caps the request counts read from a replica's metrics.
const maxLoadCount = 1 << 30

// UnknownLoad is a Load with nothing known.
var UnknownLoad = Load{Waiting: -1, Running: -1, KVUsage: -1, KVTokens: -1}

// Metric names of the engines' load gauges (INTERFACES.md §2; llama.cpp:
// examples/server/server.cpp, handle_metrics, at commit c392e50).
var (
	runningNames = []string{"vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"}
	waitingNames = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"}
	kvNames      = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage", "llamacpp:kv_cache_usage_ratio"}
	kvTokenNames = []string{"llamacpp:kv_cache_tokens"}
)

// ParseLoad reads vLLM's, SGLang's or llama.cpp's Prometheus text
// exposition. Counts are summed over series (engines of a data-parallel
// replica); KV usage is the mean over series. Metrics it does not find stay
// unknown. The page's engine is the one most of its metric families name.
func ParseLoad(r io.Reader) (Load, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return UnknownLoad, fmt.Errorf("parse metrics: %w", err)
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
	l := UnknownLoad
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
	l.LoRA = loraInfo(fams)
	if n, ok := vllmCapacity(fams); ok {
		l.Capacity = Capacity{Tokens: n, Source: SourceVLLMMetrics}
	} else if n, ok := sglangCapacity(fams); ok {
		l.Capacity = Capacity{Tokens: n, Source: SourceSGLangMetrics}
	}
	return l, nil
}

// pageKind is the engine most of a metrics page's families are named for
// ("" none; a tie goes to the first of llamacpp, vllm, sglang).
func pageKind[V any](fams map[string]V) Kind {
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

// MaxScrapeBytes bounds a replica's /metrics page (vLLM's is ~100 KiB).
const MaxScrapeBytes = 16 << 20

// FetchLoad GETs a replica's Prometheus page at url with client (whose
// Timeout bounds it) and reads it with ParseLoad. On any failure the Load
// is UnknownLoad and the error says why.
func FetchLoad(ctx context.Context, client *http.Client, url string) (Load, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return UnknownLoad, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4, */*")
	resp, err := client.Do(req)
	if err != nil {
		return UnknownLoad, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return UnknownLoad, fmt.Errorf("upstream: scrape %s: status %d", url, resp.StatusCode)
	}
	l, err := ParseLoad(io.LimitReader(resp.Body, MaxScrapeBytes))
	if err != nil {
		return UnknownLoad, fmt.Errorf("upstream: scrape %s: %w", url, err)
	}
	return l, nil
}

// loraInfo reads vllm:lora_requests_info's newest series (nil: none).
func loraInfo(fams map[string]*dto.MetricFamily) *LoRAInfo {
	f, ok := fams["vllm:lora_requests_info"]
	if !ok {
		return nil
	}
	var best *dto.Metric
	for _, m := range f.GetMetric() {
		v := m.GetGauge().GetValue()
		if m.Gauge == nil || math.IsNaN(v) {
			continue
		}
		if best == nil || v > best.GetGauge().GetValue() {
			best = m
		}
	}
	if best == nil {
		return nil
	}
	info := &LoRAInfo{}
	split := func(s string) []string {
		var out []string
		for a := range strings.SplitSeq(s, ",") {
			if a = strings.TrimSpace(a); a != "" {
				out = append(out, a)
			}
		}
		return out
	}
	for _, lp := range best.GetLabel() {
		switch lp.GetName() {
		case "running_lora_adapters":
			info.Running = split(lp.GetValue())
		case "waiting_lora_adapters":
			info.Waiting = split(lp.GetValue())
		case "max_lora":
			if n, err := strconv.Atoi(lp.GetValue()); err == nil && n >= 0 {
				info.MaxLoRAs = min(n, maxLoadCount)
			}
		}
	}
	return info
}
