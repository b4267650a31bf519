#!/usr/bin/env bash
# Sliding-window attention on flashinfer (window_left): the CUDA tests of a windowed model
# (against transformers and the torch backend's mask) and the flashinfer tests the change
# touches, then the decode step of Mistral 7B v0.1's shape (dummy bf16, its 4096-token window
# on) through flashinfer and CUDA graphs, beside the torch fallback that served windowed
# models before, in the same call. Packs the kernels it built (the windowed modules are
# their own) for the carry. Usage (device tool, carrying .carry and COMMIT):
#   bash benchmarks/gpu/run_sliding_window.sh .carry $OUT
set -uo pipefail
carry=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
source benchmarks/gpu/device-env.sh "$carry" && export CARRY_SOURCED=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/card.txt"
start=$(date +%s)
timeout "${TESTS_S:-300}" python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_sliding_window_cuda.py \
    tests/engine/test_flashinfer_cuda.py 2>&1 | tee "$out/cuda_tests_sliding_window.log" | grep -E "passed|failed|error|flashinfer" | tail -25
echo "tests: $(( $(date +%s) - start )) s"
timeout "${BENCH_S:-150}" python3 benchmarks/gpu/bench_async.py --shape mistral-7b --sections decode --modes async \
    --out "$out/window_decode_flashinfer.json" 2>&1 | grep -E "batch|Error|error" | tail -8
QUADRIGA_ATTENTION_BACKEND=torch timeout "${FALLBACK_S:-100}" python3 benchmarks/gpu/bench_async.py --shape mistral-7b \
    --sections decode --modes async --batches 1,32 --steps 16 --out "$out/window_decode_torch.json" 2>&1 \
    | grep -E "batch|Error|error" | tail -4
echo "all: $(( $(date +%s) - start )) s"
bash benchmarks/gpu/pack-caches.sh "$out" >/dev/null 2>&1; ls "$out"
