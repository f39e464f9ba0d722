#!/usr/bin/env bash
# Measures what a newcomer waits for (issue 32): the time to the demo's
# first table and the test command's time, cold (empty module and build
# caches, in temporary directories: the user's own caches are not touched)
# and warm (the same caches again), and the cold `go build ./cmd/prefixlb`
# with the module cache filled. Prints one line per figure, with the
# machine's cores and load average at the start.
#
#   scripts/measure-times.sh            # build and demo (about 10 min on 2 cores)
#   scripts/measure-times.sh --tests    # also the test command, cold and warm (much longer)
set -euo pipefail
cd "$(dirname "$0")/.."
tests=false
[ "${1:-}" = "--tests" ] && tests=true

tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
export GOMODCACHE=$tmp/mod GOCACHE=$tmp/build GOFLAGS="${GOFLAGS:-} -buildvcs=false"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(go version)"

# secs CMD...: runs CMD, prints its wall time in seconds.
secs() { local s=$SECONDS; "$@" >/dev/null 2>&1; echo $((SECONDS - s)); }

# The demo prints its table when its runs end, and exits: its first table
# is its whole run.
first_table() { secs go run ./cmd/prefixlb demo; }

echo "demo to its first table, cold (module download included): $(first_table) s"
echo "demo to its first table, warm: $(first_table) s"
rm -rf "$GOCACHE"
echo "go build ./cmd/prefixlb, module cache filled, build cache empty: $(secs go build -o "$tmp/prefixlb" ./cmd/prefixlb) s"
echo "go build ./cmd/prefixlb, warm: $(secs go build -o "$tmp/prefixlb" ./cmd/prefixlb) s"
if $tests; then
  rm -rf "$GOCACHE"
  echo "go run ./cmd/testreport -- -race ./..., build cache empty: $(secs go run ./cmd/testreport -- -race ./...) s"
  echo "go run ./cmd/testreport -- -race ./..., warm: $(secs go run ./cmd/testreport -- -race ./...) s"
fi
