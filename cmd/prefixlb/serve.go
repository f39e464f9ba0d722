package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// serveFlags binds `prefixlb serve`'s flags; fields a flag sets override
// the config file.
type serveFlags struct {
	cfg proxy.Config
	// queueCopy copies each queue flag's field (queueFlags).
	queueCopy   map[string]func(dst, src *admission.Config)
	backends    string
	kvEvents    string
	prefill     string // --prefill-backend
	config      string
	ports       discovery.Ports // --http-port .. --kv-topic, with --discovery
	logLevel    string
	backendKind string
}

// overrides copies, for every flag the user set, its value into c.
func (f *serveFlags) overrides(fs *pflag.FlagSet, c *proxy.Config) {
	set := map[string]func(){
		"listen":                  func() { c.Listen = f.cfg.Listen },
		"backend":                 func() { c.Backends = proxy.ParseBackends(f.backends) },
		"policy":                  func() { c.Policy = f.cfg.Policy },
		"profile":                 func() { c.Profile = f.cfg.Profile },
		"calibrate":               func() { c.Calibrate = f.cfg.Calibrate },
		"block-tokens":            func() { c.BlockTokens = f.cfg.BlockTokens },
		"seed":                    func() { c.Seed = f.cfg.Seed },
		"admin-token":             func() { c.AdminToken = f.cfg.AdminToken },
		"connect-timeout":         func() { c.ConnectTimeout = f.cfg.ConnectTimeout },
		"response-header-timeout": func() { c.ResponseHeaderTimeout = f.cfg.ResponseHeaderTimeout },
		"idle-timeout":            func() { c.IdleTimeout = f.cfg.IdleTimeout },
		"request-timeout":         func() { c.RequestTimeout = f.cfg.RequestTimeout },
		"read-header-timeout":     func() { c.ReadHeaderTimeout = f.cfg.ReadHeaderTimeout },
		"body-read-timeout":       func() { c.BodyReadTimeout = f.cfg.BodyReadTimeout },
		"client-idle-timeout":     func() { c.ClientIdleTimeout = f.cfg.ClientIdleTimeout },
		"max-header-bytes":        func() { c.MaxHeaderBytes = f.cfg.MaxHeaderBytes },
		"max-concurrent":          func() { c.MaxConcurrent = f.cfg.MaxConcurrent },
		"max-prompt-tokens":       func() { c.MaxPromptTokens = f.cfg.MaxPromptTokens },
		"health-path":             func() { c.HealthPath = f.cfg.HealthPath },
		"health-interval":         func() { c.HealthInterval = f.cfg.HealthInterval },
		"health-timeout":          func() { c.HealthTimeout = f.cfg.HealthTimeout },
		"eject-after":             func() { c.EjectAfter = f.cfg.EjectAfter },
		"readmit-after":           func() { c.ReadmitAfter = f.cfg.ReadmitAfter },
		"metrics-path":            func() { c.MetricsPath = f.cfg.MetricsPath },
		"scrape-interval":         func() { c.ScrapeInterval = f.cfg.ScrapeInterval },
		"max-body-bytes":          func() { c.MaxBodyBytes = f.cfg.MaxBodyBytes },
		"max-response-bytes":      func() { c.MaxResponseBytes = f.cfg.MaxResponseBytes },
		"max-retries":             func() { c.MaxRetries = f.cfg.MaxRetries },
		"drain-timeout":           func() { c.DrainTimeout = f.cfg.DrainTimeout },
		"speculative-ttl":         func() { c.SpeculativeTTL = f.cfg.SpeculativeTTL },
		"tree-max-blocks":         func() { c.TreeMaxBlocks = f.cfg.TreeMaxBlocks },
		"tokenizer":               func() { c.Tokenizer = f.cfg.Tokenizer },
		"backend-kind":            func() { c.BackendKind = upstream.Kind(f.backendKind) },
		"discovery":               func() { c.Discovery = f.cfg.Discovery },
		"kv-events-listen":        func() { c.KVEventsListen = f.cfg.KVEventsListen },
		"kv-link-gbps":            func() { c.KVLinkGbps = f.cfg.KVLinkGbps },
		"lora-adapters":           func() { c.LoRAAdapters = f.cfg.LoRAAdapters },
		"lora-adapter-bytes":      func() { c.LoRAAdapterBytes = f.cfg.LoRAAdapterBytes },
		"ignore-cache-tiers":      func() { c.IgnoreCacheTiers = f.cfg.IgnoreCacheTiers },
		"kv-link-latency":         func() { c.KVLinkLatency = f.cfg.KVLinkLatency },
		"kubeconfig":              func() { c.Kubeconfig = f.cfg.Kubeconfig },
		"http-port":               func() { c.DiscoveryPorts.HTTP = f.ports.HTTP },
		"metrics-port":            func() { c.DiscoveryPorts.Metrics = f.ports.Metrics },
		"kv-events-port":          func() { c.DiscoveryPorts.KVEvents = f.ports.KVEvents },
		"kv-replay-port":          func() { c.DiscoveryPorts.KVReplay = f.ports.KVReplay },
		"kv-topic":                func() { c.DiscoveryPorts.KVTopic = f.ports.KVTopic },
		"queue":                   func() { c.Queue.On = f.cfg.Queue.On },
		"trusted-proxies":         func() { c.Tenants.TrustedProxies = f.cfg.Tenants.TrustedProxies },
		"explain":                 func() { c.Explain = f.cfg.Explain },
		"tenant-isolation":        func() { c.TenantIsolation = f.cfg.TenantIsolation },
		"tenant-salt-secret":      func() { c.TenantSaltSecret = f.cfg.TenantSaltSecret },
	}
	// The endpoint picker (proxy.PickerConfig; docs/gie.md).
	set["endpoint-picker"] = func() { c.EndpointPicker = f.cfg.EndpointPicker }
	set["endpoint-picker-fail-open"] = func() { c.EndpointPickerFailOpen = f.cfg.EndpointPickerFailOpen }
	set["endpoint-picker-timeout"] = func() { c.EndpointPickerTimeout = f.cfg.EndpointPickerTimeout }
	set["shadow-policy"] = func() { c.ShadowPolicy = f.cfg.ShadowPolicy }
	set["shadow-log"] = func() { c.ShadowLog = f.cfg.ShadowLog }
	// The front door's bounds (proxy.FrontDoor).
	fd := &f.cfg.FrontDoor
	set["max-inflight-body-bytes"] = func() { c.MaxInflightBodyBytes = fd.MaxInflightBodyBytes }
	set["client-write-timeout"] = func() { c.ClientWriteTimeout = fd.ClientWriteTimeout }
	set["allow-path"] = func() { c.AllowedPaths = append([]string(nil), fd.AllowedPaths...) }
	set["breaker-failures"] = func() { c.BreakerFailures = fd.BreakerFailures }
	set["breaker-window"] = func() { c.BreakerWindow = fd.BreakerWindow }
	set["breaker-ejection-time"] = func() { c.BreakerEjectionTime = fd.BreakerEjectionTime }
	for name, cp := range f.queueCopy {
		set[name] = func() { cp(&c.Queue.Admission, &f.cfg.Queue.Admission) }
	}
	fs.Visit(func(fl *pflag.Flag) {
		if apply, ok := set[fl.Name]; ok {
			apply()
		}
	})
}

func newServeCmd() *cobra.Command {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Route OpenAI-compatible requests to inference replicas (the router)",
		Long: `serve is prefixlb's router: an OpenAI-compatible reverse proxy in front of
vLLM, SGLang, llama.cpp (llama-server) or prefixlb engine replicas. It routes /v1/completions and
/v1/chat/completions by prompt prefix with the chosen policy (e2 by default),
passes streams through as they arrive, retries requests that fail before any
byte reached the client, checks the replicas' health and scrapes their load.

Every response carries x-prefixlb-replica; x-prefixlb-route (the decision's
branch, matched tokens and cost terms) goes only to clients --explain allows:
by default those presenting the admin token. POST /debug/route explains a decision
without forwarding; /metrics serves the router's Prometheus metrics.

Settings come from defaults, then --config FILE (YAML, snake_case keys such as
backends, policy, health_interval: 5s), then the flags given.

KV events: a replica that publishes vLLM's KV-cache events (vLLM
--kv-events-config, prefixlb engine --kv-events) is followed exactly: give
--kv-events with one ZMQ endpoint per --backend, matched by position (empty for
a replica without events), or kv_events (and optionally kv_replay, default port
+ 1, and kv_topic) on a backend in the config file. GET /debug/cache shows each
replica's stream and the router's view of its cache.

Backend kind: --backend-kind (or backend_kind, and kind on a backend in the
config file) is auto, vllm, sglang or llamacpp. With auto (the default) each
replica's engine is detected at start and whenever it is re-admitted: from its
/metrics names, llama.cpp's GET /props, the owned_by of GET /v1/models, or its
Server: llama.cpp header. A llama.cpp replica (llama-server) keeps one prompt
per slot (-np): the router models its slots (read from /props total_slots),
reads its cached tokens from the timings of its responses and its load from
llamacpp:requests_processing, requests_deferred and kv_cache_usage_ratio.

Tokenizer: --tokenizer qwen3 (bundled), a tokenizer.json or a model directory
keys text and chat prompts by the replicas' token ids (chats rendered with the
model's chat template, as vLLM does), so keys are the replicas' KV blocks. The
router checks it against each replica's /tokenize at start and when a replica
is re-admitted; while one disagrees, text and chats are keyed by text chunks
(prefixlb_tokenizer_match, prefixlb_tokenizer_fallback). Default: text chunks.

Cost model: --profile (or profile, and profile on a backend in the config file,
for a cluster of mixed GPUs) prices each replica's prefill and decode in
seconds. With --calibrate (the default) the router learns each replica's real
speed from what it serves — prefill from the busy periods between routing and
first tokens, decode from the median gap between streamed tokens, and
llama.cpp's own timings when its responses carry them — and prices with that
(prefixlb_replica_prefill_seconds_per_1k_tokens, ..._decode_step_seconds,
GET /debug/replicas; docs/calibration.md).

Dynamic membership: --discovery service:NS/NAME or inferencepool:NS/NAME (or a
discovery block in the config file) adds the ready endpoints of a Kubernetes
Service or the pods of an InferencePool as they come and removes them as they
go, beside --backend or instead of it, exactly as prefixlb epp finds its pods;
--http-port, --metrics-port, --kv-events-port, --kv-replay-port and --kv-topic
place each pod's endpoints (docs/kubernetes.md).

Endpoint picker: --endpoint-picker HOST:PORT (or endpoint_picker) makes serve
the data plane of a Gateway API Inference Extension endpoint picker (prefixlb
epp, llm-d's router, GIE's EPP), as Envoy is in a gateway: each inference
request's headers and body go to the picker over ext_proc, the request goes to
the endpoint it names (x-gateway-destination-endpoint, its fallback list tried
on connection failures), and the response streams back through it. --backend
is the subset of endpoints the picker may name. A picker that is down fails
closed (503) unless --endpoint-picker-fail-open (docs/gie.md). --shadow-policy
NAME runs serve's own core beside the picker: it asks NAME where each request
would go, commits the request where the picker sent it, and counts agreement
(prefixlb_shadow_decisions_total; --shadow-log for one JSON line a request).`,
		Example: `  prefixlb serve --listen :8080 --backend http://10.0.0.1:8000,http://10.0.0.2:8000
  prefixlb serve --backend http://a:8000,http://b:8000 --kv-events tcp://a:5557,tcp://b:5557
  prefixlb serve --config prefixlb.yaml --policy e2-preble --admin-token "$TOKEN"
  prefixlb serve --discovery service:llm/vllm --http-port 8000 --kv-events-port 5557
  prefixlb serve --backend http://10.0.0.1:8000,http://10.0.0.2:8000 --endpoint-picker 127.0.0.1:9002`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runServe(ctx, cmd, f)
		},
	}
	fs := cmd.Flags()
	d := &f.cfg
	fs.StringVar(&d.Listen, "listen", d.Listen, "address to listen on")
	fs.StringVar(&f.backends, "backend", "", "replica base URLs, comma-separated (replaces the config file's backends)")
	fs.BoolVar(&d.IgnoreCacheTiers, "ignore-cache-tiers", false, "drop KV events of slower cache tiers (CPU offloading, disk) instead of pricing their blocks at their load time")
	fs.Int64Var(&d.LoRAAdapterBytes, "lora-adapter-bytes", 0, "size of each LoRA adapter's weights in bytes, which prices a load on a replica that lacks it (engine's --lora-adapter-bytes); 0: the profile's fixed cost alone")
	fs.StringSliceVar(&d.LoRAAdapters, "lora-adapters", nil, "model names that are LoRA adapters (vLLM's --lora-modules), comma-separated: their requests are keyed apart from the base model's and each other's, as vLLM caches them")
	fs.StringVar(&f.prefill, "prefill-backend", "", "prefill replicas' base URLs, comma-separated: requests are disaggregated, their prefill run there and their KV moved to a --backend replica that decodes (vLLM's P/D protocol; the policy defaults to e2-pd)")
	fs.Float64Var(&d.KVLinkGbps, "kv-link-gbps", d.KVLinkGbps, "with prefill replicas: each replica's KV-transfer link, Gbit/s, as the policies price a transfer")
	fs.DurationVar(&d.KVLinkLatency, "kv-link-latency", d.KVLinkLatency, "with prefill replicas: one KV transfer's fixed latency")
	fs.StringVar(&d.KVEventsListen, "kv-events-listen", "", "bind a ZMQ SUB socket here (tcp://0.0.0.0:5557) for replicas whose engines dial the router with their KV events; topic kv@<host:port>@<model> names the backend (docs/kv-events.md)")
	fs.StringVar(&f.kvEvents, "kv-events", "", "replicas' KV-event endpoints (tcp://HOST:PORT), comma-separated, matched by position to the --backend replicas, then the --prefill-backend ones; replay on port+1")
	fs.IntVar(&d.TreeMaxBlocks, "tree-max-blocks", 0, "bound of the router's prefix tree in blocks (0: 2M, about 420 MiB of heap, ~200 bytes a block; RSS about twice the heap)")
	fs.DurationVar(&d.SpeculativeTTL, "speculative-ttl", 0, "how long a routed prompt counts as cached on a KV-event replica before its events confirm it (0: 2s; negative: off)")
	fs.StringVar(&d.Policy, "policy", d.Policy, "routing policy: "+strings.Join(policy.Names(), ", ")+" (e2 settings: 'e2:mixing=false')")
	fs.StringVar(&f.config, "config", "", "YAML config file; flags given override its values")
	fs.StringVar(&d.Profile, "profile", d.Profile, "cost profile: a name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file, optionally :time_scale=X; a backend's profile in --config wins")
	fs.BoolVar(&d.Calibrate, "calibrate", d.Calibrate, "learn each replica's real prefill and decode speed from the requests it serves, starting from its profile (--calibrate=false: price with the profiles as configured)")
	fs.IntVar(&d.BlockTokens, "block-tokens", d.BlockTokens, "tokens per routing key (engine block size); text is keyed in chunks of 4x this many bytes")
	fs.Uint64Var(&d.Seed, "seed", d.Seed, "seed of the router's random choices")
	fs.StringVar(&d.AdminToken, "admin-token", "", "bearer token required by /debug/* (default $PREFIXLB_ADMIN_TOKEN)")
	fs.DurationVar(&d.ConnectTimeout, "connect-timeout", d.ConnectTimeout, "timeout to connect to a replica")
	fs.DurationVar(&d.ResponseHeaderTimeout, "response-header-timeout", d.ResponseHeaderTimeout, "timeout for a replica's response headers (0: none)")
	fs.DurationVar(&d.IdleTimeout, "idle-timeout", d.IdleTimeout, "longest silence inside a response body (0: none)")
	fs.DurationVar(&d.RequestTimeout, "request-timeout", d.RequestTimeout, "timeout of a whole request, retries included (0: none)")
	fs.DurationVar(&d.ReadHeaderTimeout, "read-header-timeout", d.ReadHeaderTimeout, "timeout to read a client's request headers")
	fs.DurationVar(&d.BodyReadTimeout, "body-read-timeout", d.BodyReadTimeout, "timeout to read a client's request body once its headers are read; slower ones get 408 (0: none)")
	fs.DurationVar(&d.ClientIdleTimeout, "client-idle-timeout", d.ClientIdleTimeout, "how long an idle keep-alive client connection is kept open (0: no limit)")
	fs.IntVar(&d.MaxHeaderBytes, "max-header-bytes", d.MaxHeaderBytes, "largest request line and headers accepted; larger ones get 431")
	fs.IntVar(&d.MaxConcurrent, "max-concurrent", d.MaxConcurrent, "inference requests (streams included) in flight at once; more get 429 with Retry-After (0: no limit)")
	fs.IntVar(&d.MaxPromptTokens, "max-prompt-tokens", d.MaxPromptTokens, "longest prompt accepted, in tokens (estimated from bytes without --tokenizer); longer ones get 400")
	fs.StringVar(&d.HealthPath, "health-path", d.HealthPath, "replicas' health endpoint")
	fs.DurationVar(&d.HealthInterval, "health-interval", d.HealthInterval, "interval of active health checks")
	fs.DurationVar(&d.HealthTimeout, "health-timeout", d.HealthTimeout, "timeout of one health check or metrics scrape")
	fs.IntVar(&d.EjectAfter, "eject-after", d.EjectAfter, "consecutive failed health checks that eject a replica")
	fs.IntVar(&d.ReadmitAfter, "readmit-after", d.ReadmitAfter, "consecutive good health checks that re-admit a replica")
	fs.StringVar(&d.MetricsPath, "metrics-path", d.MetricsPath, "replicas' Prometheus endpoint")
	fs.DurationVar(&d.ScrapeInterval, "scrape-interval", d.ScrapeInterval, "interval of load scrapes (0: never)")
	fs.Int64Var(&d.MaxBodyBytes, "max-body-bytes", d.MaxBodyBytes, "largest request body accepted")
	fs.Int64Var(&d.MaxResponseBytes, "max-response-bytes", d.MaxResponseBytes, "largest non-streamed response checked (larger ones pass unchecked)")
	fs.IntVar(&d.MaxRetries, "max-retries", d.MaxRetries, "other replicas to try when one fails before any byte reached the client")
	fs.DurationVar(&d.DrainTimeout, "drain-timeout", d.DrainTimeout, "how long shutdown waits for in-flight requests")
	fs.StringVar(&f.backendKind, "backend-kind", string(upstream.Auto), "replicas' engine: auto (detect each replica's at start and on re-admission), vllm, sglang or llamacpp; a backend's kind in --config wins")
	fs.StringVar(&d.Tokenizer, "tokenizer", "", "replicas' tokenizer for token-exact keys: qwen3 (bundled), a tokenizer.json or a model directory; auto: the bundled Qwen3 once a replica's /tokenize confirms it, text chunks until then; none: text chunks")
	fs.StringVar(&d.Discovery, "discovery", "", "Kubernetes replicas that come and go: service:NAMESPACE/NAME or inferencepool:NAMESPACE/NAME (beside or instead of --backend)")
	fs.StringVar(&d.Kubeconfig, "kubeconfig", "", "kubeconfig file for --discovery (default $KUBECONFIG, else the in-cluster config)")
	portFlags(fs, &f.ports, "with --discovery: ")
	q := &d.Queue.Admission
	fs.BoolVar(&d.Queue.On, "queue", d.Queue.On, "router-side queue: while every replica is saturated requests wait in the router by priority (x-prefixlb-priority) and tenant, and are shed with 429 past their deadline or timeout (docs/overload.md; --queue=false: off)")
	f.queueCopy = queueFlags(fs, q)
	fs.StringSliceVar(&d.Tenants.TrustedProxies, "trusted-proxies", nil, "CIDRs or addresses of the gateways whose x-prefixlb-tenant, -priority and -ttft-slo headers are believed (YAML trusted_proxies; default: no client's; docs/overload.md)")
	frontDoorFlags(fs, &d.FrontDoor)
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	tenancyFlags(fs, d)
	pickerFlags(fs, &d.PickerConfig)
	return cmd
}

// pickerFlags binds serve's endpoint-picker flags (proxy.PickerConfig;
// docs/gie.md) over pc, which holds their defaults.
func pickerFlags(fs *pflag.FlagSet, pc *proxy.PickerConfig) {
	fs.StringVar(&pc.EndpointPicker, "endpoint-picker", "", "HOST:PORT of a Gateway API Inference Extension endpoint picker (prefixlb epp, llm-d's router; ext_proc over plaintext gRPC): it names each inference request's replica, serve forwards it there, as Envoy would (docs/gie.md)")
	fs.BoolVar(&pc.EndpointPickerFailOpen, "endpoint-picker-fail-open", false, "when the endpoint picker is down, slow or answers garbage, route with serve's own --policy instead of answering 503 (GIE's FailOpen; default fail closed, as GIE's FailClose)")
	fs.DurationVar(&pc.EndpointPickerTimeout, "endpoint-picker-timeout", pc.EndpointPickerTimeout, "longest wait for the endpoint picker's decision (its own queueing included), and for its answers on the response path")
	fs.StringVar(&pc.ShadowPolicy, "shadow-policy", "", "with --endpoint-picker: a policy (any --policy accepts) that shadows the picker: serve asks it where each request would go, commits the request where the picker sent it, and counts agreement in prefixlb_shadow_decisions_total; it never changes where a request goes, and replaces --policy for fail-open routing (docs/gie.md)")
	fs.StringVar(&pc.ShadowLog, "shadow-log", "", "with --shadow-policy: append one JSON line per shadowed request to this file (request id, the picker's and the shadow's replica, per-replica scores and matched tokens)")
}

// tenancyFlags binds serve's tenant isolation and explanation flags
// (docs/security.md).
func tenancyFlags(fs *pflag.FlagSet, d *proxy.Config) {
	fs.Var(tenancy.ExplainFlag{V: &d.Explain}, "explain", "who gets x-prefixlb-route (matched tokens per replica, a cache oracle): never, trusted (requests presenting the admin token in x-prefixlb-admin-token or Authorization: Bearer) or always; bare --explain is always")
	fs.Lookup("explain").NoOptDefVal = string(tenancy.ExplainAlways)
	fs.BoolVar(&d.TenantIsolation, "tenant-isolation", d.TenantIsolation, "salt every request with its tenant: the forwarded cache_salt becomes a keyed hash of the tenant and the client's cache_salt, so vLLM never shares a prefix across tenants (llama.cpp replicas: router-side only)")
	fs.StringVar(&d.TenantSaltSecret, "tenant-salt-secret", "", "key of the tenant salts, the same on every router of the replicas (default $PREFIXLB_TENANT_SALT_SECRET; empty: unkeyed)")
}

func init() { rootCmd.AddCommand(newServeCmd()) }

// frontDoorFlags registers the flags of the front door's bounds
// (proxy.FrontDoor; docs/router.md, Limits) over fd, which holds their
// defaults.
func frontDoorFlags(fs *pflag.FlagSet, fd *proxy.FrontDoor) {
	fs.Int64Var(&fd.MaxInflightBodyBytes, "max-inflight-body-bytes", fd.MaxInflightBodyBytes, "request-body bytes held in memory at once, all requests together, as the bodies arrive; a request over it gets 429 with Retry-After (0: no bound; else ≥ --max-body-bytes)")
	fs.DurationVar(&fd.ClientWriteTimeout, "client-write-timeout", fd.ClientWriteTimeout, "longest a write to a client may make no progress; a client that stops reading loses its request, which frees its slot and replica (0: none)")
	fs.StringArrayVar(&fd.AllowedPaths, "allow-path", fd.AllowedPaths, "a /v1 request served, \"METHOD /v1/path\" (or /v1/prefix/*, METHOD * for any); repeat it; the ones given replace the default list; \"*\" serves every /v1 request")
	fs.IntVar(&fd.BreakerFailures, "breaker-failures", fd.BreakerFailures, "circuit breaker: failed requests (5xx, connection errors, timeouts, garbage) of a replica's last --breaker-window that eject it even while its health check passes (0: off)")
	fs.IntVar(&fd.BreakerWindow, "breaker-window", fd.BreakerWindow, "circuit breaker: a replica's last requests weighed")
	fs.DurationVar(&fd.BreakerEjectionTime, "breaker-ejection-time", fd.BreakerEjectionTime, "circuit breaker: how long an ejection lasts, times the replica's recent ejections (up to 10 times)")
}

// runServe builds the configuration (defaults, file, flags), then serves
// until ctx ends and drains.
func runServe(ctx context.Context, cmd *cobra.Command, f *serveFlags) error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return fmt.Errorf("serve: --log-level: %w", err)
	}
	if _, err := upstream.ParseKind(f.backendKind); err != nil {
		return fmt.Errorf("serve: --backend-kind: %w", err)
	}
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))

	cfg := proxy.DefaultConfig()
	if f.config != "" {
		var err error
		if cfg, err = proxy.LoadConfig(f.config, cfg); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
	}
	f.overrides(cmd.Flags(), &cfg)
	if f.prefill != "" {
		cfg.Backends = proxy.SetPrefillBackends(cfg.Backends, f.prefill)
		if !cmd.Flags().Changed("policy") {
			cfg.Policy = "e2-pd"
		}
	}
	if f.kvEvents != "" {
		if err := proxy.SetKVEvents(cfg.Backends, f.kvEvents); err != nil {
			return fmt.Errorf("serve: --kv-events: %w", err)
		}
	}
	if cfg.AdminToken == "" {
		cfg.AdminToken = os.Getenv("PREFIXLB_ADMIN_TOKEN")
	}
	if cfg.TenantSaltSecret == "" {
		cfg.TenantSaltSecret = os.Getenv("PREFIXLB_TENANT_SALT_SECRET")
	}
	cfg.Logger = log
	if len(cfg.Pools) > 0 {
		return servePools(ctx, cmd, f, cfg, log)
	}
	if len(cfg.Backends) == 0 && cfg.Discovery == "" {
		return errors.New("serve: no replicas: give --backend URL[,URL..], --discovery TARGET, or backends in --config")
	}
	p, err := proxy.New(cfg)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	defer p.Close()
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("serve: listen: %w", err)
	}
	names := make([]string, len(cfg.Backends))
	for i, b := range cfg.Backends {
		names[i] = b.URL
		if b.Kind != "" {
			names[i] += " (" + string(b.Kind) + ")"
		}
		if b.Role != "" {
			names[i] += " (" + b.Role + ")"
		}
		if b.KVEvents != "" {
			names[i] += " (kv events " + b.KVEvents + ")"
		}
	}
	log.Info("prefixlb serve", "listen", ln.Addr().String(), "policy", cfg.Policy, "profile", cfg.Profile,
		"backends", strings.Join(names, ","), "discovery", cfg.Discovery, "backend_kind", cfg.BackendKind, "admin_token", cfg.AdminToken != "", "tokenizer", cfg.Tokenizer,
		"explain", cfg.Explain, "tenant_isolation", cfg.TenantIsolation, "kv_events_listen", cfg.KVEventsListen)
	if cfg.EndpointPicker != "" {
		log.Info("routing through an endpoint picker (GIE data plane)", "endpoint_picker", cfg.EndpointPicker,
			"fail_open", cfg.EndpointPickerFailOpen, "timeout", cfg.EndpointPickerTimeout)
	}

	if err := p.RunAndServe(ctx, ln); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("drained")
	return nil
}

// servePools serves the config file's model pools; flags given apply to
// every pool, as they apply to the file's top level.
func servePools(ctx context.Context, cmd *cobra.Command, f *serveFlags, cfg proxy.Config, log *slog.Logger) error {
	for _, name := range []string{"backend", "prefill-backend", "kv-events", "kv-events-listen", "discovery"} {
		if cmd.Flags().Changed(name) {
			return fmt.Errorf("serve: --%s: with pools in --config, each pool names its own replicas", name)
		}
	}
	var names []string
	for i := range cfg.Pools {
		pc := &cfg.Pools[i].Config
		f.overrides(cmd.Flags(), pc)
		if pc.AdminToken == "" {
			pc.AdminToken = cfg.AdminToken
		}
		if pc.TenantSaltSecret == "" {
			pc.TenantSaltSecret = cfg.TenantSaltSecret
		}
		names = append(names, fmt.Sprintf("%s (%d backends, models %s, policy %s)", cfg.Pools[i].Name, len(pc.Backends),
			strings.Join(cfg.Pools[i].Models, "|"), pc.Policy))
	}
	ps, err := proxy.NewPools(cfg.Pools, log)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	defer ps.Close()
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("serve: listen: %w", err)
	}
	log.Info("prefixlb serve", "listen", ln.Addr().String(), "pools", strings.Join(names, "; "))
	if err := ps.RunAndServe(ctx, ln); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("drained")
	return nil
}
