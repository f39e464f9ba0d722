#!/usr/bin/env bash
# Checks that a change to the simulator's engine model is result-identical
# (docs/performance.md, "Fourth round"): each case below, 1000 requests on 4
# replicas, is run with both builds with --out, and their results.json and
# requests.csv (every request's replica, TTFT, latency and cached tokens) are
# compared byte for byte. The cases cover every local scheduler, LoRA slots,
# the CPU offload tier (with loads), prefill/decode disaggregation (remote
# KV), the llama.cpp slot cache and a small KV cache. Prints one line per
# case with each build's user CPU seconds; exits 1 if any case differs. A few
# minutes on a 2-core machine.
#
# Usage: scripts/sim-identity.sh BASE_BINARY NEW_BINARY [OUTDIR]
# ONLY (space-separated case names) keeps only those cases.
set -uo pipefail
BASE=${1:?base binary}
NEW=${2:?new binary}
OUT=${3:-$(mktemp -d /tmp/sim-identity.XXXXXX)}
mkdir -p "$OUT"
ONLY=${ONLY:-}
status=0
CASES=(
	"ca-e2|--workload coding-agent --rate 2 --policies e2"
	"ca-llmd|--workload coding-agent --rate 2 --policies llmd-precise"
	"ca-lpm|--workload coding-agent --rate 2 --policies e2@lpm,round-robin@lpm"
	"ca-prio|--workload coding-agent --rate 2 --policies e2@priority,llmd-precise@priority"
	"loogle-lpm|--workload loogle --rate 2 --policies sglang@lpm,e2-preble@priority"
	"lora-maxl|--workload lora --rate 16 --policies e2,round-robin --max-loras 2"
	"ca-offload|--workload coding-agent --rate 2 --policies e2,llmd-precise --cpu-offload-tokens 2000000 --profile llama3.1-8b-a100 --kv-capacity 80000"
	"sp-pd|--workload shared-prefix --rate 4 --policies e2-pd,llmd-pd --prefill-replicas 2 --profile llama3.1-8b-a100"
	"ca-llamacpp|--workload coding-agent --rate 0.5 --policies e2,round-robin --engine llamacpp --profile mistral-7b-a6000"
	"rag-small|--workload rag --rate 16 --policies e2,round-robin --kv-capacity 200000"
)
for c in "${CASES[@]}"; do
	name=${c%%|*}; args=${c#*|}
	[ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && continue
	[[ "$args" == *--profile* ]] || args="$args --profile mistral-7b-a6000"
	for v in base new; do
		bin=$BASE; [ $v = new ] && bin=$NEW
		rm -rf "$OUT/$name-$v"
		/usr/bin/time -f %U -o "$OUT/$name-$v.time" "$bin" sim $args --requests 1000 --replicas 4 --seed 1 -q --out "$OUT/$name-$v" >/dev/null 2>"$OUT/$name-$v.err" || echo "$name $v failed: $(tail -2 $OUT/$name-$v.err)"
	done
	r=identical
	for f in results.json requests.csv; do cmp -s "$OUT/$name-base/$f" "$OUT/$name-new/$f" || r="DIFFERS ($f)"; done
	[ "$r" = identical ] || status=1
	echo "$name: $r; requests.csv lines $(wc -l < "$OUT/$name-new/requests.csv" 2>/dev/null); user s base $(tail -1 $OUT/$name-base.time) new $(tail -1 $OUT/$name-new.time) :: $args"
done
echo "# output in $OUT" >&2
exit $status
