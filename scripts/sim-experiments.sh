#!/usr/bin/env bash
# Reproduces every simulator figure in docs/simulator.md. Each experiment
# writes its table to docs/results/<name>.txt (and JSON next to it).
# Usage: scripts/sim-experiments.sh [name...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
go build -o /tmp/prefixlb-exp ./cmd/prefixlb
P=/tmp/prefixlb-exp
out=docs/results
mkdir -p "$out"
run() { # name, args...
  local name=$1; shift
  echo "== $name: prefixlb sim $*" >&2
  { echo "# prefixlb sim $*"; $P sim -q --json "$out/$name.json" "$@"; } > "$out/$name.txt"
}
want() { [ -z "$SEL" ] || [[ " ${SEL} " == *" $1 "* ]]; }
SEL="$*"

# Preble, Mistral-7B on 4 A6000s: e2 + priority scheduler vs round-robin + lpm.
want preble-toolbench && run preble-toolbench --workload toolbench --zipf 1.1 --replicas 4 --requests 4000 \
  --rates 36,40,44,48 --policies round-robin@lpm,llmd-precise@lpm,e2@priority,e2-preble@priority
want preble-loogle && run preble-loogle --workload loogle --replicas 4 --requests 800 \
  --rates 0.25,0.5,0.75,1 --policies round-robin@lpm,llmd-precise@lpm,e2@priority,e2-preble@priority
# Ablation (Preble Fig. "each mechanism trims part of the tail"): the prototype's
# rules with one mechanism off at a time, toolbench Zipf-1.1 at 44 req/s.
want ablation && run ablation --workload toolbench --zipf 1.1 --replicas 4 --requests 4000 --rates 44 \
  --policies 'round-robin@lpm,e2-preble@priority,e2-preble:rebalance=false:replicate=false@priority,e2-preble:mixing=false@priority,e2-preble@lpm,e2@priority,e2:rebalance=false:replicate=false@priority,e2@lpm'
# llm-d: shared-prefix on 8 x Qwen3-32B (2xH100 each), Poisson ramp.
want llmd && run llmd --workload shared-prefix --replicas 8 --profile qwen3-32b-h100x2 --arrival ramp \
  --ramp "3:60s,5:60s,8:60s,10:60s,12:60s,15:60s" --requests 3180 \
  --policies llmd-precise,llmd-approx,least-load,random,e2,e2-preble,round-robin
# Every generator at high load on 4 x Mistral-7B.
want all-toolbench && run all-toolbench --workload toolbench --zipf 1.1 --replicas 4 --requests 3000 --rates 40 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-loogle && run all-loogle --workload loogle --replicas 4 --requests 600 --rates 1 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-videoqa && run all-videoqa --workload videoqa --replicas 4 --requests 1000 --rates 2 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-programming && run all-programming --workload programming --replicas 4 --requests 1500 --rates 18 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-agent && run all-agent --workload agent --replicas 4 --requests 2000 --rates 48 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-rag && run all-rag --workload rag --replicas 4 --requests 1500 --rates 12 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-coding-agent && run all-coding-agent --workload coding-agent --replicas 4 --requests 600 --rates 0.6 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
want all-shared-prefix && run all-shared-prefix --workload shared-prefix --replicas 8 --profile qwen3-32b-h100x2 --requests 2000 --rates 8 --policies round-robin,least-load,llmd-precise,llmd-approx,sglang,dynamo,prefix,e2,e2-preble
# The synthetic Mooncake trace (real block-level sharing), replayed at 2x speed.
want mooncake && run mooncake --trace internal/workload/testdata/mooncake_synthetic_trace.jsonl.gz --trace-format mooncake --time-scale 2 \
  --replicas 8 --profile llama3.1-8b-h100 --policies round-robin,llmd-precise,e2
# Event-fed view (with lag) against the router's own mirror.
want events && run events --workload toolbench --zipf 1.1 --replicas 4 --requests 3000 --rates 40 --policies llmd-precise,e2 --event-lag 50ms
want mirror && run mirror --workload toolbench --zipf 1.1 --replicas 4 --requests 3000 --rates 40 --policies llmd-precise,e2 --kv-events=false
echo done >&2
