#!/usr/bin/env bash
# The real-engine benchmark (docs/real-engines.md): prefixlb serve in front of
# three real llama.cpp llama-servers on this CPU, every policy in turn with
# fresh servers, on a shared-prefix and a toolbench shape sized for the CPU
# (cold prefills of 1–3 s); then `prefixlb sim --engine llamacpp` on the same
# workloads, so the simulator's ranking of the policies can be held against
# the real one.
#
#   scripts/real-engines.sh [OUT_DIR]        (default docs/results/real-engines)
#
# Needs llama-server: $PREFIXLB_LLAMA_SERVER, else $PREFIXLB_TEST_LLAMA_SERVER,
# else ../shared/engines/llama.cpp/llama-server; and a model:
# $PREFIXLB_LLAMA_MODEL, else the tiny one built with make_tiny_gguf.py beside
# the binary (Debian's python3-numpy). ROUNDS=N runs every policy N times,
# interleaved. Takes about 2 minutes per policy and shape and round.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/real-engines}
mkdir -p "$out"
# The uniform-slowdown variant of the simulation (docs/real-engines.md): the
# measured profile with every time ×1.4.
[ -f "$out/llamacpp-tiny-cpu-x1.4.yaml" ] || cp docs/results/real-engines/llamacpp-tiny-cpu-x1.4.yaml "$out/"
export PREFIXLB_LLAMA_SERVER=${PREFIXLB_LLAMA_SERVER:-${PREFIXLB_TEST_LLAMA_SERVER:-$(cd .. && pwd)/shared/engines/llama.cpp/llama-server}}
rounds=${ROUNDS:-1}
policies=${POLICIES:-round-robin,least-load,llmd-approx,sglang,prefix,e2}
bin=$(mktemp -d)/prefixlb
go build -o "$bin" ./cmd/prefixlb

# The two shapes, the same for the live run and the simulation.
common=(--replicas 3 --requests 120 --rate 1 --output-tokens 24 --seed 1 --profile llamacpp-tiny-cpu)
shared=(--workload shared-prefix --groups 6 --system-prompt-tokens 1800 --questions-per-group 8 --question-tokens 200 --shared-output-tokens 24)
tools=(--workload toolbench --zipf 1.1 --tools 20)

for shape in shared tools; do
  case $shape in
    shared) name=shared-prefix; args=("${shared[@]}") ;;
    tools) name=toolbench; args=("${tools[@]}") ;;
  esac
  echo "== $name: live, over llama-server" >&2
  "$bin" demo --engine llamacpp "${common[@]}" "${args[@]}" --policies "$policies" \
    --rounds "$rounds" --json "$out/$name.json" | tee "$out/$name.txt"
  echo "== $name: prefixlb sim --engine llamacpp" >&2
  "$bin" sim --engine llamacpp --slots 2 "${common[@]}" "${args[@]}" \
    --policies "$policies" --json "$out/$name-sim.json" | tee "$out/$name-sim.txt"
  "$bin" sim --engine llamacpp --slots 2 "${common[@]}" "${args[@]}" --profile "$out/llamacpp-tiny-cpu-x1.4.yaml" \
    --policies "$policies" --json "$out/$name-sim-x1.4.json" >/dev/null
  echo "== $name: prefixlb sim --engine llamacpp --host-cores 2 (the three servers share this machine's two cores)" >&2
  "$bin" sim --engine llamacpp --slots 2 --host-cores 2 "${common[@]}" "${args[@]}" \
    --policies "$policies" --json "$out/$name-sim-host2.json" | tee "$out/$name-sim-host2.txt"
done
