#!/usr/bin/env bash
# On the H200: the CUDA-only tests (flashinfer with prefix caching, CUDA graphs,
# the device sampler, async scheduling), the first prefill of a process against
# its later ones, the sampler's host and device time per call, and the engine's
# smoke figures. Usage (device tool, carrying .carry from prepare-carry.sh):
#   bash benchmarks/gpu/run_checks.sh .carry $OUT
set -uo pipefail
carry=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
source benchmarks/gpu/device-env.sh "$carry"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider tests/engine/test_flashinfer_cuda.py tests/engine/test_runner_cuda.py \
    tests/engine/test_sampler_cuda.py tests/engine/test_fused_ops.py tests/engine/test_fp8_cuda.py \
    tests/engine/test_async_scheduling_cuda.py tests/engine/test_small_m_gemv.py \
    tests/engine/test_decode_kernels_cuda.py 2>&1 | tee "$out/cuda_tests.log" | tail -25
timeout 120 python3 benchmarks/gpu/bench_first_prefill.py --out "$out/first_prefill_h200.json" 2>&1 | tail -4
python3 -m benchmarks.engine.sampler_bench --device cuda --vocab 128256 2>&1 | tail -12
cp benchmarks/results/sampler_cuda.json "$out/" 2>/dev/null
timeout 300 python3 benchmarks/gpu/bench_engine.py --smoke --out "$out/smoke_h200.json" 2>&1 | tail -15
