package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/tenant"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"sigs.k8s.io/yaml"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// Backend is one replica the proxy forwards to.
type Backend struct {
	// Name identifies the replica in headers, metrics and logs ("" : the
	// URL's host:port).
	Name string `json:"name"`
	// URL is the replica's base URL (http or https, no path needed).
	URL string `json:"url"`
	// KVEvents, when set, is the replica's KV-event PUB socket
	// ("tcp://host:5557", vLLM's --kv-events-config endpoint, or prefixlb
	// engine --kv-events): the proxy subscribes and the router knows the
	// replica's cache from its events instead of mirroring its decisions.
	KVEvents string `json:"kv_events,omitempty"`
	// KVReplay is the replica's replay ROUTER socket ("": KVEvents with
	// port + 1, vLLM's convention).
	KVReplay string `json:"kv_replay,omitempty"`
	// KVTopic is the subscription prefix ("": every topic).
	KVTopic string `json:"kv_topic,omitempty"`
	// Kind is the replica's engine: "auto" (detect it at start and on
	// every re-admission), "vllm", "sglang" or "llamacpp" ("":
	// Config.BackendKind). See BackendKind.
	Kind upstream.Kind `json:"kind,omitempty"`
	// Profile is the replica's own cost profile ("": Config.Profile), for
	// a cluster of mixed GPUs: a built-in name or a YAML file, optionally
	// with scaled times (costmodel.Resolve). With Calibrate it is the prior
	// the router corrects from what the replica does.
	Profile string `json:"profile,omitempty"`
	// Role is the replica's role in a disaggregated cluster: "both" (or
	// "", the default: it prefills and decodes its own requests),
	// "prefill" (it only runs the prefill leg of disaggregated requests)
	// or "decode" (docs/pd.md). A cluster with prefill replicas needs a
	// disaggregating policy (e2-pd, llmd-pd, dynamo-pd, round-robin-pd).
	Role string `json:"role,omitempty"`
}

// Config configures a Proxy. DefaultConfig gives every default; a zero
// timeout means "none" unless its comment says otherwise.
type Config struct {
	// Listen is the address `prefixlb serve` listens on (not used by New).
	Listen string
	// Backends are the static replicas, in ID order.
	Backends []Backend
	// Pools, when set, are model pools behind one serve (NewPools): each
	// its own Config, from this one's settings with its own overrides;
	// Backends and Discovery are then each pool's, not this one's.
	Pools []PoolConfig
	// Discovery, when set, is a Kubernetes target, "service:NS/NAME" or
	// "inferencepool:NS/NAME", whose ready endpoints join the replicas as
	// they come, leave as they go and follow their readiness
	// (internal/discovery, as prefixlb epp does), beside Backends or
	// instead of them. Kubeconfig is the cluster's ("": $KUBECONFIG, else
	// the in-cluster config); DiscoveryPorts place each endpoint's OpenAI
	// port, metrics page and KV-event sockets.
	Discovery      string
	Kubeconfig     string
	DiscoveryPorts discovery.Ports
	// KVEventsListen, when set, is where serve binds one ZeroMQ SUB socket
	// for engines that dial the router with their KV events
	// ("tcp://0.0.0.0:5557"; vLLM's ZmqEventPublisher connects when its
	// endpoint is not a wildcard bind, llm-d-inference-sim's
	// --zmq-endpoint): a message whose topic "kv@<host:port>@<model>"
	// names a backend's host:port, or equals its kv_topic, is that
	// backend's, which is mirrored until its first batch arrives
	// (cluster.PoolConfig.KVEventsListen; docs/kv-events.md). Backends
	// with kv_events are dialled as before. Not with pools.
	KVEventsListen string
	// Policy is the routing policy spec (policy.Parse: "e2",
	// "e2-preble:mixing=false", "round-robin", ...).
	Policy string
	// Profile is the cost profile of the backends that name none: a
	// built-in name or a YAML file, optionally with scaled times
	// (costmodel.Resolve: "llama3.1-8b-h100:time_scale=2").
	Profile string
	// Calibrate makes the router learn each replica's real prefill and
	// decode speed from the requests it serves (internal/calibrate: busy
	// periods of first tokens, the median gap between streamed tokens,
	// llama.cpp's timings), its profile being the prior, and price every
	// policy's costs with what it learnt (on by default).
	Calibrate bool
	// Calibration tunes that learning (calibrate.DefaultConfig).
	Calibration calibrate.Config
	// BlockTokens is the tokens one routing key stands for: token-id
	// prompts are keyed in blocks of BlockTokens, text in chunks of
	// 4·BlockTokens bytes (ChunkKeyer).
	BlockTokens int
	// Seed seeds the router's random choices.
	Seed uint64
	// BackendKind is the engine of the backends that do not name one
	// (Backend.Kind; "" or "auto": detected per replica, see
	// DetectBackend). A llama.cpp replica's slot cache is modelled, its
	// cached tokens read from its timings and its tokenizer probed through
	// its own /tokenize.
	BackendKind upstream.Kind

	// ConnectTimeout bounds dialing a replica.
	ConnectTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for a replica's response
	// headers once the request is sent (a non-streamed completion sends
	// them only when it is done).
	ResponseHeaderTimeout time.Duration
	// IdleTimeout bounds the silence between two reads of a response body.
	IdleTimeout time.Duration
	// RequestTimeout bounds a client request as a whole, retries included.
	RequestTimeout time.Duration
	// ReadHeaderTimeout bounds reading a client's request headers (Serve).
	ReadHeaderTimeout time.Duration
	// BodyReadTimeout bounds reading a client's request body, from the end
	// of its headers (0: none). A client that sends its body too slowly
	// (slowloris on the body) gets 408 and its connection closed. Responses
	// are not bounded: a stream may last as long as the replica takes.
	BodyReadTimeout time.Duration
	// ClientIdleTimeout bounds how long a client's keep-alive connection
	// may sit idle between requests before Serve closes it (0: none).
	ClientIdleTimeout time.Duration
	// MaxHeaderBytes bounds a client's request line and headers (Serve;
	// > 0). Larger ones get 431. net/http allows 4 KiB of slack over it.
	MaxHeaderBytes int
	// MaxConcurrent bounds the inference requests (/v1/*, /v1/models
	// aside) in flight at once, streams included (0: no bound). One over it
	// is answered 429 at once, with Retry-After, before its body is read.
	MaxConcurrent int
	// MaxPromptTokens bounds a prompt's length in tokens (> 0): counted for
	// token ids and with a tokenizer, estimated for text chunks (a batch
	// counts all its prompts). A longer prompt gets 400 before it is routed.
	MaxPromptTokens int

	// HealthPath is polled on every replica every HealthInterval (> 0),
	// each poll bounded by HealthTimeout (> 0).
	HealthPath     string
	HealthInterval time.Duration
	HealthTimeout  time.Duration
	// EjectAfter consecutive failed checks take a replica out of routing;
	// ReadmitAfter consecutive good ones bring it back (both ≥ 1).
	EjectAfter, ReadmitAfter int
	// MetricsPath is scraped every ScrapeInterval (0: never) for the
	// replica's load (vLLM's, SGLang's and llama.cpp's gauges); its metric
	// names also tell a replica's backend kind (DetectBackend).
	MetricsPath    string
	ScrapeInterval time.Duration

	// MaxBodyBytes bounds a client request body (> 0).
	MaxBodyBytes int64
	// MaxResponseBytes bounds the part of a non-streamed response the
	// proxy reads to check it and find its usage; a larger response is
	// passed through unchecked, as it arrives (> 0). The default, 1 MiB
	// (epp's ServerConfig.MaxResponseBytes), holds a completion of ~250k
	// tokens of text; what exceeds it (logprobs, large embedding batches)
	// passes through without being held whole.
	MaxResponseBytes int64
	// MaxRetries is how many other replicas a request that failed before
	// any byte reached the client is retried on (≥ 0).
	MaxRetries int
	// AdminToken, when set, is the bearer token /debug/* requires.
	AdminToken string
	// DrainTimeout bounds how long Serve waits for in-flight requests after
	// its context ends.
	DrainTimeout time.Duration
	// SpeculativeTTL is how long a routed prompt counts as cached on a
	// replica with KV events before its events confirm it (0: the router's
	// default, 2s; negative: no speculative entries).
	SpeculativeTTL time.Duration
	// TreeMaxBlocks bounds the router's global prefix tree in blocks (0:
	// prefixtree.DefaultMaxBlocks, 2M); unheld prefixes beyond it are
	// evicted least recently used first. The tree's memory (about 200 bytes
	// of heap a block with KV events, RSS about twice that; docs/performance.md,
	// Memory) grows until it reaches the bound.
	TreeMaxBlocks int

	// IgnoreCacheTiers drops the replicas' KV events of slower cache tiers
	// (CPU offloading, LMCache's disk) instead of pricing those blocks at
	// their load time (docs/kv-events.md, cache tiers).
	IgnoreCacheTiers bool
	// LoRAAdapters are the model names that are LoRA adapters (vLLM's
	// --lora-modules): their requests are keyed from the adapter's seed,
	// so that the router never predicts the base model's or another
	// adapter's cached blocks for them (vLLM hashes the adapter into each
	// block; its KV events name it in lora_name).
	LoRAAdapters []string
	// LoRAAdapterBytes is the size of an adapter's weights, which prices
	// loading one on a replica that lacks it (bytes over the profile's
	// host-to-device bandwidth plus its fixed cost; engine's
	// --lora-adapter-bytes). 0 prices the fixed cost alone.
	LoRAAdapterBytes int64

	// KVLinkGbps and KVLinkLatency are the network between prefill and
	// decode replicas that disaggregating policies price a KV transfer on:
	// each replica's link bandwidth in Gbit/s and one transfer's fixed
	// latency (defaults 400 and 1ms: one ConnectX-7 port, as prefixlb sim).
	KVLinkGbps    float64
	KVLinkLatency time.Duration

	// Queue is the router-side queue (internal/admission through
	// cluster.Gate): on by default, with thresholds that do not engage
	// below saturation; while the pool is saturated requests wait in the
	// router by priority and tenant, and a shed one gets 429 (503 when no
	// replica is up) with Retry-After (docs/overload.md).
	Queue cluster.QueueConfig

	// Tenants are who requests are from and what the router trusts
	// (YAML tenants, trusted_proxies, anonymous_tokens_per_minute,
	// require_tenant; --trusted-proxies): a configured tenant is told by its
	// API key (Authorization: Bearer, or x-api-key), only a peer inside
	// TrustedProxies may set x-prefixlb-tenant, -priority and -ttft-slo
	// (none by default), and a tenant's tokens_per_minute is a token quota
	// answered 429 with Retry-After past it (docs/overload.md, Trusted
	// headers and quotas).
	Tenants tenant.Config
	// FrontDoor bounds what hostile clients and failing replicas can take
	// from the proxy (frontdoor_config.go; docs/security.md).
	FrontDoor
	// PickerConfig, with EndpointPicker set, makes the proxy a data plane
	// for a GIE endpoint picker (gie_config.go; docs/gie.md).
	PickerConfig
	// Explain says which clients get x-prefixlb-route, the decision's
	// explanation (matched tokens per replica: how much of the prompt is
	// cached): tenancy.ExplainTrusted (the default) only requests that
	// present AdminToken (tenancy.TokenHeader or Authorization: Bearer),
	// nobody when it is unset; ExplainNever nobody; ExplainAlways everyone
	// (docs/security.md).
	Explain tenancy.Explain
	// TenantIsolation salts every request with its tenant
	// (cluster.TenantOf; tenancy.Salt): the forwarded body's cache_salt is
	// set to a keyed hash of the tenant and the client's own cache_salt,
	// so that vLLM keeps tenants' prefixes apart and the router's keys use
	// the same salt. Off by default: requests are keyed with the client's
	// cache_salt, if any, and forwarded unchanged.
	TenantIsolation bool
	// TenantSaltSecret keys the tenant salts (tenancy.Salt): the same on
	// every router in front of the same replicas ("": unkeyed, which holds
	// while clients cannot reach the replicas directly).
	TenantSaltSecret string

	// Logger receives the proxy's logs (nil: slog.Default()).
	Logger *slog.Logger
	// Tokenizer, when set and Keyer is nil, is the replicas' tokenizer:
	// "qwen3" (bundled), a tokenizer.json or a model directory
	// (LoadTokenizer). Prompts are then keyed by token ids
	// (TokenizerKeyer), and each replica's /tokenize is probed at start
	// and on re-admission; while any replica disagrees, text and chats
	// fall back to text-chunk keys. "" or "auto": the bundled Qwen3,
	// used once a replica's /tokenize confirms it (text chunks until
	// then); "none": ChunkKeyer.
	Tokenizer string
	// Keyer keys prompts (nil: from Tokenizer, else
	// ChunkKeyer{BlockTokens}). A tokenizer-backed Keyer must produce keys
	// of BlockTokens tokens each; a *TokenizerKeyer is probed as Tokenizer
	// is.
	Keyer keying.Keyer
}

// DefaultConfig returns the defaults: e2 on llama3.1-8b-h100, blocks of 16
// tokens, health checks every 5s, up to 2 retries, 16 MiB bodies read within
// 30s, 64 KiB of headers, prompts of up to 1,048,576 tokens, 4096 requests
// in flight, keep-alive connections closed after 2 minutes idle.
func DefaultConfig() Config {
	return Config{
		Listen:                "127.0.0.1:8080",
		Policy:                "e2",
		Profile:               costmodel.Llama31_8BH100,
		Calibrate:             true,
		Calibration:           calibrate.DefaultConfig(),
		BlockTokens:           blocks.DefaultBlockSize,
		Seed:                  1,
		BackendKind:           upstream.Auto,
		ConnectTimeout:        5 * time.Second,
		ResponseHeaderTimeout: 10 * time.Minute,
		IdleTimeout:           5 * time.Minute,
		RequestTimeout:        0,
		ReadHeaderTimeout:     10 * time.Second,
		BodyReadTimeout:       30 * time.Second,
		ClientIdleTimeout:     2 * time.Minute,
		MaxHeaderBytes:        64 << 10,
		MaxConcurrent:         4096,
		MaxPromptTokens:       1 << 20,
		HealthPath:            "/health",
		HealthInterval:        5 * time.Second,
		HealthTimeout:         2 * time.Second,
		EjectAfter:            3,
		ReadmitAfter:          2,
		MetricsPath:           "/metrics",
		ScrapeInterval:        5 * time.Second,
		MaxBodyBytes:          16 << 20,
		MaxResponseBytes:      1 << 20,
		MaxRetries:            2,
		DrainTimeout:          30 * time.Second,
		KVLinkGbps:            400,
		KVLinkLatency:         time.Millisecond,
		Queue:                 cluster.DefaultQueueConfig(),
		FrontDoor:             DefaultFrontDoor(),
		PickerConfig:          PickerConfig{EndpointPickerTimeout: defaultPickerTimeout},
		Explain:               tenancy.ExplainTrusted,
	}
}

// Validate reports the first invalid field, by its YAML name.
func (c *Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("proxy: config: %s: %s", field, fmt.Sprintf(format, args...))
	}
	if len(c.Backends) == 0 && c.Discovery == "" {
		return bad("backends", "at least one backend (or discovery) is required")
	}
	if c.Discovery != "" {
		if _, _, _, err := discovery.ParseTarget(c.Discovery); err != nil {
			return bad("discovery.target", "%v", err)
		}
	}
	names := map[string]bool{}
	for i, b := range c.Backends {
		u, err := url.Parse(b.URL)
		if err != nil {
			return bad(fmt.Sprintf("backends[%d].url", i), "%v", err)
		}
		if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return bad(fmt.Sprintf("backends[%d].url", i), "%q is not an http(s) URL with a host", b.URL)
		}
		if b.KVEvents != "" {
			if err := checkZMQEndpoint(b.KVEvents); err != nil {
				return bad(fmt.Sprintf("backends[%d].kv_events", i), "%v", err)
			}
			if b.KVReplay == "" {
				if _, err := replayEndpoint(b); err != nil {
					return bad(fmt.Sprintf("backends[%d].kv_replay", i), "%v", err)
				}
			}
		} else if b.KVReplay != "" {
			return bad(fmt.Sprintf("backends[%d].kv_events", i), "kv_replay and kv_topic need kv_events")
		} else if b.KVTopic != "" && c.KVEventsListen == "" {
			return bad(fmt.Sprintf("backends[%d].kv_events", i), "kv_replay and kv_topic need kv_events (kv_topic alone: or kv_events_listen)")
		}
		if b.KVReplay != "" {
			if err := checkZMQEndpoint(b.KVReplay); err != nil {
				return bad(fmt.Sprintf("backends[%d].kv_replay", i), "%v", err)
			}
		}
		if _, err := upstream.ParseKind(string(b.Kind)); err != nil {
			return fmt.Errorf("proxy: config: backends[%d].kind: %w", i, err)
		}
		if _, err := policy.ParseRole(b.Role); err != nil {
			return fmt.Errorf("proxy: config: backends[%d].role: %w", i, err)
		}
		n := backendName(b)
		if names[n] {
			return bad(fmt.Sprintf("backends[%d].name", i), "duplicate backend name %q", n)
		}
		names[n] = true
	}
	if c.KVEventsListen != "" {
		if err := checkZMQListenEndpoint(c.KVEventsListen); err != nil {
			return bad("kv_events_listen", "%v", err)
		}
	}
	if _, err := upstream.ParseKind(string(c.BackendKind)); err != nil {
		return fmt.Errorf("proxy: config: backend_kind: %w", err)
	}
	if c.BlockTokens < 1 {
		return bad("block_tokens", "must be ≥ 1, got %d", c.BlockTokens)
	}
	pol, err := policy.Parse(c.Policy, policyOptions(c))
	if err != nil {
		return bad("policy", "%v", err)
	}
	if prefill, decode := c.roles(); prefill > 0 {
		if d, ok := pol.(policy.Disaggregator); !ok || !d.Disaggregates() {
			return bad("policy", "%s does not disaggregate, and %d backend(s) have role prefill: use e2-pd, llmd-pd, dynamo-pd or round-robin-pd", c.Policy, prefill)
		}
		if decode == 0 {
			return bad("backends", "every backend has role prefill: at least one must decode")
		}
	}
	if c.KVLinkGbps < 0 || c.KVLinkLatency < 0 {
		return bad("kv_link_gbps", "the KV link's bandwidth and latency must be ≥ 0")
	}
	if c.Profile == "" {
		return bad("profile", "a cost profile is required")
	}
	// Checked even with calibrate off: a bad value is an error either way.
	if err := c.Calibration.Validate(); err != nil {
		return bad("calibration", "%v", err)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"connect_timeout", c.ConnectTimeout}, {"response_header_timeout", c.ResponseHeaderTimeout},
		{"idle_timeout", c.IdleTimeout}, {"request_timeout", c.RequestTimeout},
		{"read_header_timeout", c.ReadHeaderTimeout}, {"scrape_interval", c.ScrapeInterval},
		{"drain_timeout", c.DrainTimeout}, {"body_read_timeout", c.BodyReadTimeout},
		{"client_idle_timeout", c.ClientIdleTimeout},
	} {
		if d.v < 0 {
			return bad(d.name, "must be ≥ 0, got %v", d.v)
		}
	}
	switch {
	case c.HealthInterval <= 0:
		return bad("health_interval", "must be > 0, got %v", c.HealthInterval)
	case c.HealthTimeout <= 0:
		return bad("health_timeout", "must be > 0, got %v", c.HealthTimeout)
	case !strings.HasPrefix(c.HealthPath, "/"):
		return bad("health_path", "must start with /, got %q", c.HealthPath)
	case c.ScrapeInterval > 0 && !strings.HasPrefix(c.MetricsPath, "/"):
		return bad("metrics_path", "must start with /, got %q", c.MetricsPath)
	case c.EjectAfter < 1:
		return bad("eject_after", "must be ≥ 1, got %d", c.EjectAfter)
	case c.ReadmitAfter < 1:
		return bad("readmit_after", "must be ≥ 1, got %d", c.ReadmitAfter)
	case c.MaxBodyBytes <= 0:
		return bad("max_body_bytes", "must be > 0, got %d", c.MaxBodyBytes)
	case c.MaxResponseBytes <= 0:
		return bad("max_response_bytes", "must be > 0, got %d", c.MaxResponseBytes)
	case c.TreeMaxBlocks < 0:
		return bad("tree_max_blocks", "must be ≥ 0, got %d", c.TreeMaxBlocks)
	case c.MaxRetries < 0:
		return bad("max_retries", "must be ≥ 0, got %d", c.MaxRetries)
	case c.MaxHeaderBytes <= 0:
		return bad("max_header_bytes", "must be > 0, got %d", c.MaxHeaderBytes)
	case c.MaxConcurrent < 0:
		return bad("max_concurrent", "must be ≥ 0 (0: no bound), got %d", c.MaxConcurrent)
	case c.Queue.On && c.Queue.Validate() != nil:
		return fmt.Errorf("proxy: config: %w", c.Queue.Validate())
	case c.MaxPromptTokens <= 0:
		return bad("max_prompt_tokens", "must be > 0, got %d", c.MaxPromptTokens)
	case c.Explain != "" && c.Explain.Validate() != nil:
		return bad("explain", "%v", c.Explain.Validate())
	}
	if err := c.Tenants.Validate(); err != nil {
		return fmt.Errorf("proxy: config: %w", err)
	}
	c.Queue.Tenants = c.Tenants.Names()
	if err := c.PickerConfig.validate(); err != nil {
		return err
	}
	if c.ShadowPolicy != "" {
		if _, err := policy.Parse(c.ShadowPolicy, policyOptions(c)); err != nil {
			return bad("shadow_policy", "%v", err)
		}
	}
	if err := c.FrontDoor.validate(c.MaxBodyBytes); err != nil {
		return fmt.Errorf("proxy: config: %w", err)
	}
	return nil
}

// roles counts the static backends of role prefill and those that decode
// (roles valid).
func (c *Config) roles() (prefill, decode int) {
	for _, b := range c.Backends {
		if r, _ := policy.ParseRole(b.Role); r == policy.RolePrefill {
			prefill++
		} else {
			decode++
		}
	}
	return prefill, decode
}

// KVLink is the link the config gives the policies.
func (c *Config) KVLink() policy.KVLink {
	return policy.KVLink{BytesPerSecond: c.KVLinkGbps * 1e9 / 8, Latency: c.KVLinkLatency}
}

// SetPrefillBackends appends the prefill replicas of "URL[,URL..]" (the
// serve command's --prefill-backend), named by host:port, to backends.
func SetPrefillBackends(backends []Backend, list string) []Backend {
	for _, b := range ParseBackends(list) {
		b.Role = policy.RolePrefill.String()
		backends = append(backends, b)
	}
	return backends
}

// policyOptions are the policy options for c (block size from c).
func policyOptions(c *Config) policy.Options {
	o := policy.DefaultOptions()
	o.ApproxCapacityBlocks = o.ApproxCapacityBlocks * o.BlockTokens / c.BlockTokens
	o.BlockTokens = c.BlockTokens
	return o
}

// backendName is b's name, or its URL's host:port.
func backendName(b Backend) string {
	if b.Name != "" {
		return b.Name
	}
	if u, err := url.Parse(b.URL); err == nil && u.Host != "" {
		return u.Host
	}
	return b.URL
}

// checkZMQEndpoint accepts transport://address with a tcp, ipc or inproc
// transport.
func checkZMQEndpoint(ep string) error {
	tr, addr, ok := strings.Cut(ep, "://")
	if !ok || addr == "" {
		return fmt.Errorf("%q is not a ZeroMQ endpoint transport://address", ep)
	}
	switch tr {
	case "tcp", "ipc", "inproc":
	default:
		return fmt.Errorf("%q: unknown ZeroMQ transport %q", ep, tr)
	}
	if strings.Contains(addr, "*") {
		return fmt.Errorf("%q: the router dials the replica's socket; give its host, not *", ep)
	}
	return nil
}

// checkZMQListenEndpoint accepts an endpoint the router binds for engines
// to dial: checkZMQEndpoint's transport://address, where "*" (every
// interface) is allowed, and a transport another process can dial
// (kvevents.CheckListenEndpoint: tcp or ipc).
func checkZMQListenEndpoint(ep string) error {
	if err := checkZMQEndpoint(strings.ReplaceAll(ep, "*", "0.0.0.0")); err != nil {
		return err
	}
	return kvevents.CheckListenEndpoint(ep)
}

// replayEndpoint is b's replay socket: KVReplay, or KVEvents with port+1.
func replayEndpoint(b Backend) (string, error) {
	if b.KVReplay != "" {
		return b.KVReplay, nil
	}
	tr, addr, _ := strings.Cut(b.KVEvents, "://")
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("cannot derive the replay endpoint from %q (give kv_replay): %w", b.KVEvents, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n <= 0 || n >= 65535 {
		return "", fmt.Errorf("cannot derive the replay endpoint from %q (give kv_replay): no numeric port", b.KVEvents)
	}
	return tr + "://" + net.JoinHostPort(host, strconv.Itoa(n+1)), nil
}

// SetKVEvents sets the KV-event endpoints of backends by position from
// "ENDPOINT[,ENDPOINT..]" (the serve command's --kv-events): the i-th
// endpoint is the i-th backend's; an empty one ("tcp://a:5557,,tcp://c:5557")
// leaves that backend without events. More endpoints than backends is an
// error.
func SetKVEvents(backends []Backend, list string) error {
	parts := strings.Split(list, ",")
	if len(parts) > len(backends) {
		return fmt.Errorf("proxy: %d KV-event endpoints for %d backends", len(parts), len(backends))
	}
	for i, ep := range parts {
		backends[i].KVEvents = strings.TrimSpace(ep)
	}
	return nil
}

// ParseBackends turns "URL[,URL..]" into backends named by host:port.
func ParseBackends(list string) []Backend {
	var out []Backend
	for _, s := range strings.Split(list, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, Backend{URL: s})
		}
	}
	return out
}

// duration is a YAML/JSON duration: a Go duration string ("5s", "1m30s").
type duration time.Duration

func (d *duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errors.New("expected a duration string such as \"5s\"")
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = duration(v)
	return nil
}

// fileConfig is the YAML form of Config: snake_case names, durations as
// strings, every field optional (absent fields keep their base value).
type fileConfig struct {
	Listen                *string           `json:"listen"`
	Backends              *[]Backend        `json:"backends"`
	Policy                *string           `json:"policy"`
	Profile               *string           `json:"profile"`
	Calibrate             *bool             `json:"calibrate"`
	Calibration           *json.RawMessage  `json:"calibration"`
	BlockTokens           *int              `json:"block_tokens"`
	Seed                  *uint64           `json:"seed"`
	BackendKind           *string           `json:"backend_kind"`
	ConnectTimeout        *duration         `json:"connect_timeout"`
	ResponseHeaderTimeout *duration         `json:"response_header_timeout"`
	IdleTimeout           *duration         `json:"idle_timeout"`
	RequestTimeout        *duration         `json:"request_timeout"`
	ReadHeaderTimeout     *duration         `json:"read_header_timeout"`
	BodyReadTimeout       *duration         `json:"body_read_timeout"`
	ClientIdleTimeout     *duration         `json:"client_idle_timeout"`
	MaxHeaderBytes        *int              `json:"max_header_bytes"`
	MaxConcurrent         *int              `json:"max_concurrent"`
	MaxPromptTokens       *int              `json:"max_prompt_tokens"`
	HealthPath            *string           `json:"health_path"`
	HealthInterval        *duration         `json:"health_interval"`
	HealthTimeout         *duration         `json:"health_timeout"`
	EjectAfter            *int              `json:"eject_after"`
	ReadmitAfter          *int              `json:"readmit_after"`
	MetricsPath           *string           `json:"metrics_path"`
	ScrapeInterval        *duration         `json:"scrape_interval"`
	MaxBodyBytes          *int64            `json:"max_body_bytes"`
	MaxResponseBytes      *int64            `json:"max_response_bytes"`
	MaxRetries            *int              `json:"max_retries"`
	AdminToken            *string           `json:"admin_token"`
	DrainTimeout          *duration         `json:"drain_timeout"`
	SpeculativeTTL        *duration         `json:"speculative_ttl"`
	TreeMaxBlocks         *int              `json:"tree_max_blocks"`
	Tokenizer             *string           `json:"tokenizer"`
	Discovery             *fileDiscovery    `json:"discovery"`
	KVEventsListen        *string           `json:"kv_events_listen"`
	KVLinkGbps            *float64          `json:"kv_link_gbps"`
	Pools                 []json.RawMessage `json:"pools"`
	LoRAAdapters          *[]string         `json:"lora_adapters"`
	LoRAAdapterBytes      *int64            `json:"lora_adapter_bytes"`
	IgnoreCacheTiers      *bool             `json:"ignore_cache_tiers"`
	Explain               *string           `json:"explain"`
	TenantIsolation       *bool             `json:"tenant_isolation"`
	TenantSaltSecret      *string           `json:"tenant_salt_secret"`
	KVLinkLatency         *duration         `json:"kv_link_latency"`
	Queue                 *fileQueue        `json:"queue"`
	// The tenants (Config.Tenants).
	Tenants                  *[]tenant.Tenant `json:"tenants"`
	TrustedProxies           *[]string        `json:"trusted_proxies"`
	AnonymousTokensPerMinute *int64           `json:"anonymous_tokens_per_minute"`
	RequireTenant            *bool            `json:"require_tenant"`
	fileFrontDoor
	filePicker
}

// fileQueue is the YAML form of Config.Queue: every field optional.
type fileQueue struct {
	Enabled          *bool               `json:"enabled"`
	Max              *int                `json:"max"`
	Timeout          *duration           `json:"timeout"`
	MaxWaiting       *int                `json:"max_waiting"`
	MaxKVUsage       *float64            `json:"max_kv_usage"`
	MaxQueuedPrefill *duration           `json:"max_queued_prefill"`
	MaxInFlight      *int                `json:"max_inflight"`
	MaxPredictedWait *duration           `json:"max_predicted_wait"`
	LIFOAfter        *duration           `json:"lifo_after"`
	SLOFraction      *float64            `json:"slo_fraction"`
	EngageAfter      *duration           `json:"engage_after"`
	MinTTFTSLO       *duration           `json:"min_ttft_slo"`
	Interval         *duration           `json:"interval"`
	Classes          *[]cluster.Class    `json:"classes"`
	Weights          *map[string]float64 `json:"weights"`
}

// apply sets the fields given over q.
func (f *fileQueue) apply(q *cluster.QueueConfig) {
	if f.Enabled != nil {
		q.On = *f.Enabled
	}
	a := &q.Admission
	if f.Max != nil {
		a.MaxQueue = *f.Max
	}
	if f.Timeout != nil {
		a.Timeout = time.Duration(*f.Timeout)
	}
	if f.MaxWaiting != nil {
		a.MaxWaiting = *f.MaxWaiting
	}
	if f.MaxKVUsage != nil {
		a.MaxKVUsage = *f.MaxKVUsage
	}
	if f.MaxQueuedPrefill != nil {
		a.MaxQueuedPrefill = time.Duration(*f.MaxQueuedPrefill)
	}
	if f.MaxInFlight != nil {
		a.MaxInFlight = *f.MaxInFlight
	}
	if f.MaxPredictedWait != nil {
		a.MaxPredictedWait = time.Duration(*f.MaxPredictedWait)
	}
	if f.LIFOAfter != nil {
		a.LIFOAfter = time.Duration(*f.LIFOAfter)
	}
	if f.SLOFraction != nil {
		a.SLOFraction = *f.SLOFraction
	}
	if f.EngageAfter != nil {
		a.EngageAfter = time.Duration(*f.EngageAfter)
	}
	if f.MinTTFTSLO != nil {
		a.MinTTFTSLO = time.Duration(*f.MinTTFTSLO)
	}
	if f.Interval != nil {
		q.Interval = time.Duration(*f.Interval)
	}
	if f.Classes != nil {
		q.Classes = append([]cluster.Class(nil), *f.Classes...)
	}
	if f.Weights != nil {
		a.Weights = map[string]float64{}
		for k, v := range *f.Weights {
			a.Weights[k] = v
		}
	}
}

// fileDiscovery is the YAML form of Config's discovery fields.
type fileDiscovery struct {
	Target       string `json:"target"`
	Kubeconfig   string `json:"kubeconfig"`
	HTTPPort     int    `json:"http_port"`
	HTTPPortName string `json:"http_port_name"`
	MetricsPort  int    `json:"metrics_port"`
	KVEventsPort int    `json:"kv_events_port"`
	KVReplayPort int    `json:"kv_replay_port"`
	KVTopic      string `json:"kv_topic"`
}

// ParseConfig applies the YAML document data over base and returns the
// result (not yet validated). Unknown fields are errors.
func ParseConfig(data []byte, base Config) (Config, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return base, fmt.Errorf("proxy: parse config: %w", err)
	}
	var f fileConfig
	if t := bytes.TrimSpace(js); len(t) > 0 && string(t) != "null" {
		dec := json.NewDecoder(bytes.NewReader(js))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			return base, fmt.Errorf("proxy: parse config: %w", err)
		}
	}
	c := base
	setS := func(dst *string, v *string) {
		if v != nil {
			*dst = *v
		}
	}
	setI := func(dst *int, v *int) {
		if v != nil {
			*dst = *v
		}
	}
	setD := func(dst *time.Duration, v *duration) {
		if v != nil {
			*dst = time.Duration(*v)
		}
	}
	setS(&c.Listen, f.Listen)
	if f.Backends != nil {
		c.Backends = append([]Backend(nil), *f.Backends...)
	}
	setS(&c.Policy, f.Policy)
	setS(&c.Profile, f.Profile)
	if f.Calibrate != nil {
		c.Calibrate = *f.Calibrate
	}
	if f.Calibration != nil {
		// Over the base's settings, strictly: a misspelt field is an error.
		dec := json.NewDecoder(bytes.NewReader(*f.Calibration))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c.Calibration); err != nil {
			return base, fmt.Errorf("proxy: parse config: calibration: %w", err)
		}
	}
	setI(&c.BlockTokens, f.BlockTokens)
	if f.Seed != nil {
		c.Seed = *f.Seed
	}
	if f.BackendKind != nil {
		c.BackendKind = upstream.Kind(*f.BackendKind)
	}
	setD(&c.ConnectTimeout, f.ConnectTimeout)
	setD(&c.ResponseHeaderTimeout, f.ResponseHeaderTimeout)
	setD(&c.IdleTimeout, f.IdleTimeout)
	setD(&c.RequestTimeout, f.RequestTimeout)
	setD(&c.ReadHeaderTimeout, f.ReadHeaderTimeout)
	setD(&c.BodyReadTimeout, f.BodyReadTimeout)
	setD(&c.ClientIdleTimeout, f.ClientIdleTimeout)
	setI(&c.MaxHeaderBytes, f.MaxHeaderBytes)
	setI(&c.MaxConcurrent, f.MaxConcurrent)
	setI(&c.MaxPromptTokens, f.MaxPromptTokens)
	setS(&c.HealthPath, f.HealthPath)
	setD(&c.HealthInterval, f.HealthInterval)
	setD(&c.HealthTimeout, f.HealthTimeout)
	setI(&c.EjectAfter, f.EjectAfter)
	setI(&c.ReadmitAfter, f.ReadmitAfter)
	setS(&c.MetricsPath, f.MetricsPath)
	setD(&c.ScrapeInterval, f.ScrapeInterval)
	if f.MaxBodyBytes != nil {
		c.MaxBodyBytes = *f.MaxBodyBytes
	}
	if f.MaxResponseBytes != nil {
		c.MaxResponseBytes = *f.MaxResponseBytes
	}
	setI(&c.MaxRetries, f.MaxRetries)
	setS(&c.AdminToken, f.AdminToken)
	setD(&c.DrainTimeout, f.DrainTimeout)
	setD(&c.SpeculativeTTL, f.SpeculativeTTL)
	setI(&c.TreeMaxBlocks, f.TreeMaxBlocks)
	setS(&c.Tokenizer, f.Tokenizer)
	setS(&c.KVEventsListen, f.KVEventsListen)
	if f.IgnoreCacheTiers != nil {
		c.IgnoreCacheTiers = *f.IgnoreCacheTiers
	}
	if f.LoRAAdapters != nil {
		c.LoRAAdapters = append([]string(nil), *f.LoRAAdapters...)
	}
	if f.LoRAAdapterBytes != nil {
		c.LoRAAdapterBytes = *f.LoRAAdapterBytes
	}
	if f.KVLinkGbps != nil {
		c.KVLinkGbps = *f.KVLinkGbps
	}
	setD(&c.KVLinkLatency, f.KVLinkLatency)
	if f.Explain != nil {
		c.Explain = tenancy.Explain(*f.Explain)
	}
	if f.TenantIsolation != nil {
		c.TenantIsolation = *f.TenantIsolation
	}
	setS(&c.TenantSaltSecret, f.TenantSaltSecret)
	if f.Queue != nil {
		f.Queue.apply(&c.Queue)
	}
	if f.Tenants != nil {
		c.Tenants.Tenants = append([]tenant.Tenant(nil), *f.Tenants...)
	}
	if f.TrustedProxies != nil {
		c.Tenants.TrustedProxies = append([]string(nil), *f.TrustedProxies...)
	}
	if f.AnonymousTokensPerMinute != nil {
		c.Tenants.AnonymousTokensPerMinute = *f.AnonymousTokensPerMinute
	}
	if f.RequireTenant != nil {
		c.Tenants.RequireTenant = *f.RequireTenant
	}
	f.fileFrontDoor.apply(&c.FrontDoor)
	f.filePicker.apply(&c.PickerConfig)
	if f.Pools != nil {
		if f.Backends != nil || f.Discovery != nil {
			return base, errors.New("proxy: parse config: pools: backends and discovery belong to each pool, not beside pools")
		}
		c.Pools = nil
		for i, raw := range f.Pools {
			pc, err := parsePool(raw, c)
			if err != nil {
				return base, fmt.Errorf("proxy: parse config: pools[%d]: %w", i, err)
			}
			c.Pools = append(c.Pools, pc)
		}
	}
	if d := f.Discovery; d != nil {
		c.Discovery, c.Kubeconfig = d.Target, d.Kubeconfig
		c.DiscoveryPorts = discovery.Ports{HTTP: d.HTTPPort, HTTPName: d.HTTPPortName, Metrics: d.MetricsPort,
			KVEvents: d.KVEventsPort, KVReplay: d.KVReplayPort, KVTopic: d.KVTopic}
	}
	return c, nil
}

// parsePool reads one item of pools: name, models and default, and every
// other key a Config takes, over the top level's settings base.
func parsePool(raw json.RawMessage, base Config) (PoolConfig, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil || m == nil {
		return PoolConfig{}, fmt.Errorf("want a mapping: %v", err)
	}
	var pc PoolConfig
	for key, dst := range map[string]any{"name": &pc.Name, "models": &pc.Models, "default": &pc.Default} {
		if v, ok := m[key]; ok {
			if err := json.Unmarshal(v, dst); err != nil {
				return pc, fmt.Errorf("%s: %w", key, err)
			}
			delete(m, key)
		}
	}
	if _, ok := m["pools"]; ok {
		return pc, errors.New("pools inside a pool")
	}
	rest, _ := json.Marshal(m)
	base.Pools = nil
	cfg, err := ParseConfig(rest, base)
	if err != nil {
		return pc, err
	}
	pc.Config = cfg
	return pc, nil
}

// LoadConfig reads the YAML file at path over base (ParseConfig).
func LoadConfig(path string, base Config) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return base, fmt.Errorf("proxy: load config: %w", err)
	}
	c, err := ParseConfig(data, base)
	if err != nil {
		return base, fmt.Errorf("%w (file %s)", err, path)
	}
	return c, nil
}

// backendKind is backend b's configured kind: its own, else def (the
// config's BackendKind), else auto. Both were validated.
func backendKind(b Backend, def upstream.Kind) upstream.Kind {
	if k, err := upstream.ParseKind(string(b.Kind)); err == nil && b.Kind != "" {
		return k
	}
	if k, err := upstream.ParseKind(string(def)); err == nil {
		return k
	}
	return upstream.Auto
}
