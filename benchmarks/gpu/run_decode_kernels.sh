#!/usr/bin/env bash
# On the H200 (or an H100): the decode kernels (the rotary kernel that also stores k
# and v, QUADRIGA_FUSED_KV_STORE; the few-row matmul, QUADRIGA_SMALL_M_GEMV_ROWS; both
# on by default): their CUDA tests, then bench_decode_kernels.py (every decode matmul
# against cuBLAS; decode steps of the engine with each variant on and off).
# Usage (device tool, carrying .carry from prepare-carry.sh):
#   bash benchmarks/gpu/run_decode_kernels.sh .carry $OUT
set -uo pipefail
carry=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
source benchmarks/gpu/device-env.sh "$carry"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider tests/engine/test_fused_ops.py tests/engine/test_small_m_gemv.py \
    tests/engine/test_decode_kernels_cuda.py 2>&1 | tee "$out/decode_kernels_tests.log" | tail -15
timeout 480 python3 benchmarks/gpu/bench_decode_kernels.py --out "$out/decode_kernels_h200.json" 2>&1 | tail -40
