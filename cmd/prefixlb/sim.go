package main

import (
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/sim/sweep"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// newSimCmd is `prefixlb sim`: its flags fill a sweep.Config, and
// sweep.Run simulates and reports it.
func newSimCmd() *cobra.Command {
	c := &sweep.Config{Workload: workload.DefaultFlags()}
	var cpuProfile string
	c.Workload.Spec.Requests = 2000
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Simulate a cluster of replicas behind each policy on a workload or trace",
		Long: `sim runs a discrete-event simulation of N modelled GPU replicas behind the
routing core, once per policy (and per rate in a sweep), on a built-in workload
or a trace, and prints TTFT, latency and hit-ratio figures next to the oracle
bound (every request alone on a replica that holds every earlier prefix).

Policies may carry E2 settings and a local scheduler of their own:
  --policies 'round-robin@lpm,e2@priority,e2-preble:mixing=false'.

--engine llamacpp models llama.cpp's llama-server instead of vLLM: each
replica has --slots slots (-np, default 2) splitting the profile's KV capacity
(-c), each keeping the last prompt it served; a request takes the idle slot it
shares most of (above llama.cpp's --slot-prompt-similarity, 0.5) or the least recently used
one, reuses only the common prefix with it and waits while every slot is busy.
The router is told each replica's slots. Unless given, --chunk-budget becomes
2048 (n_batch), --kv-events false (llama.cpp publishes none) and --profile
llamacpp-tiny-cpu (the tiny test model on one CPU thread, docs/profiles.md).
The local scheduler must be fcfs.

Each replica batches as its profile's engine does unless --chunk-budget and
--max-seqs say otherwise: vLLM's defaults for the OpenAI server by GPU
(max_num_batched_tokens 8192 and max_num_seqs 1024 on GPUs of 70 GiB or
more other than the A100; 2048 and 256 elsewhere), and Preble's 512-token
chunks on mistral-7b-a6000 (docs/profiles.md).

A profile is a built-in name or a YAML file, optionally with scaled times:
'llama3.1-8b-h100:time_scale=0.5' is twice as fast. --replica-profiles
gives each replica its own (a mixed cluster; NAME*N repeats one), and
--router-profile tells the router another than the replicas' true ones.
--calibrate makes the router learn each replica's real prefill and decode
speed from first tokens and finishes (and llama.cpp's timings), starting
from the profile it was told (internal/calibrate; docs/calibration.md).

--prefill-replicas K makes the first K replicas prefill replicas and the rest
decode replicas (docs/pd.md): a disaggregating policy prefills a request on
one, moves the KV its decode replica lacks over --kv-link-gbps links (shared
by the transfers on each) with --kv-link-latency per transfer, and decodes it
there; the profile must give KV bytes per token (a roofline does).

--dataset sharegpt|loogle FILE simulates a real-text dataset, tokenized
with --tokenizer (default the bundled Qwen3) into the token ids bench sends
with --mode completions (its text's), as bench --dataset does: a
conversation's next turn arrives once its previous turn has finished and
not before its arrival at --rate; --requests caps the requests taken
(docs/traces.md).

--slo 'ttft_p90=2s[,tpot_p90=100ms]' searches each policy's capacity at the
objective instead of simulating given rates: the highest request rate at
which every target holds (METRIC_pP=LIMIT; metrics ttft, tpot, e2e; any
percentile in (0, 100]). The search starts at --rate (a trace at its own
rate), doubles while the SLO holds or halves while it does not, then
bisects until within --slo-tolerance; each rate is a full simulation of the
same requests (Poisson arrivals redrawn at the rate from --seed, a trace
compressed or stretched in time). It prints each policy's capacity_rps,
the percentiles and goodput (requests/s that met every limit) at it, and
the goodput of every rate tried; the JSON holds every run with
capacity_rps, goodput_rps, slo_met and at_capacity (docs/capacity.md).`,
		Example: `  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --policies round-robin,e2 --rates 4,8,12
  prefixlb sim --trace trace.jsonl --trace-format mooncake --replicas 8 --profile llama3-70b-h100x2 --json out.json
  prefixlb sim --engine llamacpp --slots 2 --workload toolbench --replicas 3 --rate 1 --requests 300 --policies round-robin,e2
  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --rate 60 \
      --replica-profiles 'llama3.1-8b-h100*2,llama3.1-8b-a100*2' --router-profile llama3.1-8b-h100 --calibrate
  prefixlb sim --workload toolbench --zipf 1.1 --replicas 4 --requests 2000 --policies round-robin,e2 --slo ttft_p90=2s
  prefixlb sim --dataset loogle testdata/loogle-sample.jsonl --replicas 2 --rate 1 --policies round-robin,prefix,e2
  prefixlb sim --workload coding-agent --replicas 8 --prefill-replicas 2 --profile qwen3-32b-h100x2 \
      --policies e2,round-robin-pd,llmd-pd,dynamo-pd,e2-pd --rate 1`,
		Args: datasetArgs(&c.Workload),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("workload-replicas") {
				c.Workload.Spec.Replicas = c.Replicas
			}
			c.Changed = cmd.Flags().Changed
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			if cpuProfile != "" {
				stopProfile, err := startCPUProfile(cpuProfile)
				if err != nil {
					return err
				}
				defer stopProfile()
			}
			return sweep.Run(ctx, *c, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	c.Workload.AddFlags(fs)
	addDatasetFlags(fs, &c.Workload, true)
	fs.IntVar(&c.Replicas, "replicas", 4, "number of replicas")
	fs.StringVar(&c.Profile, "profile", "mistral-7b-a6000", "cost profile: a name ("+strings.Join(costmodel.Names(), ", ")+") or a YAML file, optionally :time_scale=X, :prefill_scale=X, :decode_scale=X")
	fs.StringVar(&c.ReplicaProfiles, "replica-profiles", "", "each replica's own true profile, comma-separated, SPEC*N repeating one (a mixed cluster; replaces --profile for the replicas)")
	fs.StringVar(&c.RouterProfile, "router-profile", "", "the profile the router's cost model is told for every replica (default: each replica's own true one)")
	fs.BoolVar(&c.Calibrate, "calibrate", false, "the router learns each replica's real prefill and decode speed online, starting from the profile it was told")
	fs.StringVar(&c.Policies, "policies", "round-robin,llmd-precise,e2", "comma-separated policies: "+strings.Join(policy.Names(), ", "))
	fs.StringVar(&c.Rates, "rates", "", "comma-separated request rates to sweep (overrides --rate)")
	fs.StringVar(&c.Local, "local", "fcfs", "replicas' local scheduler: fcfs, lpm, priority")
	fs.IntVar(&c.ChunkBudget, "chunk-budget", 0, "prefill token budget per iteration, decodes included: vLLM's max_num_batched_tokens (0: each profile's engine default; -1: no chunked prefill)")
	fs.IntVar(&c.MaxSeqs, "max-seqs", 0, "most requests running at once per replica: vLLM's max_num_seqs (0: each profile's engine default)")
	fs.BoolVar(&c.KVEvents, "kv-events", true, "feed the router the replicas' KV events (else it mirrors caches from its own decisions)")
	fs.DurationVar(&c.EventLag, "event-lag", 10*time.Millisecond, "delay of KV events on their way to the router")
	fs.IntVar(&c.HostCores, "host-cores", 0, "put every replica on one host of this many CPU cores (CPU engines such as llama.cpp sharing a machine): an iteration that starts while k > N replicas compute takes k/N as long; 0: each replica has its own hardware")
	fs.DurationVar(&c.SpeculativeTTL, "speculative-ttl", 0, "with --kv-events: how long a routed prompt counts as cached on its replica before an event confirms it (0: 2s; negative: off)")
	fs.Uint64Var(&c.RouterSeed, "router-seed", 1, "seed of the router's random choices")
	fs.StringVar(&c.JSONPath, "json", "", "write results as JSON to this file (- for stdout)")
	fs.StringVar(&c.OutDir, "out", "", "write results.json, requests.csv, chart.svg and report.html into this directory")
	fs.BoolVarP(&c.Quiet, "quiet", "q", false, "no progress output")
	fs.StringVar(&c.Engine, "engine", sweep.EngineVLLM, "replica engine to model: vllm (block prefix cache) or llamacpp (llama-server's slot cache; changes the defaults of --chunk-budget, --kv-events and --profile, see above)")
	fs.IntVar(&c.Slots, "slots", sweep.DefaultSlots, "--engine llamacpp: slots per replica (llama-server -np), splitting the profile's KV capacity")
	fs.IntVar(&c.MaxLoras, "max-loras", 0, "LoRA adapters each replica holds in GPU slots (vLLM's --max-loras): a request for another waits for a slot and its load (the profile's adapter_load); 0: adapters not modelled as slots (caches still keep adapters apart)")
	fs.IntVar(&c.KVCapacity, "kv-capacity", 0, "each replica's GPU KV cache in tokens (0: the profile's)")
	fs.IntVar(&c.CPUOffloadTokens, "cpu-offload-tokens", 0, "each replica's CPU offload tier in tokens, as vLLM's OffloadingConnector (CPU backend): blocks written through to a CPU LRU, a prompt continuing there loaded at the profile's CPU bandwidth instead of recomputed, its changes KV events with medium CPU; 0: none (the profile must give KV bytes per token)")
	fs.BoolVar(&c.IgnoreCacheTiers, "ignore-cache-tiers", false, "drop the replicas' KV events of slower cache tiers (CPU) on their way to the router, for every policy, as serve --ignore-cache-tiers (one policy: e2:tier_credit=none)")
	fs.StringVar(&c.TierTrace, "tier-trace", "", "with --cpu-offload-tokens: write every request as CSV to this file, its TTFT split at admission and at the end of its CPU-tier copy (GPU and CPU-tier tokens, replica, ms from arrival)")
	fs.IntVar(&c.PrefillReplicas, "prefill-replicas", 0, "prefill/decode disaggregation: the first N of --replicas are prefill replicas, the rest decode replicas (policies round-robin-pd, llmd-pd, dynamo-pd, e2-pd pick both; the others only decode replicas); 0: none")
	fs.Float64Var(&c.KVLinkGbps, "kv-link-gbps", 400, "--prefill-replicas: each replica's link for KV transfers, Gbit/s, shared by the transfers using it (400: one ConnectX-7 port)")
	fs.DurationVar(&c.KVLinkLatency, "kv-link-latency", time.Millisecond, "--prefill-replicas: fixed time of one KV transfer beyond its bytes")
	fs.StringVar(&c.SLO, "slo", "", "search each policy's capacity at this objective, e.g. ttft_p90=2s,tpot_p90=100ms (metrics ttft, tpot, e2e), instead of simulating given rates")
	fs.Float64Var(&c.SLOTolerance, "slo-tolerance", 0.05, "--slo: the search stops when the lowest rate that missed is within this fraction above the highest that met")
	fs.Float64Var(&c.SLOMaxRate, "slo-max-rate", 0, "--slo: highest rate the search tries (0: 1024 × its start); met there, the capacity is reported as at least it")
	fs.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file (go tool pprof)")
	fs.StringVar(&c.RouterQueue, "router-queue", "", `router-side queue in front of the router (docs/overload.md): "on", or KEY=VALUE,... of max, timeout, max_waiting, max_kv_usage, max_queued_prefill, max_predicted_wait, slo_fraction, engage_after, lifo_after, max_inflight, ttft_slo, ttft_slo.PRIORITY`)
	fs.Lookup("router-queue").NoOptDefVal = "on"
	return cmd
}

// startCPUProfile starts profiling the process's CPU into path; the
// returned function stops it and closes the file.
func startCPUProfile(path string) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

func init() { rootCmd.AddCommand(newSimCmd()) }
