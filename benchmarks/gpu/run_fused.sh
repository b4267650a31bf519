#!/bin/bash
# One H200 run for the Triton fused kernels (norm+residual, SiLU*up, rotary), carrying .carry:
#   bash benchmarks/gpu/run_fused.sh        # OUT: where results go (the lease sets it)
# Order: the kernels' own test on the GPU, the engine figures without the offline job and the
# transformers baseline (decode 1..256 at context 1024, prefill 512/2048/8192, plus a batch
# 1/32 decode A/B with the kernels off), then the CUDA engine tests in the time that is left.
# Every step is time-boxed so the whole run ends within ~380 s.
set -u
source benchmarks/gpu/device-env.sh .carry
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH  # keep device-env's /tmp/site (flashinfer)
OUT=${OUT:-/tmp/quadriga-out}
mkdir -p "$OUT"
unset QUADRIGA_FUSED_OPS  # default: the Triton kernels
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
if [ "${SKIP_KERNEL_TESTS:-0}" != 1 ]; then
    echo "== fused kernel tests (GPU) t=${SECONDS}s"
    timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_fused_ops.py 2>&1 | tee "$OUT/test_fused.log" | tail -15
fi
echo "== bench t=${SECONDS}s"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/gpu/bench_engine.py --out "$OUT/engine_h200_fused.json" --skip-hf --skip-offline 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^{'name'" 
left=$((${DEADLINE:-375} - SECONDS))
echo "== CUDA engine tests t=${SECONDS}s, ${left}s left"
if [ "$left" -gt 20 ]; then
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/engine/test_flashinfer_cuda.py tests/engine/test_runner_cuda.py 2>&1 \
        | tee "$OUT/test_cuda.log" | tail -25
fi
echo "== done t=${SECONDS}s"
