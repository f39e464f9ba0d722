#!/usr/bin/env bash
# Reproduces the calibration figures of docs/calibration.md: e2 told each
# replica's true profile, told a wrong one, and told the wrong one but
# calibrating (sim --calibrate), with llm-d's precise scorer on the same runs.
# Each case writes docs/results/calibration-<name>.txt (the three or four
# tables, one per variant) and .json next to it.
# Usage: scripts/calibration-experiments.sh [name...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
go build -o /tmp/prefixlb-cal ./cmd/prefixlb
P=/tmp/prefixlb-cal
out=docs/results
mkdir -p "$out"
want() { [ -z "$SEL" ] || [[ " ${SEL} " == *" $1 "* ]]; }
SEL="$*"

# case NAME TOLD ARGS...: e2 and llmd-precise on the true profiles, then e2
# told TOLD uncalibrated and calibrated. Every run prints a busy column: the
# share of the run the replicas spent computing.
case_() {
  local name=$1 told=$2; shift 2
  echo "== $name: $* (told $told)" >&2
  {
    echo "# true profiles: prefixlb sim $* --policies e2,llmd-precise"
    $P sim -q --json "$out/calibration-$name-true.json" "$@" --policies e2,llmd-precise
    echo
    echo "# told $told: prefixlb sim $* --router-profile $told --policies e2"
    $P sim -q --json "$out/calibration-$name-told.json" "$@" --router-profile "$told" --policies e2
    echo
    echo "# told $told, calibrating: prefixlb sim $* --router-profile $told --calibrate --policies e2"
    $P sim -q --json "$out/calibration-$name-calibrated.json" "$@" --router-profile "$told" --calibrate --policies e2
  } > "$out/calibration-$name.txt"
}

# A mixed cluster told one GPU for all: 2 × H100 and 2 × A100 (Llama-3.1-8B).
MIXED=(--replicas 4 --replica-profiles 'llama3.1-8b-h100*2,llama3.1-8b-a100*2')
want mixed-toolbench && case_ mixed-toolbench llama3.1-8b-h100 --workload toolbench --zipf 1.1 --requests 6000 --rate 90 "${MIXED[@]}"
want mixed-shared-prefix && case_ mixed-shared-prefix llama3.1-8b-h100 --workload shared-prefix --requests 1500 --rate 4 "${MIXED[@]}"

# Every built-in GPU profile, its cluster told a profile twice too fast.
for spec in "mistral-7b-a6000 30 1" "llama3-70b-h100x2 30 -" "qwen3-32b-h100x2 60 4" "llama3.1-8b-h100 60 4" "llama3.1-8b-a100 30 2"; do
  read -r prof tbrate sprate <<<"$spec"
  want "fast-$prof-toolbench" && case_ "fast-$prof-toolbench" "$prof:time_scale=0.5" \
    --workload toolbench --zipf 1.1 --requests 4000 --rate "$tbrate" --replicas 4 --profile "$prof"
  # llama3-70b-h100x2 holds 15,200 KV tokens a replica: shared-prefix's
  # 7,200-token prompts with 1,000 output tokens do not run on it.
  [ "$sprate" = - ] && continue
  want "fast-$prof-shared-prefix" && case_ "fast-$prof-shared-prefix" "$prof:time_scale=0.5" \
    --workload shared-prefix --requests 1200 --rate "$sprate" --replicas 4 --profile "$prof"
done
echo done >&2
