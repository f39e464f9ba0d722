package main

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/epp"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tenancy"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// eppFlags are `prefixlb epp`'s flags.
type eppFlags struct {
	grpcListen, healthListen string
	metricsListen            string
	tokenizer                string
	treeMaxBlocks            int
	backends, discovery      string
	kubeconfig               string
	kvEventsListen           string
	policy, profile          string
	calibrate                bool
	blockTokens              int
	seed                     uint64
	fallbacks, maxQueue      int
	queue                    cluster.QueueConfig
	objectives               map[string]int
	maxPromptTokens          int
	kvLinkGbps               float64
	loraAdapters             []string
	loraAdapterBytes         int64
	modelRewrites            string
	watchModelRewrites       bool
	watchObjectives          bool
	kvLinkLatency            time.Duration
	state, routerID, pool    string
	stateTTL                 time.Duration
	drainTimeout             time.Duration
	ports                    discovery.Ports
	scrape                   time.Duration
	explain                  tenancy.Explain
	adminToken               string
	tenantIsolation          bool
	tenantSaltSecret         string
	logLevel                 string
	backendKind              string
	tenantsFile              string
	trustClientHeaders       bool
	limits                   epp.Limits
}

func newEPPCmd() *cobra.Command {
	f := &eppFlags{}
	cmd := &cobra.Command{
		Use:   "epp",
		Short: "Endpoint Picker for the Gateway API Inference Extension (Envoy ext_proc)",
		Long: `prefixlb epp runs the routing core behind Envoy's ext_proc gRPC protocol as an
Endpoint Picker: a gateway (kgateway, Istio, GKE) asks it which pod serves each
request and it answers with the x-gateway-destination-endpoint header and
envoy.lb metadata. Replicas come from --backend or from Kubernetes
(--discovery service:NS/NAME or inferencepool:NS/NAME). Several epp replicas
share one cache view through the engines' KV events, and their in-flight load
through Redis (--state redis://host:6379/0).

--tokenizer (qwen3, a tokenizer.json or a model directory) keys prompts by the
replicas' token ids, so that they match the blocks vLLM's KV events report;
without it prompts are keyed by text chunks. Each replica's /tokenize is
compared with it when the replica joins and whenever it is ready again: while
one differs, prompts are keyed by text chunks (prefixlb_tokenizer_match,
prefixlb_tokenizer_fallback). --metrics-listen (:9090) serves
the picker's Prometheus metrics at /metrics, and the replicas as the picker
sees them (backend kind, cache view) at /debug/replicas. See docs/kubernetes.md.

--backend-kind (auto, vllm, sglang, llamacpp) is the replicas' engine; with
auto each replica's is detected when it joins and whenever it is ready again
(its /metrics names, llama.cpp's /props, /v1/models owned_by, the Server
header). A llama.cpp replica's slot cache is modelled from its /props
total_slots and its cached tokens read from the timings of its responses.

--calibrate (on by default) learns each replica's real prefill and decode
speed from the response path (first tokens, the gaps between streamed tokens,
llama.cpp's timings), starting from --profile: a pool of mixed GPUs gets each
pod its own speed (docs/calibration.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runEPP(cmd.Context(), cmd, f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.grpcListen, "grpc-listen", ":9002", "ext_proc gRPC address (health is served here too)")
	fs.StringVar(&f.healthListen, "health-listen", ":9003", "gRPC health address for probes (\"\": none)")
	fs.StringVar(&f.metricsListen, "metrics-listen", ":9090", "HTTP address of the picker's Prometheus /metrics (\"\": none)")
	fs.StringVar(&f.tokenizer, "tokenizer", "", "replicas' tokenizer for token-exact keys that match vLLM's KV events, checked against each replica's /tokenize: qwen3 (bundled), a tokenizer.json or a model directory; auto: the bundled Qwen3 once a replica's /tokenize confirms it, text chunks until then; none: text chunks")
	fs.IntVar(&f.treeMaxBlocks, "tree-max-blocks", 0, "bound of the router's prefix tree in blocks (0: 2M, about 420 MiB of heap, ~200 bytes a block; RSS about twice the heap)")
	fs.StringVar(&f.backends, "backend", "", "static replicas ip:port[,ip:port..] (instead of --discovery)")
	fs.StringVar(&f.discovery, "discovery", "", "service:NAMESPACE/NAME or inferencepool:NAMESPACE/NAME")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster config)")
	fs.StringVar(&f.policy, "policy", "e2", "routing policy spec")
	fs.StringVar(&f.profile, "profile", "llama3.1-8b-h100", "cost profile: built-in name or YAML file, optionally :time_scale=X")
	fs.BoolVar(&f.calibrate, "calibrate", true, "learn each replica's real prefill and decode speed from the requests it serves, starting from --profile (--calibrate=false: price with the profile as configured)")
	fs.IntVar(&f.blockTokens, "block-tokens", 16, "engine KV block size in tokens")
	fs.Uint64Var(&f.seed, "seed", 0, "random seed of the router")
	fs.IntVar(&f.fallbacks, "fallbacks", 2, "fallback endpoints after the primary (-1: none)")
	fs.IntVar(&f.maxQueue, "max-queue", 0, "answer 429 when every replica's queue is at least this (0: never)")
	f.queue = cluster.DefaultQueueConfig()
	q := &f.queue.Admission
	fs.BoolVar(&f.queue.On, "queue", true, "router-side queue: while every replica is saturated the request is held in the picker by priority (x-prefixlb-priority, or its InferenceObjective's) and tenant, and shed with 429 past its deadline or timeout (docs/overload.md; --queue=false: off)")
	queueFlags(fs, q)
	fs.StringToIntVar(&f.objectives, "objective-priority", nil, "InferenceObjective=priority,...: the spec.priority of the objectives requests name in x-gateway-inference-objective")
	fs.StringVar(&f.modelRewrites, "model-rewrites", "", "file of InferenceModelRewrite manifests (GIE's model aliases, fallbacks and weighted splits) for this pool: a request's model is rewritten before it is routed")
	fs.BoolVar(&f.watchModelRewrites, "watch-model-rewrites", false, "follow the InferenceModelRewrite objects of the --discovery inferencepool's namespace in the cluster (GIE's model aliases, fallbacks and splits; needs RBAC to list and watch them) instead of --model-rewrites")
	fs.BoolVar(&f.watchObjectives, "watch-objectives", false, "follow the InferenceObjective objects of the --discovery inferencepool's namespace: the priority at which requests naming one in x-gateway-inference-objective are queued (over --objective-priority; needs RBAC to list and watch them)")
	fs.Int64Var(&f.loraAdapterBytes, "lora-adapter-bytes", 0, "size of each LoRA adapter's weights in bytes, which prices a load on a replica that lacks it (engine's --lora-adapter-bytes); 0: the profile's fixed cost alone")
	fs.StringSliceVar(&f.loraAdapters, "lora-adapters", nil, "model names that are LoRA adapters (vLLM's --lora-modules), comma-separated: keyed apart from the base model's and each other's")
	fs.Float64Var(&f.kvLinkGbps, "kv-link-gbps", 400, "with a P/D policy and pods labelled llm-d.ai/role=prefill: each pod's KV-transfer link, Gbit/s, as the policy prices a transfer")
	fs.DurationVar(&f.kvLinkLatency, "kv-link-latency", time.Millisecond, "with a P/D policy: one KV transfer's fixed latency")
	fs.IntVar(&f.maxPromptTokens, "max-prompt-tokens", 1<<20, "longest prompt accepted, in tokens (estimated from bytes without --tokenizer); longer ones get 400, as serve's")
	fs.StringVar(&f.state, "state", "", "shared in-flight state: redis://[user:pass@]host:6379/DB (\"\": none)")
	fs.DurationVar(&f.stateTTL, "state-ttl", 15*time.Second, "how long a dead router's counts outlive it")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", epp.DefaultDrainTimeout, "how long shutdown waits for open ext_proc streams before closing them (as serve's)")
	fs.StringVar(&f.routerID, "router-id", "", "this router's id in the shared state (default $POD_NAME, else hostname-pid)")
	fs.StringVar(&f.pool, "pool", "", "key namespace in the shared state (default: the --discovery target)")
	portFlags(fs, &f.ports, "")
	fs.DurationVar(&f.scrape, "scrape-interval", time.Second, "how often to read each replica's /metrics (0: never)")
	fs.StringVar(&f.kvEventsListen, "kv-events-listen", "", "bind a ZMQ SUB socket here (tcp://0.0.0.0:5557) for replicas whose engines dial the router with their KV events; topic kv@<ip:port>@<model> names the replica (docs/kv-events.md)")
	fs.StringVar(&f.backendKind, "backend-kind", "auto", "replicas' engine: auto (detect each replica's when it joins and is ready again), vllm, sglang or llamacpp")
	f.explain = tenancy.ExplainTrusted
	fs.Var(tenancy.ExplainFlag{V: &f.explain}, "explain", "which upstream requests get x-prefixlb-route (the decision explained: matched tokens per replica, a cache oracle) and, with e2, x-prefixlb-route-terms: never, trusted (requests presenting --admin-token in x-prefixlb-admin-token or Authorization: Bearer) or always; bare --explain is always")
	fs.Lookup("explain").NoOptDefVal = string(tenancy.ExplainAlways)
	fs.StringVar(&f.adminToken, "admin-token", "", "the token --explain=trusted asks for (default $PREFIXLB_ADMIN_TOKEN)")
	fs.BoolVar(&f.tenantIsolation, "tenant-isolation", false, "salt every request with its tenant: the body's cache_salt becomes a keyed hash of the tenant and the client's cache_salt, as serve --tenant-isolation (llama.cpp replicas: router-side only)")
	fs.StringVar(&f.tenantSaltSecret, "tenant-salt-secret", "", "key of the tenant salts, the same on every router of the pool (default $PREFIXLB_TENANT_SALT_SECRET)")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&f.tenantsFile, "tenants", "", "YAML file of tenants (tenants: name, api_key_sha256, api_keys_env, tokens_per_minute, burst_tokens; anonymous_tokens_per_minute; require_tenant): told by their API key, with token quotas (docs/overload.md)")
	fs.BoolVar(&f.trustClientHeaders, "trust-client-headers", false, "believe x-prefixlb-tenant, -priority and -ttft-slo on requests: only when the gateway strips these headers from clients (default: ignored and counted in prefixlb_untrusted_headers_total)")
	limitFlags(fs, &f.limits)
	return cmd
}

// limitFlags binds the flags of the ext_proc server's limits (epp.Limits;
// docs/kubernetes.md "Limits").
func limitFlags(fs *pflag.FlagSet, l *epp.Limits) {
	*l = epp.DefaultLimits()
	fs.IntVar(&l.MaxStreams, "max-streams", l.MaxStreams, "ext_proc streams (requests in the gateway) open at once; one more is answered 429")
	fs.Int64Var(&l.MaxBufferedBytes, "max-buffered-bytes", l.MaxBufferedBytes, "request-body bytes buffered across all streams until each body is whole; a body that would pass it is answered 429 (the last eighth is kept for bodies ≤ 1 MiB)")
	fs.DurationVar(&l.StreamIdleTimeout, "stream-idle-timeout", l.StreamIdleTimeout, "longest wait for the next ext_proc message before the request is whole (routed); the stream then ends and frees its buffer. The response path is not bounded")
}

func init() { rootCmd.AddCommand(newEPPCmd()) }

// runEPP reads the flags into an epp.RunConfig and runs it until ctx
// ends (or SIGINT, SIGTERM).
func runEPP(ctx context.Context, cmd *cobra.Command, f *eppFlags) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return fmt.Errorf("epp: --log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
	kind, err := upstream.ParseKind(f.backendKind)
	if err != nil {
		return fmt.Errorf("epp: --backend-kind: %w", err)
	}
	cfg := epp.Config{Policy: f.policy, Profile: f.profile, NoCalibrate: !f.calibrate, BlockTokens: f.blockTokens, Seed: f.seed,
		Fallbacks: f.fallbacks, MaxQueue: f.maxQueue, MaxPromptTokens: f.maxPromptTokens, ScrapeInterval: f.scrape, KVEventsListen: f.kvEventsListen,
		KVLink:       policy.KVLink{BytesPerSecond: f.kvLinkGbps * 1e9 / 8, Latency: f.kvLinkLatency},
		LoRAAdapters: f.loraAdapters, LoRAAdapterBytes: f.loraAdapterBytes, Tokenizer: f.tokenizer,
		TreeMaxBlocks: f.treeMaxBlocks, BackendKind: kind, Objectives: f.objectives}
	cfg.TenantIsolation, cfg.TenantSaltSecret = f.tenantIsolation, cmp.Or(f.tenantSaltSecret, os.Getenv("PREFIXLB_TENANT_SALT_SECRET"))
	adminToken := cmp.Or(f.adminToken, os.Getenv("PREFIXLB_ADMIN_TOKEN"))
	if f.queue.On {
		q := f.queue
		cfg.Queue = &q
	}
	if cfg.Tenants, err = eppTenants(f.tenantsFile, f.trustClientHeaders); err != nil {
		return err
	}
	if f.fallbacks == 0 {
		cfg.Fallbacks = -1
	}
	return epp.Run(ctx, epp.RunConfig{Picker: cfg, GRPCListen: f.grpcListen, HealthListen: f.healthListen,
		MetricsListen: f.metricsListen, Explain: f.explain, AdminToken: adminToken, Backends: f.backends, Discovery: f.discovery,
		Kubeconfig: f.kubeconfig, Ports: f.ports, ModelRewrites: f.modelRewrites, WatchModelRewrites: f.watchModelRewrites, WatchObjectives: f.watchObjectives, State: f.state, RouterID: f.routerID, Pool: f.pool,
		StateTTL: f.stateTTL, DrainTimeout: f.drainTimeout, Logger: log, Limits: f.limits})
}

// portFlags binds the flags that place each discovered replica's
// endpoints (discovery.Ports), for epp and serve --discovery; note
// prefixes their help.
func portFlags(fs *pflag.FlagSet, p *discovery.Ports, note string) {
	fs.IntVar(&p.HTTP, "http-port", 0, note+"replicas' OpenAI port (0: the pool's targetPort or the Service's http port)")
	fs.IntVar(&p.Metrics, "metrics-port", 0, note+"replicas' metrics port (0: the HTTP port; -1: do not scrape)")
	fs.IntVar(&p.KVEvents, "kv-events-port", 0, note+"replicas' KV-event PUB port, e.g. 5557 (0: none)")
	fs.IntVar(&p.KVReplay, "kv-replay-port", 0, note+"replicas' KV-event replay port (0: kv-events-port+1; -1: none)")
	fs.StringVar(&p.KVTopic, "kv-topic", "", note+"KV-event topic prefix; {ip} and {port} are replaced (\"\": all)")
}

// eppTenants is epp's tenant configuration: the --tenants file (none: no
// configured tenant), and whether the gateway's class headers are
// believed (--trust-client-headers).
func eppTenants(file string, trust bool) (tenant.Config, error) {
	c := tenant.Config{TrustClientHeaders: trust}
	if file == "" {
		return c, nil
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return c, fmt.Errorf("epp: --tenants: %w", err)
	}
	if c, err = tenant.ParseFile(data, c); err != nil {
		return c, fmt.Errorf("epp: --tenants %s: %w", file, err)
	}
	return c, nil
}
