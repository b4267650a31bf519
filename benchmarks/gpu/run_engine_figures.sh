#!/usr/bin/env bash
# #15's engine figures in ONE device call, for a card whose figures are missing (the
# H200): the first start paid in run_warm.sh's warm-up (kernel caches carried: about
# 30 s), the decode step through the engine's step loop against its bandwidth limit
# (bench_async.py), then bench_engine.py: decode, prefill of 2048 against the matmul
# rate measured in the run, offline 1000 x (1024, 256) greedy and seeded, and
# transformers' generate timed whole beside it (batch 384, its best on the H200).
# Each step gets what is left of CALL_S (default 580) at most. Usage on the device:
#   bash benchmarks/gpu/run_engine_figures.sh .carry $OUT
set -uo pipefail
carry=${1:-.carry}; out=${2:?give OUT}; mkdir -p "$out"
call_s=${CALL_S:-580}; start=$(date +%s)
# transformers' largest batch that fits: 384 on the H200; on an 80 GB card 192 (256's prefill ran out of memory)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) hf_batches=${HF_BATCHES:-384} ;; *) hf_batches=${HF_BATCHES:-192} ;; esac
left() { echo $(( call_s - ($(date +%s) - start) )); }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | tr -cd '[:alnum:]' | tr 'A-Z' 'a-z' | sed 's/nvidia//')
WARM_TIMEOUT_S=${WARM_TIMEOUT_S:-150} bash benchmarks/gpu/run_warm.sh "$carry" "$out" true 2>&1 | tail -n 6
source benchmarks/gpu/device-env.sh "$carry" >/dev/null 2>&1 && export CARRY_SOURCED=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
echo "after the warm-up: $(left) s left"
timeout "$(( $(left) < 120 ? $(left) : 120 ))" python3 benchmarks/gpu/bench_async.py --sections decode \
    --modes async --out "$out/async_decode_$card.json" 2>&1 | grep -E "batch|rror" | tail -n 6
echo "after the decode: $(left) s left"
timeout "$(( $(left) - 5 ))" python3 benchmarks/gpu/bench_engine.py --out "$out/engine_${card}_hf.json" \
    --skip-unfused --offline-threads 1 --threads 1 --hf-batches "$hf_batches" 2>&1 \
    | grep -vE "^\s*$|it/s\]" | tail -n 30
echo "done: $(( $(date +%s) - start )) s"
