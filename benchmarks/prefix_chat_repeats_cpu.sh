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
PY=${PY:-.venv/bin/python}
OUT=${OUT:?give OUT}
RUNS=${RUNS:-benchmarks/results/prefix_cpu/runs}
SEEDS=${SEEDS:-"1 2"}
REPEATS=${REPEATS:-3}
MODEL=${MODEL:-benchmarks/results/tmp/cpu-small}
[ -f "$MODEL/config.json" ] || "$PY" -m benchmarks model-dir "$MODEL" --shape cpu-small >/dev/null
mkdir -p "$OUT"
common=(--start-stack --replicas 2 --model "$MODEL" --replica-arg=--load-format --replica-arg=dummy
        --replica-arg=--max-num-seqs --replica-arg=8 --replica-arg=--chunk-size --replica-arg=256
        --output-dist fixed --tbt-slo 0.25 --ttft-p99-slo 2 --warmup 4 --hardware none --no-progress
        --out-dir benchmarks/results/tmp/prefix_cpu)
chat=(--replica-arg=--num-blocks --replica-arg=1536 --workload multi-turn --conversations 256 --turns 4
      --system-len 256 --prompt-dist uniform --prompt-min 64 --prompt-max 192 --output-len 32)
for seed in $SEEDS; do
  fifo=$("$PY" -c "import json; print(json.load(open('$RUNS/chat_cap_pull_fifo_cacheon_seed$seed.json'))['capacity_req_s'])")
  for r in $(seq "$REPEATS"); do
    flock /tmp/quadriga-bench.lock "$PY" -m benchmarks compare "${common[@]}" "${chat[@]}" \
      --policies pull pull_fifo cache_aware --capacity "$fifo" --loads 0.7 --seed "$seed" \
      --name "chat_70pct_seed${seed}_r$r" --summary-dir "$OUT"
  done
done
rm -f "$OUT"/*.png
