package upstream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"

	dto "github.com/prometheus/client_model/go"
)

// Where a replica's KV capacity came from (Capacity.Source). The engine's
// own figures take precedence over the profile's, which is the fallback:
// the metrics page (read on every scrape) first, then what the engine
// answered at detection (/get_server_info, /props).
const (
	// SourceVLLMMetrics: vllm:cache_config_info's num_gpu_blocks ×
	// block_size (vLLM, and prefixlb engine, which models it).
	SourceVLLMMetrics = "engine:vllm-metrics"
	// SourceSGLangMetrics: sglang:max_total_num_tokens.
	SourceSGLangMetrics = "engine:sglang-metrics"
	// SourceSGLangServerInfo: GET /get_server_info's max_total_num_tokens.
	SourceSGLangServerInfo = "engine:sglang-server-info"
	// SourceLlamaCppProps: GET /props, default_generation_settings.n_ctx
	// (one slot's context) × total_slots.
	SourceLlamaCppProps = "engine:llamacpp-props"
	// SourceLlamaCppSlots: GET /slots, the sum of the slots' n_ctx (a
	// /props without total_slots).
	SourceLlamaCppSlots = "engine:llamacpp-slots"
	// SourceProfile: the replica's cost profile (costmodel.Profile's
	// KVCapacity): the engine said nothing.
	SourceProfile = "profile"
)

// Capacity is a replica's KV cache size as its engine reports it.
type Capacity struct {
	// Tokens is the cache's size in tokens (0: unknown).
	Tokens int
	// Source says where it was read (SourceVLLMMetrics, ...; "" unknown).
	Source string
}

// Known reports whether c holds a figure.
func (c Capacity) Known() bool { return c.Tokens > 0 }

// maxCapacityTokens bounds a capacity read from a replica: 2^40 tokens is
// far beyond any GPU's KV cache, and keeps products of two labels finite.
const maxCapacityTokens = 1 << 40

// ErrNoCapacity is returned by the parsers for an answer that says no
// capacity.
var ErrNoCapacity = errors.New("no kv capacity in answer")

// vllmCapacity reads vllm:cache_config_info: an info gauge (value 1) whose
// labels are vLLM's CacheConfig.metrics_info(), num_gpu_blocks and
// block_size among them, one series per engine of a data-parallel replica
// (vllm/v1/metrics/loggers.py, PrometheusStatLogger.log_engine_initialized
// → log_metrics_info("cache_config", ...), at vllm-project/vllm
// 005a810bc40faa25b8870fbc8559c3462581eee3). The capacity is the sum over
// series, by distinct engine label, of num_gpu_blocks × block_size tokens.
// A series whose labels are missing or not positive integers (vLLM writes
// "None" before the blocks are known) counts nothing.
func vllmCapacity(fams map[string]*dto.MetricFamily) (int, bool) {
	f, ok := fams["vllm:cache_config_info"]
	if !ok {
		return 0, false
	}
	seen := make(map[string]bool)
	total := 0
	for _, m := range f.GetMetric() {
		var blocks, size int
		engine := ""
		for _, lp := range m.GetLabel() {
			switch lp.GetName() {
			case "num_gpu_blocks":
				blocks = positiveInt(lp.GetValue())
			case "block_size":
				size = positiveInt(lp.GetValue())
			case "engine":
				engine = lp.GetValue()
			}
		}
		if blocks == 0 || size == 0 || seen[engine] {
			continue
		}
		seen[engine] = true
		total = min(total+min(blocks*size, maxCapacityTokens), maxCapacityTokens)
	}
	return total, total > 0
}

// positiveInt parses s as a positive integer at most maxCapacityTokens; 0
// for anything else.
func positiveInt(s string) int {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 {
		return 0
	}
	return int(min(n, maxCapacityTokens))
}

// sglangCapacity reads sglang:max_total_num_tokens, "Maximum total number
// of tokens in the KV cache pool" (python/sglang/srt/metrics/collector.py,
// SchedulerMetricsCollector, at sgl-project/sglang
// 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538), summed over series (one per
// data-parallel rank).
func sglangCapacity(fams map[string]*dto.MetricFamily) (int, bool) {
	f, ok := fams["sglang:max_total_num_tokens"]
	if !ok {
		return 0, false
	}
	total := 0.0
	for _, m := range f.GetMetric() {
		var v float64
		switch {
		case m.Gauge != nil:
			v = m.GetGauge().GetValue()
		case m.Untyped != nil:
			v = m.GetUntyped().GetValue()
		default:
			continue
		}
		if math.IsNaN(v) || v < 1 {
			continue
		}
		total += min(v, maxCapacityTokens)
	}
	if total < 1 {
		return 0, false
	}
	return int(min(total, maxCapacityTokens)), true
}

// ParseSGLangServerInfo reads SGLang's GET /get_server_info: its server
// arguments, its scheduler's info and its version in one object
// (python/sglang/srt/entrypoints/http_server.py, get_server_info, at
// sgl-project/sglang 0025436eab0556737d615b36a4dd3e1e26e82f3d). The
// capacity is max_total_num_tokens, the token pool of one scheduler (the
// scheduler_info of the first data-parallel rank), times dp_size, rounded
// down to whole pages of page_size tokens.
func ParseSGLangServerInfo(r io.Reader) (int, error) {
	var info struct {
		MaxTotal *float64 `json:"max_total_num_tokens"`
		PageSize *float64 `json:"page_size"`
		DPSize   *float64 `json:"dp_size"`
	}
	if err := json.NewDecoder(r).Decode(&info); err != nil {
		return 0, fmt.Errorf("sglang server info: %w", err)
	}
	if info.MaxTotal == nil || math.IsNaN(*info.MaxTotal) || *info.MaxTotal < 1 {
		return 0, fmt.Errorf("sglang server info: %w (max_total_num_tokens)", ErrNoCapacity)
	}
	tokens := min(*info.MaxTotal, maxCapacityTokens)
	if info.PageSize != nil && *info.PageSize >= 1 && *info.PageSize <= tokens {
		page := math.Floor(*info.PageSize)
		tokens = math.Floor(tokens/page) * page
	}
	if info.DPSize != nil && *info.DPSize > 1 {
		tokens *= math.Floor(min(*info.DPSize, 1<<16))
	}
	return int(min(tokens, maxCapacityTokens)), nil
}

// llamaProps is what the capacity reads of llama.cpp's GET /props.
type llamaProps struct {
	Default struct {
		NCtx *float64 `json:"n_ctx"`
	} `json:"default_generation_settings"`
	TotalSlots *float64 `json:"total_slots"`
}

// ParseLlamaProps reads llama.cpp's GET /props: default_generation_settings
// is slot 0's state, whose n_ctx is one slot's context, the server's -c
// divided by its -np (n_ctx_slot = n_ctx / n_parallel), and total_slots is
// -np (examples/server/server.cpp, server_context::init and
// handle_props, at ggerganov/llama.cpp
// c392e5094deaf2d1a7c18683214f007fad3fe42b). The capacity is n_ctx ×
// total_slots; slots is 0 when /props does not say total_slots, and the
// capacity is then unknown.
func ParseLlamaProps(r io.Reader) (tokens, slotCtx, slots int, err error) {
	var p llamaProps
	if err := json.NewDecoder(r).Decode(&p); err != nil {
		return 0, 0, 0, fmt.Errorf("llama.cpp props: %w", err)
	}
	return p.capacity()
}

func (p *llamaProps) capacity() (tokens, slotCtx, slots int, err error) {
	if p.Default.NCtx == nil || math.IsNaN(*p.Default.NCtx) || *p.Default.NCtx < 1 {
		return 0, 0, 0, fmt.Errorf("llama.cpp props: %w (default_generation_settings.n_ctx)", ErrNoCapacity)
	}
	slotCtx = int(min(*p.Default.NCtx, maxCapacityTokens))
	if p.TotalSlots == nil || math.IsNaN(*p.TotalSlots) || *p.TotalSlots < 1 {
		return 0, slotCtx, 0, fmt.Errorf("llama.cpp props: %w (total_slots)", ErrNoCapacity)
	}
	slots = int(min(*p.TotalSlots, maxCacheSlots))
	return min(slotCtx*slots, maxCapacityTokens), slotCtx, slots, nil
}

// ParseLlamaSlots reads llama.cpp's GET /slots (served with --slots): one
// object per slot, each with its n_ctx. The capacity is their sum.
func ParseLlamaSlots(r io.Reader) (int, error) {
	var slots []struct {
		NCtx *float64 `json:"n_ctx"`
	}
	if err := json.NewDecoder(r).Decode(&slots); err != nil {
		return 0, fmt.Errorf("llama.cpp slots: %w", err)
	}
	total := 0.0
	for i, s := range slots {
		if i >= maxCacheSlots {
			break
		}
		if s.NCtx == nil || math.IsNaN(*s.NCtx) || *s.NCtx < 1 {
			return 0, fmt.Errorf("llama.cpp slots: %w (slot %d n_ctx)", ErrNoCapacity, i)
		}
		total += min(*s.NCtx, maxCapacityTokens)
	}
	if total < 1 {
		return 0, fmt.Errorf("llama.cpp slots: %w (no slots)", ErrNoCapacity)
	}
	return int(min(total, maxCapacityTokens)), nil
}

// FetchCapacity asks the engine of kind at baseURL for its KV capacity
// where it serves it outside its metrics page: SGLang's GET
// /get_server_info (then /server_info, its older name), llama.cpp's GET
// /props (then /slots). Other kinds say it on their metrics page
// (ParseLoad), or not at all: their Capacity is unknown with a nil error.
// client (nil: http.DefaultClient) should bound each request with its
// Timeout.
func FetchCapacity(ctx context.Context, client *http.Client, baseURL string, kind Kind) (Capacity, error) {
	if client == nil {
		client = http.DefaultClient
	}
	base, err := url.Parse(baseURL)
	if err != nil {
		return Capacity{}, fmt.Errorf("upstream: kv capacity: replica URL: %w", err)
	}
	d := detector{ctx: ctx, client: client, base: base}
	switch kind {
	case SGLang:
		return d.sglangCapacity()
	case LlamaCpp:
		return d.llamaCapacity()
	}
	return Capacity{}, nil
}

// sglangCapacity GETs /get_server_info, then /server_info.
func (d *detector) sglangCapacity() (Capacity, error) {
	var lastErr error
	for _, p := range []string{"/get_server_info", "/server_info"} {
		var n int
		var perr error
		if d.get(d.path(p), func(r io.Reader) { n, perr = ParseSGLangServerInfo(io.LimitReader(r, maxDetectBytes)) }) {
			if perr == nil {
				return Capacity{Tokens: n, Source: SourceSGLangServerInfo}, nil
			}
			lastErr = perr
		}
	}
	if lastErr == nil {
		lastErr = d.noAnswer("sglang server info")
	}
	return Capacity{}, fmt.Errorf("upstream: kv capacity at %s: %w", d.base, lastErr)
}

// llamaCapacity GETs /props (the one detection read, when it did), then
// /slots.
func (d *detector) llamaCapacity() (Capacity, error) {
	props, err := d.llamaProps()
	if err == nil {
		n, _, _, perr := props.capacity()
		if perr == nil {
			return Capacity{Tokens: n, Source: SourceLlamaCppProps}, nil
		}
		err = perr
	}
	var n int
	var serr error
	if d.get(d.path("/slots"), func(r io.Reader) { n, serr = ParseLlamaSlots(io.LimitReader(r, maxDetectBytes)) }) && serr == nil {
		return Capacity{Tokens: n, Source: SourceLlamaCppSlots}, nil
	}
	return Capacity{}, fmt.Errorf("upstream: kv capacity at %s: %w", d.base, err)
}

// llamaProps reads /props once per detector.
func (d *detector) llamaProps() (*llamaProps, error) {
	if d.propsMap(); d.props == nil {
		return nil, d.noAnswer("llama.cpp props")
	}
	return d.props, nil
}

// noAnswer is the error of a GET that got no usable answer: it wraps
// ErrNoAnswer when no request got an HTTP answer at all.
func (d *detector) noAnswer(what string) error {
	if !d.answered {
		return fmt.Errorf("%s: %w: %w", what, ErrNoAnswer, d.lastErr)
	}
	return fmt.Errorf("%s: %w", what, ErrNoCapacity)
}
