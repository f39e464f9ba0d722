package main

import (
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/replica"
)

func init() { rootCmd.AddCommand(engineCmd()) }

// engineCmd is `prefixlb engine`: one modelled replica (package engine)
// served over HTTP until SIGINT or SIGTERM (engine.Serve).
func engineCmd() *cobra.Command {
	sc := engine.ServeConfig{Engine: engine.DefaultConfig()}
	cfg := &sc.Engine
	var verbose bool
	cmd := &cobra.Command{
		Use:   "engine --listen ADDR --profile NAME [--kv-events tcp://*:5557] [--time-scale X]",
		Short: "Serve a modelled GPU replica behind vLLM's HTTP API",
		Long: `engine serves one modelled GPU replica (continuous batching, chunked prefill,
a KV cache with prefix caching and LRU eviction) behind vLLM's OpenAI-compatible
API, in real time: /v1/completions and /v1/chat/completions (streamed or not,
with usage.prompt_tokens_details.cached_tokens), /v1/models, /health, /tokenize
and /metrics with vLLM's metric names. Put several behind 'prefixlb serve' to try
a router without GPUs.

Every request generates exactly max_tokens tokens (as with ignore_eos) of
deterministic text: the same request always gets the same answer. Text prompts
are tokenized one token per word, unless --tokenizer names a real tokenizer
(qwen3, bundled; a tokenizer.json; or a model directory): then prompts are
tokenized, and chats rendered with its chat template, exactly as vLLM does, in
/v1/* and /tokenize alike. --time-scale X runs the model X times faster
than the profile says; latencies in /metrics are real (scaled) time.

--kv-events ENDPOINT publishes the KV cache's changes as vLLM's KV events
(ZeroMQ PUB, [topic, seq, msgpack batch]; docs/kv-events.md): like vLLM, an
endpoint with '*' (tcp://*:5557) is bound, any other is dialled (for a router
that binds one SUB). The replay ROUTER socket (--kv-replay, default the events
port + 1) is always bound.

--cpu-offload-tokens N adds a CPU offload tier of N tokens, as vLLM's
OffloadingConnector with its CPU backend: full blocks are written through to a
CPU LRU, a prompt that continues there past its GPU hit loads those blocks at
the profile's CPU bandwidth instead of recomputing them, and the tier's changes
are published like vLLM's (BlockStored without token ids or parent, and
BlockRemoved, medium CPU).

--role prefill|decode|both speaks vLLM's prefill/decode disaggregation
protocol (NixlConnector's kv_transfer_params; docs/pd.md): a request with
{"do_remote_decode": true} is a prefill leg, answered with the params the
decode leg needs (this engine's --engine-id, host, port, the prompt's
blocks); a request with {"do_remote_prefill": true, "remote_engine_id": ...}
is a decode leg, which pulls the prompt blocks it does not cache over a
modelled link of --kv-link-gbps plus --kv-link-latency per pull, shared by
the pulls in flight, then decodes. A prefill engine takes only prefill legs;
a decode engine needs a profile with a KV size (the roofline ones).`,
		Example: `  prefixlb engine --listen 127.0.0.1:8001 --profile llama3.1-8b-h100
  prefixlb engine --listen :8000 --profile mistral-7b-a6000 --time-scale 10 --local lpm
  prefixlb engine --listen 127.0.0.1:8001 --kv-events 'tcp://*:5557'   # replay on tcp://*:5558
  prefixlb engine --listen 127.0.0.1:8100 --role prefill --profile qwen3-32b-h100x2
  prefixlb engine --listen 127.0.0.1:8200 --role decode --profile qwen3-32b-h100x2 --kv-link-gbps 200`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			level := slog.LevelInfo
			if verbose {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
			if cfg.KVLinkLatency == 0 {
				cfg.KVLinkLatency = -1 // --kv-link-latency 0: none (Config's zero is the default)
			}
			return engine.Serve(ctx, sc, log)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&sc.Listen, "listen", "127.0.0.1:8000", "address to serve HTTP on")
	fs.StringVar(&sc.Profile, "profile", costmodel.Llama31_8BH100, "cost profile name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file")
	fs.StringVar(&cfg.Model, "model", cfg.Model, "model name served in /v1/models and responses")
	fs.StringSliceVar(&cfg.LoRAModules, "lora-modules", nil, "LoRA adapters served under their own model names, comma-separated (vLLM's --lora-modules): keyed and published apart (lora_name), listed in /v1/models")
	fs.IntVar(&cfg.Replica.MaxLoras, "max-loras", cfg.Replica.MaxLoras, "GPU slots for LoRA adapters, LRU (vLLM's --max-loras; 0: adapters are not modelled as slots)")
	fs.Int64Var(&cfg.LoRAAdapterBytes, "lora-adapter-bytes", 84<<20, "size of each adapter's weights, which a load copies to the GPU (84 MiB: rank 16 on Llama-3.1-8B)")
	fs.BoolVar(&cfg.StrictModel, "strict-model", false, "answer 404 to requests naming another model (as vLLM does)")
	fs.Float64Var(&cfg.TimeScale, "time-scale", 1, "run the model this many times faster than real time")
	fs.IntVar(&cfg.Replica.BlockSize, "block-size", cfg.Replica.BlockSize, "KV block size in tokens")
	fs.IntVar(&cfg.Replica.KVCapacity, "kv-capacity", 0, "KV cache size in tokens (0: the profile's)")
	fs.IntVar(&cfg.Replica.CPUOffloadTokens, "cpu-offload-tokens", 0, "CPU offload tier in tokens, as vLLM's OffloadingConnector with its CPU backend: blocks written through to a CPU LRU, loaded at the profile's CPU bandwidth instead of recomputed, published as KV events with medium CPU (0: none; the profile must give KV bytes per token)")
	fs.IntVar(&cfg.Replica.ChunkBudget, "chunk-budget", cfg.Replica.ChunkBudget, "prefill token budget per iteration, decodes included: vLLM's max_num_batched_tokens (0: the profile's engine default, e.g. 8192 on an H100; -1: no chunked prefill)")
	fs.IntVar(&cfg.Replica.MaxRunning, "max-running", cfg.Replica.MaxRunning, "most requests running at once: vLLM's max_num_seqs (0: the profile's engine default)")
	fs.StringVar(&cfg.Replica.Local, "local", cfg.Replica.Local, "local scheduler: fcfs, lpm, priority")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", cfg.MaxModelLen, "most prompt plus output tokens per request")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body accepted")
	fs.IntVar(&cfg.DefaultMaxTokens, "default-max-tokens", cfg.DefaultMaxTokens, "output tokens of a request without max_tokens")
	fs.StringVar(&sc.KV.Endpoint, "kv-events", "", "publish KV-cache events on this ZMQ endpoint: tcp://*:PORT binds, tcp://HOST:PORT dials")
	fs.StringVar(&sc.KV.Replay, "kv-replay", "", "ZMQ endpoint of the KV-event replay socket, always bound (default: --kv-events with port+1)")
	fs.BoolVar(&sc.KV.Bind, "kv-bind", false, "bind --kv-events even without * (e.g. tcp://127.0.0.1:5557: loopback only)")
	fs.StringVar(&sc.KV.Encoding, "kv-encoding", "array", "KV-event encoding: array (vLLM <= 0.23) or map (vLLM >= 0.26)")
	fs.StringVar(&sc.KV.Topic, "kv-topic", "", "KV-event topic (default kv@<listen>@<model>, as vLLM)")
	fs.StringVar(&sc.Tokenizer, "tokenizer", "", "real tokenizer: qwen3 (bundled), a tokenizer.json or a model directory (default: one token per word)")
	fs.DurationVar(&sc.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "how long to let requests in flight finish on SIGINT/SIGTERM")
	fs.StringVar(&cfg.Replica.Role, "role", replica.RoleBoth, "role in prefill/decode disaggregation: prefill (one-token prefill legs only), decode (pulls the prefill's KV) or both")
	fs.StringVar(&cfg.EngineID, "engine-id", "", "engine id named in prefill legs' kv_transfer_params, vLLM's remote_engine_id (default: a random UUID)")
	fs.Float64Var(&cfg.KVLinkGbps, "kv-link-gbps", engine.DefaultKVLinkGbps, "bandwidth of the modelled link decode legs pull KV over, Gb/s, shared by the pulls in flight")
	fs.DurationVar(&cfg.KVLinkLatency, "kv-link-latency", engine.DefaultKVLinkLatency, "latency each pull pays once on the modelled link")
	fs.StringVar(&cfg.KVAdvertise, "kv-advertise", "", "host:port a prefill leg's kv_transfer_params name as remote_host and remote_port (default: the address the request came in on)")
	fs.BoolVarP(&verbose, "verbose", "v", false, "debug logging")
	return cmd
}
