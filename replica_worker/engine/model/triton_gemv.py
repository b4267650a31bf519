"""A Triton matmul for few rows: y = x @ W^T (+ bias) with x [M <= 16, K], the shape
of every projection in a decode step of a small batch.

Why: at batch 1 on the H200 (benchmarks/results/gpu/engine_h200_async_hf.json, the
batch-1 profile) cuBLAS's kernels read the two large projections' weights at about
4.0 TB/s but the two smaller ones' at about 3.1, and two projections a layer end with a
split-K reduce kernel: 64 extra launches a step. Here one program owns BLOCK_N whole output
features and runs the full K, so there is no split and no second kernel; the rows of x
are padded to 16 inside the program (tl.dot's smallest tile), which costs nothing on a
matmul bound by reading W. tl.dot also lets Triton pipeline W's loads (num_stages).

Used for CUDA bf16/fp16 projections of at most QUADRIGA_SMALL_M_GEMV_ROWS rows
(16 by default, at most 16; 0 turns it off; parallel.small_m_linear: every
projection and the lm_head); imported only then, so CPU runs never import triton
for it. On by default since two H100 runs of benchmarks/gpu/bench_decode_kernels.py
(it beats cuBLAS on every 8B decode shape there); not yet measured on the H200. The
block sizes come from the same benchmark (CONFIGS). Accumulates in fp32, as cuBLAS
does, in another order: outputs agree to about one bf16 rounding step.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # not installed (CPU-only installs, CI)
    triton = None
    tl = None

ROWS_PADDED = 16   # tl.dot's smallest tile side
# Under TRITON_INTERPRET=1 (the CPU tests) the tiles are cast to fp32 before tl.dot;
# on a GPU the bf16/fp16 tiles go to the tensor cores as they are.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, y_stride,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        nmask = n < N
        mmask = m < M
        w_rows = w_ptr + n.to(tl.int64)[:, None] * K
        x_cols = x_ptr + m.to(tl.int64)[None, :] * x_stride
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_cols + k[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
            if UPCAST:   # the interpreter's dot reads bf16 as raw integers
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, x, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m.to(tl.int64)[None, :] * y_stride + n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=nmask[:, None] & mmask[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) by output features; the first row whose
# bound is at least N applies. The fastest of bench_decode_kernels.py's candidates on
# one H100 for the Llama-3.1-8B shapes (benchmarks/results/gpu/decode_kernels_h100.json):
# o_proj and down_proj (4096 features) at (32, 256), q|k|v (6144), gate|up (28672)
# and the vocabulary (128256) at (64, 128) or within 1% of their best.
CONFIGS = (
    (4096, (32, 256, 4, 4)),
    (1 << 62, (64, 128, 4, 4)),
)


def config_for(n: int) -> tuple[int, int, int, int]:
    return next(cfg for bound, cfg in CONFIGS if n <= bound)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K), weight [N, K] contiguous -> [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    if m > ROWS_PADDED:
        raise ValueError(f"{m} rows: this kernel takes at most {ROWS_PADDED}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.is_contiguous() and weight.shape[1] == k
    block_n, block_k, warps, stages = config or config_for(n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, ROWS=ROWS_PADDED, HAS_BIAS=bias is not None,
        UPCAST=_INTERPRETED and x.dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )
    return y
