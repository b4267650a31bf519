#!/usr/bin/env bash
# CPU figures of cache-affine scheduling (docs/benchmarks.md, "CPU figures:
# cache-affine scheduling"). Two replicas of the cpu-small shape (dummy weights; its
# prefill weighs against a decode step as a served model's does), 8 seats each and a
# KV cache sized so one replica cannot hold what the workload keeps reusing and two
# can (shared: 256 blocks, 4096 tokens; chat: 1536 blocks, 24,576 tokens), sarathi
# with 256-token chunks. Per workload and seed:
#   capacity of pull, pull_fifo, cache_aware, round_robin (engine cache on) and of pull
#   with the engine cache off: the highest Poisson rate with p99 TTFT <= 2 s and p99 TBT
#   <= 250 ms (and p50 scheduling delay <= 2 s, keeping up); then, at 70% of pull_fifo's
#   capacity, every policy (least_outstanding too), and pull with the engine cache off.
#
#   benchmarks/prefix_affinity_cpu.sh                 # the committed figures
#   SEEDS="1" WORKLOADS=shared benchmarks/prefix_affinity_cpu.sh
#
# Every harness call holds /tmp/quadriga-bench.lock, so it never overlaps another
# benchmark. Each run's JSON (with its exact command) goes to $OUT/runs/;
# `benchmarks repeats` gathers them into $OUT/<workload>.{json,csv} and PNGs (median
# and range over the seeds); `benchmarks prefix-report` checks the targets per seed
# into $OUT/targets.json. Per-request CSVs and plots go to benchmarks/results/tmp/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/prefix_cpu}
SEEDS=${SEEDS:-"1 2 3"}
WORKLOADS=${WORKLOADS:-"shared chat"}
CAPACITY_POLICIES=${CAPACITY_POLICIES:-"pull pull_fifo cache_aware round_robin"}
POLICIES=${POLICIES:-"pull pull_fifo cache_aware least_outstanding round_robin"}
source benchmarks/prefix_cpu_common.sh   # PY, MODEL, stack_args, shared_workload, chat_workload
common=("${stack_args[@]}")
# Seven probes: the bracket then closes to 2-6% (with 5, pull and cache_aware
# both passed 27 and failed 40.5 req/s, too coarse to tell a 1.1x apart).
search=(--growth 1.5 --max-probes 7 --rel-tol 0.04)
shared=("${shared_workload[@]}" --initial-rate 45)
chat=("${chat_workload[@]}" --initial-rate 9)
bench() { flock /tmp/quadriga-bench.lock "$PY" -m benchmarks "$@"; }
# A run whose JSON is there and complete is not run again: the script can be resumed.
done_already() {
  [ -f "$OUT/runs/$1.json" ] && "$PY" -c "import json, sys; sys.exit(json.load(open('$OUT/runs/$1.json')).get('complete') is False)"
}
mkdir -p "$OUT/runs"
for seed in $SEEDS; do
  for wl in $WORKLOADS; do
    declare -n shape=$wl
    for policy in $CAPACITY_POLICIES; do
      name=${wl}_cap_${policy}_cacheon_seed${seed}
      done_already "$name" || bench capacity "${common[@]}" "${shape[@]}" "${search[@]}" --policy "$policy" \
        --seed "$seed" --name "$name" --summary-dir "$OUT/runs"
    done
    name=${wl}_cap_pull_cacheoff_seed${seed}
    done_already "$name" || bench capacity "${common[@]}" "${shape[@]}" "${search[@]}" --policy pull \
      --seed "$seed" --replica-arg=--no-prefix-caching --name "$name" --summary-dir "$OUT/runs"
    fifo=$("$PY" -c "import json; print(json.load(open('$OUT/runs/${wl}_cap_pull_fifo_cacheon_seed${seed}.json'))['capacity_req_s'] or '')")
    if [ -n "$fifo" ]; then
      name=${wl}_70pct_seed${seed}
      done_already "$name" || bench compare "${common[@]}" "${shape[@]}" --policies $POLICIES --capacity "$fifo" \
        --loads 0.7 --seed "$seed" --name "$name" --summary-dir "$OUT/runs"
      name=${wl}_70pct_cacheoff_seed${seed}
      done_already "$name" || bench compare "${common[@]}" "${shape[@]}" --policies pull --capacity "$fifo" \
        --loads 0.7 --replica-arg=--no-prefix-caching --seed "$seed" --name "$name" --summary-dir "$OUT/runs"
    fi
    rm -f "$OUT"/runs/*.png
    unset -n shape
  done
done
for wl in $WORKLOADS; do
  inputs=()
  for f in "$OUT"/runs/"${wl}"_cap_*_seed*.json; do
    inputs+=("cache_$(basename "$f" | sed -E 's/.*_cache(on|off)_.*/\1/')=$f")
  done
  for f in "$OUT"/runs/"${wl}"_70pct_seed*.json; do inputs+=("70pct=$f"); done
  for f in "$OUT"/runs/"${wl}"_70pct_cacheoff_seed*.json; do inputs+=("70pct_cache_off=$f"); done
  "$PY" -m benchmarks repeats --out "$OUT/$wl" --title "$wl (cpu-small, 2 replicas)" "${inputs[@]}"
done
"$PY" -m benchmarks prefix-report "$OUT/runs" --out "$OUT/targets.json"
