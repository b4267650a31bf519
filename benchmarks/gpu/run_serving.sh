#!/usr/bin/env bash
# On the H200 (or another card: the JSON is named after it): the CUDA-only engine tests, then served against offline in one run
# (benchmarks/gpu/bench_serving.py). Usage (device tool, carrying .carry from
# prepare-carry.sh, with SmolLM2's tokenizer files copied into .carry/smollm2-tokenizer):
#   bash benchmarks/gpu/run_serving.sh .carry $OUT
set -uo pipefail
carry=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
source benchmarks/gpu/device-env.sh "$carry"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o -m1 'H[0-9]00' | tr 'H' 'h'); card=${card:-gpu}
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_flashinfer_cuda.py \
      tests/engine/test_runner_cuda.py tests/engine/test_sampler_cuda.py tests/engine/test_async_scheduling_cuda.py 2>&1 | tee "$out/cuda_tests.log" | tail -8
fi
python3 benchmarks/gpu/bench_serving.py --out "$out/serving_$card.json" --tokenizer "$carry/smollm2-tokenizer" \
    --log-dir "$out/serving-logs" ${SERVING_ARGS:-}
