package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"strings"
)

// BackendKind is the inference engine behind a replica. It decides how the
// router reads the replica's cache: vLLM and SGLang keep a block cache and
// report cached prompt tokens in usage.prompt_tokens_details; llama.cpp's
// llama-server keeps one prompt per slot (-np slots), publishes no KV
// events and reports its cache in a timings object (cached =
// usage.prompt_tokens − timings.prompt_n).
type BackendKind string

// Backend kinds. BackendAuto is a setting, never a replica's kind: the
// replica's kind is detected (DetectBackend) at start and whenever it is
// re-admitted. BackendUnknown is what detection found when nothing said
// which engine it is: such a replica is treated as before kinds existed (a
// block cache, vLLM's /tokenize).
const (
	BackendAuto     BackendKind = "auto"
	BackendVLLM     BackendKind = "vllm"
	BackendSGLang   BackendKind = "sglang"
	BackendLlamaCpp BackendKind = "llamacpp"
	BackendUnknown  BackendKind = "unknown"
)

// ErrBackendKind is wrapped by ParseBackendKind's error for a kind it does
// not know.
var ErrBackendKind = errors.New("unknown backend kind")

// ParseBackendKind reads a kind setting: "auto" (or ""), "vllm", "sglang"
// or "llamacpp".
func ParseBackendKind(s string) (BackendKind, error) {
	switch k := BackendKind(strings.TrimSpace(s)); k {
	case "", BackendAuto:
		return BackendAuto, nil
	case BackendVLLM, BackendSGLang, BackendLlamaCpp:
		return k, nil
	}
	return "", fmt.Errorf("%w %q (want auto, vllm, sglang or llamacpp)", ErrBackendKind, s)
}

// slotCache reports whether the engine keeps its prefix cache in prompt
// slots (llama.cpp) rather than in blocks.
func (k BackendKind) slotCache() bool { return k == BackendLlamaCpp }

// Metric-name prefixes of the engines' Prometheus pages.
var metricPrefixes = []struct {
	prefix string
	kind   BackendKind
}{
	{"llamacpp:", BackendLlamaCpp},
	{"vllm:", BackendVLLM},
	{"sglang:", BackendSGLang},
}

// llamaCppServer is the Server header llama-server sends on every answer
// (server.cpp: set_default_headers).
const llamaCppServer = "llama.cpp"

// Detection is what DetectBackend learned about a replica.
type Detection struct {
	// Kind is the replica's engine (BackendUnknown when nothing said).
	Kind BackendKind
	// Slots is a slot cache's number of slots (llama.cpp's /props
	// total_slots, its -np; else the length of its /slots list); 0 for a
	// block cache, or when the replica did not say.
	Slots int
	// Via names the evidence: "metrics", "props", "models", "header" or
	// "configured".
	Via string
}

// maxDetectBytes bounds each answer read during detection (a /slots list
// holds every slot's prompt).
const maxDetectBytes = 16 << 20

// maxCacheSlots caps the slot count read from a replica: the bound of
// router.SetCacheSlots (llama.cpp's -np is a handful).
const maxCacheSlots = 256

// DetectBackend finds which engine serves at baseURL (the replica's
// OpenAI server, "http://10.0.0.1:8080"), with client (nil:
// http.DefaultClient, whose Timeout should bound each request). With kind
// BackendAuto (or "") it reads, in order and stopping at the first that
// says: the metric names of metricsURL ("": not read; prefixes llamacpp:,
// vllm:, sglang:), GET /props (llama.cpp's, with total_slots), the owned_by
// of GET /v1/models ("llamacpp", "vllm", "sglang"), and the Server header
// of any of those answers ("llama.cpp"). With a configured kind it only
// reads what that kind needs: a llama.cpp replica's slot count from /props
// (else /slots). These are a few GETs, meant for start and re-admission,
// not for every request.
//
// The error wraps ErrNoAnswer when no request got an HTTP answer at all
// (worth trying again later); Kind is then BackendUnknown (or the
// configured kind). A replica that answered but said nothing is
// BackendUnknown with a nil error.
func DetectBackend(ctx context.Context, client *http.Client, baseURL, metricsURL string, kind BackendKind) (Detection, error) {
	if client == nil {
		client = http.DefaultClient
	}
	base, err := url.Parse(baseURL)
	if err != nil {
		return Detection{Kind: BackendUnknown}, fmt.Errorf("proxy: detect backend: replica URL: %w", err)
	}
	d := detector{ctx: ctx, client: client, base: base}
	switch kind {
	case BackendVLLM, BackendSGLang:
		return Detection{Kind: kind, Via: "configured"}, nil
	case BackendLlamaCpp:
		slots, err := d.llamaSlots()
		return Detection{Kind: kind, Slots: slots, Via: "configured"}, err
	case "", BackendAuto:
	default:
		return Detection{Kind: BackendUnknown}, fmt.Errorf("proxy: detect backend: %w %q", ErrBackendKind, kind)
	}
	found := func(k BackendKind, via string) (Detection, error) {
		out := Detection{Kind: k, Via: via}
		if k.slotCache() {
			out.Slots, _ = d.llamaSlots() // a failure leaves the slots unknown (0)
		}
		return out, nil
	}
	if metricsURL != "" {
		if mu, err := url.Parse(metricsURL); err == nil {
			var k BackendKind
			d.get(mu, func(r io.Reader) {
				if l, err := parseLoad(io.LimitReader(r, maxScrapeBytes)); err == nil {
					k = l.Kind
				}
			})
			if k != "" {
				return found(k, "metrics")
			}
		}
	}
	var props map[string]json.RawMessage
	d.get(d.path("/props"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&props) })
	if n, ok := slotCount(props["total_slots"]); ok {
		d.slots, d.slotsKnown = n, true
		return found(BackendLlamaCpp, "props")
	}
	var models struct {
		Data []struct {
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	d.get(d.path("/v1/models"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&models) })
	for _, m := range models.Data {
		switch k := BackendKind(strings.ToLower(m.OwnedBy)); k {
		case BackendLlamaCpp, BackendVLLM, BackendSGLang:
			return found(k, "models")
		}
	}
	if d.llamaHeader {
		return found(BackendLlamaCpp, "header")
	}
	if !d.answered {
		return Detection{Kind: BackendUnknown}, fmt.Errorf("proxy: detect backend at %s: %w: %w", baseURL, ErrNoAnswer, d.lastErr)
	}
	return Detection{Kind: BackendUnknown}, nil
}

// detector holds one detection's requests and what their answers said.
type detector struct {
	ctx    context.Context
	client *http.Client
	base   *url.URL
	// answered: some request got an HTTP answer; llamaHeader: one carried
	// Server: llama.cpp; lastErr: the last request's transport error.
	answered, llamaHeader bool
	lastErr               error
	// slots, when slotsKnown, is the slot count /props gave already.
	slots      int
	slotsKnown bool
}

// path is the URL of path under the replica's base URL.
func (d *detector) path(p string) *url.URL {
	u := *d.base
	u.Path = trimSlash(u.Path) + p
	u.RawPath = ""
	return &u
}

// get GETs u and hands a 2xx body to read; it records whether an answer
// came and what its Server header said.
func (d *detector) get(u *url.URL, read func(io.Reader)) (ok bool) {
	req, err := http.NewRequestWithContext(d.ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		d.lastErr = err
		return false
	}
	req.Header.Set("Accept", "application/json, text/plain;version=0.0.4, */*")
	resp, err := d.client.Do(req)
	if err != nil {
		d.lastErr = err
		return false
	}
	defer resp.Body.Close()
	d.answered = true
	if strings.EqualFold(strings.TrimSpace(resp.Header.Get("Server")), llamaCppServer) {
		d.llamaHeader = true
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return false
	}
	read(resp.Body)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return true
}

// llamaSlots reads a llama.cpp replica's slot count: /props total_slots,
// else the length of the /slots list (served only with --slots). The error
// wraps ErrNoAnswer when neither got an HTTP answer.
func (d *detector) llamaSlots() (int, error) {
	if d.slotsKnown {
		return d.slots, nil
	}
	var props map[string]json.RawMessage
	d.get(d.path("/props"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&props) })
	if n, ok := slotCount(props["total_slots"]); ok {
		return n, nil
	}
	var slots []json.RawMessage
	if d.get(d.path("/slots"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&slots) }) && len(slots) > 0 {
		return min(len(slots), maxCacheSlots), nil
	}
	if !d.answered {
		return 0, fmt.Errorf("proxy: llama.cpp slots at %s: %w: %w", d.base, ErrNoAnswer, d.lastErr)
	}
	return 0, nil
}

// slotCount reads a positive slot count (a JSON number) capped at maxCacheSlots.
func slotCount(raw json.RawMessage) (int, bool) {
	if len(raw) == 0 {
		return 0, false
	}
	var f float64
	if json.Unmarshal(raw, &f) != nil || math.IsNaN(f) || f < 1 {
		return 0, false
	}
	return int(min(f, maxCacheSlots)), true
}

// markDue makes a detection due, unless the kind is configured and needs
// nothing read (vLLM, SGLang).
func (e *engineState) markDue() {
	e.due = e.configured == BackendAuto || e.configured == BackendLlamaCpp
}

// metricsURL is replica b's Prometheus page ("" when MetricsPath is not a
// path).
func (p *Proxy) metricsURL(b *backend) string {
	if !strings.HasPrefix(p.cfg.MetricsPath, "/") {
		return ""
	}
	u := *b.url
	u.Path = trimSlash(u.Path) + p.cfg.MetricsPath
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
	d, err := DetectBackend(ctx, p.checks, b.url.String(), p.metricsURL(b), e.configured)
	if ctx.Err() != nil {
		return
	}
	if errors.Is(err, ErrNoAnswer) {
		p.log.Debug("backend kind: no answer; trying again after the next health check", "replica", b.name, "err", err)
		return
	}
	if err != nil {
		p.log.Warn("backend kind", "replica", b.name, "err", err)
	}
	slots := 0
	if d.Kind.slotCache() {
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
	if d.Kind.slotCache() && slots == 0 {
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
