#!/usr/bin/env bash
# Reproduces the real-engine calibration check of docs/calibration.md
# ("Against the real engine"): e2 behind prefixlb serve over three real
# llama-servers on this CPU, calibrating from llama.cpp's timings or from the
# router's clock only, starting from the right profile, one 2× too fast, and
# a GPU profile. The demo prints, per replica, what the router learnt and
# its predictions over llama.cpp's own timings of the same requests.
#
#   scripts/calibration-real-engine.sh [OUT_DIR]  (default docs/results/real-engines/calibration)
#
# Needs llama-server as scripts/real-engines.sh does. About 2 minutes a run (1m51–1m53 measured),
# five runs: about 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/real-engines/calibration}
mkdir -p "$out"
export PREFIXLB_LLAMA_SERVER=${PREFIXLB_LLAMA_SERVER:-${PREFIXLB_TEST_LLAMA_SERVER:-$(cd .. && pwd)/shared/engines/llama.cpp/llama-server}}
bin=$(mktemp -d)/prefixlb
go build -o "$bin" ./cmd/prefixlb

common=(--engine llamacpp --replicas 3 --requests 120 --rate 1 --output-tokens 24 --seed 1 --policies e2)
tools=(--workload toolbench --zipf 1.1 --tools 20)
shared=(--workload shared-prefix --groups 6 --system-prompt-tokens 1800 --questions-per-group 8 --question-tokens 200 --shared-output-tokens 24)

run() {
  local name=$1; shift
  echo "== $name: prefixlb demo $*" >&2
  "$bin" demo "${common[@]}" "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.txt"
}
run tb-timings "${tools[@]}" --profile llamacpp-tiny-cpu
run tb-clock "${tools[@]}" --profile llamacpp-tiny-cpu --calibrate-timings=false
run tb-clock-fast "${tools[@]}" --profile 'llamacpp-tiny-cpu:time_scale=0.5' --calibrate-timings=false
run tb-clock-h100 "${tools[@]}" --profile llama3.1-8b-h100 --calibrate-timings=false
run sp-clock "${shared[@]}" --profile llamacpp-tiny-cpu --calibrate-timings=false
