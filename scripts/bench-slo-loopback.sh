#!/usr/bin/env bash
# bench --slo against a live router on loopback: 2 modelled A6000 replicas
# (prefixlb engine, mistral-7b-a6000, real time) behind prefixlb serve, one
# policy per run (fresh engines each time, so no run inherits another's
# caches), toolbench Zipf-1.1 through a ramp of 30-second stages.
# Writes docs/results/bench-slo-<policy>.txt and .json (docs/capacity.md);
# RAMP=... sets the stages (the step-4 run there: RAMP=8:30s,12:30s,...,36:30s).
# Usage: scripts/bench-slo-loopback.sh [policy...]   (default: round-robin e2)
set -euo pipefail
cd "$(dirname "$0")/.."
go build -o /tmp/prefixlb-benchslo ./cmd/prefixlb
P=/tmp/prefixlb-benchslo
RAMP=${RAMP:-8:30s,16:30s,24:30s,32:30s,40:30s,48:30s,56:30s,64:30s}
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done; pids=(); }
trap stop EXIT
for pol in ${*:-round-robin e2}; do
  $P engine --listen 127.0.0.1:18101 --profile mistral-7b-a6000 >/tmp/benchslo-e1.log 2>&1 & pids+=($!)
  $P engine --listen 127.0.0.1:18102 --profile mistral-7b-a6000 >/tmp/benchslo-e2.log 2>&1 & pids+=($!)
  $P serve --listen 127.0.0.1:18180 --backend http://127.0.0.1:18101,http://127.0.0.1:18102 \
    --policy "$pol" --profile mistral-7b-a6000 >/tmp/benchslo-serve.log 2>&1 & pids+=($!)
  for _ in $(seq 50); do curl -sf http://127.0.0.1:18180/v1/models >/dev/null && break; sleep 0.2; done
  echo "== $pol" >&2
  { echo "# prefixlb bench --mode completions --target http://127.0.0.1:18180 --workload toolbench --zipf 1.1 --workload-replicas 2 --label $pol --slo ttft_p90=2s --ramp $RAMP"
    start=$SECONDS
    $P bench --mode completions --target http://127.0.0.1:18180 --workload toolbench --zipf 1.1 --workload-replicas 2 --label "$pol" \
      --slo ttft_p90=2s --ramp "$RAMP" --json "docs/results/bench-slo-$pol.json" 2>&1
    echo "# $((SECONDS - start)) s wall; $(uptime | sed 's/.*load average/load average/') (2-core machine)"
  } > "docs/results/bench-slo-$pol.txt"
  stop
done
