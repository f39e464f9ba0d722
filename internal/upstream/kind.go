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
	"strings"
)

// Kind is the inference engine behind a replica. It decides how the
// router reads the replica's cache: vLLM and SGLang keep a block cache and
// report cached prompt tokens in usage.prompt_tokens_details; llama.cpp's
// llama-server keeps one prompt per slot (-np slots), publishes no KV
// events and reports its cache in a timings object (cached =
// usage.prompt_tokens − timings.prompt_n).
type Kind string

// Backend kinds. Auto is a setting, never a replica's kind: the
// replica's kind is detected (Detect) at start and whenever it is
// re-admitted. Unknown is what detection found when nothing said
// which engine it is: such a replica is treated as before kinds existed (a
// block cache, vLLM's /tokenize).
const (
	Auto     Kind = "auto"
	VLLM     Kind = "vllm"
	SGLang   Kind = "sglang"
	LlamaCpp Kind = "llamacpp"
	Unknown  Kind = "unknown"
)

// ErrKind is wrapped by ParseKind's error for a kind it does
// not know.
var ErrKind = errors.New("unknown backend kind")

// ParseKind reads a kind setting: "auto" (or ""), "vllm", "sglang"
// or "llamacpp".
func ParseKind(s string) (Kind, error) {
	switch k := Kind(strings.TrimSpace(s)); k {
	case "", Auto:
		return Auto, nil
	case VLLM, SGLang, LlamaCpp:
		return k, nil
	}
	return "", fmt.Errorf("%w %q (want auto, vllm, sglang or llamacpp)", ErrKind, s)
}

// SlotCache reports whether the engine keeps its prefix cache in prompt
// slots (llama.cpp) rather than in blocks.
func (k Kind) SlotCache() bool { return k == LlamaCpp }

// Metric-name prefixes of the engines' Prometheus pages.
var metricPrefixes = []struct {
	prefix string
	kind   Kind
}{
	{"llamacpp:", LlamaCpp},
	{"vllm:", VLLM},
	{"sglang:", SGLang},
}

// llamaCppServer is the Server header llama-server sends on every answer
// (server.cpp: set_default_headers).
const llamaCppServer = "llama.cpp"

// Detection is what Detect learned about a replica.
type Detection struct {
	// Kind is the replica's engine (Unknown when nothing said).
	Kind Kind
	// Slots is a slot cache's number of slots (llama.cpp's /props
	// total_slots, its -np; else the length of its /slots list); 0 for a
	// block cache, or when the replica did not say.
	Slots int
	// Via names the evidence: "metrics", "props", "models", "header" or
	// "configured".
	Via string
	// Capacity is the KV capacity the engine answered outside its metrics
	// page (FetchCapacity: SGLang's /get_server_info, llama.cpp's /props);
	// unknown for other kinds, or when it did not say.
	Capacity Capacity
}

// maxDetectBytes bounds each answer read during detection (a /slots list
// holds every slot's prompt).
const maxDetectBytes = 16 << 20

// maxCacheSlots caps the slot count read from a replica: the bound of
// router.SetCacheSlots (llama.cpp's -np is a handful).
const maxCacheSlots = 256

// Detect finds which engine serves at baseURL (the replica's
// OpenAI server, "http://10.0.0.1:8080"), with client (nil:
// http.DefaultClient, whose Timeout should bound each request). With kind
// Auto (or "") it reads, in order and stopping at the first that
// says: the metric names of metricsURL ("": not read; prefixes llamacpp:,
// vllm:, sglang:), GET /props (llama.cpp's, with total_slots), the owned_by
// of GET /v1/models ("llamacpp", "vllm", "sglang"), and the Server header
// of any of those answers ("llama.cpp"). With a configured kind it only
// reads what that kind needs: a llama.cpp replica's slot count from /props
// (else /slots). These are a few GETs, meant for start and re-admission,
// not for every request.
//
// The error wraps ErrNoAnswer when no request got an HTTP answer at all
// (worth trying again later); Kind is then Unknown (or the
// configured kind). A replica that answered but said nothing is
// Unknown with a nil error.
func Detect(ctx context.Context, client *http.Client, baseURL, metricsURL string, kind Kind) (Detection, error) {
	if client == nil {
		client = http.DefaultClient
	}
	base, err := url.Parse(baseURL)
	if err != nil {
		return Detection{Kind: Unknown}, fmt.Errorf("upstream: detect backend: replica URL: %w", err)
	}
	d := detector{ctx: ctx, client: client, base: base}
	switch kind {
	case VLLM:
		return Detection{Kind: kind, Via: "configured"}, nil
	case SGLang:
		c, err := d.sglangCapacity()
		if errors.Is(err, ErrNoAnswer) {
			return Detection{Kind: kind, Via: "configured"}, err
		}
		return Detection{Kind: kind, Via: "configured", Capacity: c}, nil
	case LlamaCpp:
		slots, err := d.llamaSlots()
		c, _ := d.llamaCapacity()
		return Detection{Kind: kind, Slots: slots, Via: "configured", Capacity: c}, err
	case "", Auto:
	default:
		return Detection{Kind: Unknown}, fmt.Errorf("upstream: detect backend: %w %q", ErrKind, kind)
	}
	found := func(k Kind, via string) (Detection, error) {
		out := Detection{Kind: k, Via: via}
		if k.SlotCache() {
			out.Slots, _ = d.llamaSlots() // a failure leaves the slots unknown (0)
		}
		// A failure leaves the capacity unknown: the profile's is used.
		switch k {
		case LlamaCpp:
			out.Capacity, _ = d.llamaCapacity()
		case SGLang:
			out.Capacity, _ = d.sglangCapacity()
		}
		return out, nil
	}
	if metricsURL != "" {
		if mu, err := url.Parse(metricsURL); err == nil {
			var k Kind
			d.get(mu, func(r io.Reader) {
				if l, err := ParseLoad(io.LimitReader(r, MaxScrapeBytes)); err == nil {
					k = l.Kind
				}
			})
			if k != "" {
				return found(k, "metrics")
			}
		}
	}
	if n, ok := slotCount(d.propsMap()["total_slots"]); ok {
		d.slots, d.slotsKnown = n, true
		return found(LlamaCpp, "props")
	}
	var models struct {
		Data []struct {
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	d.get(d.path("/v1/models"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&models) })
	for _, m := range models.Data {
		switch k := Kind(strings.ToLower(m.OwnedBy)); k {
		case LlamaCpp, VLLM, SGLang:
			return found(k, "models")
		}
	}
	if d.llamaHeader {
		return found(LlamaCpp, "header")
	}
	if !d.answered {
		return Detection{Kind: Unknown}, fmt.Errorf("upstream: detect backend at %s: %w: %w", baseURL, ErrNoAnswer, d.lastErr)
	}
	return Detection{Kind: Unknown}, nil
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
	// propsRead: GET /props was asked (once per detector); propsRaw and
	// props are its answer (nil: none, or not JSON).
	propsRead bool
	propsRaw  map[string]json.RawMessage
	props     *llamaProps
}

// propsMap GETs /props once and returns its top-level fields (nil when
// it got no JSON answer).
func (d *detector) propsMap() map[string]json.RawMessage {
	if d.propsRead {
		return d.propsRaw
	}
	d.propsRead = true
	d.get(d.path("/props"), func(r io.Reader) {
		b, err := io.ReadAll(io.LimitReader(r, maxDetectBytes))
		if err != nil {
			return
		}
		var raw map[string]json.RawMessage
		var p llamaProps
		if json.Unmarshal(b, &raw) == nil && json.Unmarshal(b, &p) == nil {
			d.propsRaw, d.props = raw, &p
		}
	})
	return d.propsRaw
}

// path is the URL of path under the replica's base URL.
func (d *detector) path(p string) *url.URL {
	u := *d.base
	u.Path = TrimSlash(u.Path) + p
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
	if n, ok := slotCount(d.propsMap()["total_slots"]); ok {
		return n, nil
	}
	var slots []json.RawMessage
	if d.get(d.path("/slots"), func(r io.Reader) { _ = json.NewDecoder(io.LimitReader(r, maxDetectBytes)).Decode(&slots) }) && len(slots) > 0 {
		return min(len(slots), maxCacheSlots), nil
	}
	if !d.answered {
		return 0, fmt.Errorf("upstream: llama.cpp slots at %s: %w: %w", d.base, ErrNoAnswer, d.lastErr)
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
