#!/usr/bin/env bash
# Issue 18's speed target, "e2 within 1.5x the CPU time of the cheapest
# cache-aware policy" (docs/performance.md, "E2 on full caches"): user CPU
# seconds of the overloaded coding-agent run, e2 on each given build and
# llmd-precise, prefix and sglang on the last one, interleaved, ROUNDS rounds
# (default 5), with the load average at each round. Prints one line per run
# and the median per (build, policy).
# With ALL_BUILDS=1 the three baselines run on every build, and each round
# prints each build's e2 over its cheapest baseline of that round.
# Usage: scripts/e2-cpu-time.sh BINARY... (e.g. a base build, then the change)
set -euo pipefail
ROUNDS=${ROUNDS:-5}
REQUESTS=${REQUESTS:-2000}
ALL_BUILDS=${ALL_BUILDS:-0}
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
last=${!#}
out=$(mktemp)
run() { # label binary policy
	local u
	u=$( { /usr/bin/time -f %U "$2" sim --workload coding-agent --requests "$REQUESTS" --replicas 4 \
		--profile mistral-7b-a6000 --policies "$3" --rate 2 -q >/dev/null; } 2>&1 | tail -1)
	echo "$1 $3 $u" | tee -a "$out"
}
for i in $(seq "$ROUNDS"); do
	echo "# round $i, load average $(cut -d' ' -f1-3 /proc/loadavg)"
	for b in "$@"; do run "$(basename "$b")" "$b" e2; done
	if [ "$ALL_BUILDS" = 1 ]; then
		for p in llmd-precise prefix sglang; do
			for b in "$@"; do run "$(basename "$b")" "$b" "$p"; done
		done
		tail -n $((4 * $#)) "$out" | awk '$2 == "e2" {e[$1] = $3; next}
			!($1 in c) || $3 < c[$1] {c[$1] = $3}
			END {for (b in e) printf "# round ratio %s e2/cheapest %.2f\n", b, e[b] / c[b]}' | sort
	else
		for p in llmd-precise prefix sglang; do run "$(basename "$last")" "$last" "$p"; done
	fi
done
echo "# median user s over $ROUNDS rounds"
sort -k1,1 -k2,2 -k3,3n "$out" | awk '{k=$1" "$2; n[k]++; v[k, n[k]]=$3} END {for (k in n) print k, v[k, int((n[k]+1)/2)]}' | sort
rm -f "$out"
