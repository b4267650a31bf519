#!/usr/bin/env bash
# Chat at 70% of pull FIFO's capacity, repeated: pull with affinity, pull FIFO and
# cache_aware, REPEATS times per seed, with the workload and stack of
# prefix_affinity_cpu.sh. One run at this load swings TTFT p50 several-fold, so #14's
# TTFT target is judged on the spread. FIFO's capacity per seed comes from
# RUNS (the runs folder of prefix_affinity_cpu.sh). JSONs (each with its command) in $OUT.
#
#   OUT=benchmarks/results/prefix_cpu/chat_repeats bash benchmarks/prefix_chat_repeats_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT}
RUNS=${RUNS:-benchmarks/results/prefix_cpu/runs}
SEEDS=${SEEDS:-"1 2"}
REPEATS=${REPEATS:-3}
source benchmarks/prefix_cpu_common.sh
mkdir -p "$OUT"
for seed in $SEEDS; do
  fifo=$("$PY" -c "import json; print(json.load(open('$RUNS/chat_cap_pull_fifo_cacheon_seed$seed.json'))['capacity_req_s'])")
  for r in $(seq "$REPEATS"); do
    flock /tmp/quadriga-bench.lock "$PY" -m benchmarks compare "${stack_args[@]}" "${chat_workload[@]}" \
      --policies pull pull_fifo cache_aware --capacity "$fifo" --loads 0.7 --seed "$seed" \
      --name "chat_70pct_seed${seed}_r$r" --summary-dir "$OUT"
  done
done
rm -f "$OUT"/*.png
