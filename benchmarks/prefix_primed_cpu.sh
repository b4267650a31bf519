#!/usr/bin/env bash
# Capacity on a workload of prefix_affinity_cpu.sh (WORKLOAD=shared, the default, or
# chat; the same search: from 45 req/s or 9 conversations/s, growing 1.5x, 7 probes,
# brackets within 4%), with the caches primed
# before each search (the harness's --prime: each system prompt sent once), the
# policies alternating in one sitting, REPEATS times for each seed. Without priming a
# search's first probe alone meets cold caches, and which rate it lands on differs
# from search to search; primed, every probe meets them as warm as the last.
# JSONs (each with its command) go to $OUT; a summary per seed to
# $OUT/<workload>_summary_seedK.*
#
#   OUT=benchmarks/results/prefix_cpu/primed bash benchmarks/prefix_primed_cpu.sh
#   POLICIES="round_robin pull_fifo" REPEATS=1 OUT=... bash benchmarks/prefix_primed_cpu.sh
#   WORKLOAD=chat REPEATS=1 OUT=... bash benchmarks/prefix_primed_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT}
REPEATS=${REPEATS:-3}
SEEDS=${SEEDS:-"1 2"}
POLICIES=${POLICIES:-"pull cache_aware"}
source benchmarks/prefix_cpu_common.sh
mkdir -p "$OUT"
WORKLOAD=${WORKLOAD:-shared}
case $WORKLOAD in
  shared) shape=("${shared_workload[@]}"); from=45 ;;
  chat) shape=("${chat_workload[@]}"); from=9 ;;
  *) echo "WORKLOAD is shared or chat, not $WORKLOAD" >&2; exit 2 ;;
esac
search=(--initial-rate "$from" --growth 1.5 --max-probes 7 --rel-tol 0.04 --prime)
for seed in $SEEDS; do
  for r in $(seq "$REPEATS"); do
    for policy in $POLICIES; do
      name=${WORKLOAD}_${policy}_seed${seed}_r$r
      [ -f "$OUT/$name.json" ] && continue   # a re-run completes what is missing
      flock /tmp/quadriga-bench.lock "$PY" -m benchmarks capacity "${stack_args[@]}" "${shape[@]}" \
        "${search[@]}" --seed "$seed" --policy "$policy" --name "$name" --summary-dir "$OUT"
    done
  done
  inputs=()
  for f in "$OUT"/"${WORKLOAD}"_*_seed"${seed}"_r*.json; do inputs+=("primed=$f"); done
  "$PY" -m benchmarks repeats --out "$OUT/${WORKLOAD}_summary_seed$seed" "${inputs[@]}"
done
rm -f "$OUT"/*.png
