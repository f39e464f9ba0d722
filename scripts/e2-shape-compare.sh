#!/usr/bin/env bash
# Compares two prefixlb builds' e2 decisions on every built-in workload, at a
# moderate and an overloaded rate each (docs/performance.md, "Expired runs
# as one node"): the same `sim --json` run with each binary, then one table
# row per run with mean/p90/p99 TTFT and the hit ratio of each build, and
# whether the two JSON summaries are byte-identical. Each run stays well
# under a minute on a 2-core machine; the whole script takes a few minutes.
#
# Usage: scripts/e2-shape-compare.sh BASE_BINARY NEW_BINARY [OUTDIR]
#   go build -o /tmp/prefixlb-base ./cmd/prefixlb   # at the base commit
#   go build -o /tmp/prefixlb-new ./cmd/prefixlb    # at the change
#   scripts/e2-shape-compare.sh /tmp/prefixlb-base /tmp/prefixlb-new
# POLICY (default e2), REQUESTS (default 2000) and SEED (default 1) may be set;
# WORKLOADS (space-separated names, default all) keeps only those workloads.
set -euo pipefail
BASE=${1:?base binary}
NEW=${2:?new binary}
OUT=${3:-$(mktemp -d /tmp/e2-shape.XXXXXX)}
POLICY=${POLICY:-e2}
REQUESTS=${REQUESTS:-2000}
SEED=${SEED:-1}
WORKLOADS=${WORKLOADS:-}
mkdir -p "$OUT"

# workload and its two rates (req/s): one a 4-replica mistral-7b-a6000
# cluster serves, one past what it serves (requests wait longer than the
# 2 s speculative TTL, so marks expire).
CASES=(
	"agent 16 40"
	"coding-agent 0.5 2"
	"loogle 0.5 2"
	"lora 4 16"
	"programming 4 16"
	"rag 4 16"
	"shared-prefix 0.5 2"
	"toolbench 4 24"
	"videoqa 2 8"
)

printf '| workload | rate | TTFT mean ms (base → new) | p90 | p99 | hit ratio | JSON |\n'
printf '|---|---:|---|---|---|---|---|\n'
for c in "${CASES[@]}"; do
	read -r w r1 r2 <<<"$c"
	if [ -n "$WORKLOADS" ] && [[ " $WORKLOADS " != *" $w "* ]]; then
		continue
	fi
	for r in $r1 $r2; do
		for v in base new; do
			bin=$BASE
			[ $v = new ] && bin=$NEW
			"$bin" sim --workload "$w" --requests "$REQUESTS" --replicas 4 --profile mistral-7b-a6000 \
				--policies "$POLICY" --rate "$r" --seed "$SEED" -q --json "$OUT/$w-$r-$v.json" >/dev/null
		done
		same=differs
		cmp -s "$OUT/$w-$r-base.json" "$OUT/$w-$r-new.json" && same=identical
		jq -r -n --arg w "$w" --arg r "$r" --arg same "$same" \
			--slurpfile b "$OUT/$w-$r-base.json" --slurpfile n "$OUT/$w-$r-new.json" '
			def f: if . >= 100 then (. | round | tostring) else ((. * 10 | round) / 10 | tostring) end;
			def pair(p): "\($b[0].results[0] | p | f) → \($n[0].results[0] | p | f)";
			def pct(p): ((($n[0].results[0] | p) - ($b[0].results[0] | p)) / ($b[0].results[0] | p) * 100 * 10 | round) / 10;
			def cell(p): if $same == "identical" then pair(p) else "\(pair(p)) (\(pct(p))%)" end;
			"| \($w) | \($r) | \(cell(.ttft_ms.mean)) | \(cell(.ttft_ms.p90)) | \(cell(.ttft_ms.p99)) | \(($b[0].results[0].prefix_hit_ratio * 1000 | round) / 1000) → \(($n[0].results[0].prefix_hit_ratio * 1000 | round) / 1000) | \($same) |"'
	done
done
echo "# JSON in $OUT" >&2
