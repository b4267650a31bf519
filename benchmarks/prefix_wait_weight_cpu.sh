#!/usr/bin/env bash
# Pull affinity's wait weight beside cache_aware, on the workloads of
# prefix_affinity_cpu.sh (shared seed 2, chat seed 1), in one sitting, the sides
# alternating, REPEATS times for shared. Narrow searches: from 101.25 req/s (20.25
# conversations/s) growing 1.125x, 5 probes. The first probe of each search meets
# cold caches, so these capacities sit below the full searches' and compare only
# among themselves. JSONs (each with its command) go to $OUT.
#
#   OUT=benchmarks/results/prefix_cpu/wait_weight bash benchmarks/prefix_wait_weight_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT}
REPEATS=${REPEATS:-3}
WEIGHTS=${WEIGHTS:-"1 0.25 0.1"}
source benchmarks/prefix_cpu_common.sh
mkdir -p "$OUT"
common=("${stack_args[@]}" --growth 1.125 --max-probes 5 --rel-tol 0.04)
shared=("${shared_workload[@]}" --initial-rate 101.25 --seed 2)
chat=("${chat_workload[@]}" --initial-rate 20.25 --seed 1)
run() { name=$1; shift; flock /tmp/quadriga-bench.lock "$PY" -m benchmarks capacity "${common[@]}" "$@" \
          --name "$name" --summary-dir "$OUT"; }
weight() { echo --router-arg=--pull-affinity-wait-weight --router-arg="$1"; }
for r in $(seq "$REPEATS"); do
  for w in $WEIGHTS; do run "shared_pull_w${w}_r$r" "${shared[@]}" --policy pull $(weight "$w"); done
  run "shared_cache_aware_r$r" "${shared[@]}" --policy cache_aware
done
for w in $WEIGHTS; do run "chat_pull_w${w}_r1" "${chat[@]}" --policy pull $(weight "$w"); done
run chat_cache_aware_r1 "${chat[@]}" --policy cache_aware
rm -f "$OUT"/*.png
