#!/usr/bin/env bash
# Decode and prefill at torch's default threads and at one thread, two processes
# one after the other on one loan (no offline job, no transformers, no unfused
# A/B): does the host work outside the graphs depend on torch's intra-op threads?
#   bash benchmarks/gpu/run_threads_ab.sh .carry $OUT      # about 3 minutes
set -uo pipefail
carry=${1:-.carry}; out=$(mkdir -p "${2:-/tmp/out}" && cd "${2:-/tmp/out}" && pwd)
source benchmarks/gpu/device-env.sh "$carry" >/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
for threads in ${THREADS:-0 1}; do
  echo "== torch threads $threads (0: default) t=${SECONDS}s"
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/gpu/bench_engine.py --skip-offline --skip-hf --skip-unfused \
      --threads "$threads" --out "$out/engine_h200_threads_$threads.json" 2>&1 \
    | grep -E "^(fused|torch|=== )|'step_ms'|'time_ms'" | cut -c1-220
done
echo "== done t=${SECONDS}s"
