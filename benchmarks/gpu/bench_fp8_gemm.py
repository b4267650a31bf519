"""Which fp8 matmul to use at which batch: the decoder projections of a
Llama-3.1-8B-shaped model (q|k|v, o, gate|up, down), 8 layers' worth of distinct
weights so nothing stays in L2, timed as one pass at several token counts:

  bf16          F.linear on bf16 weights (the anchor)
  rowwise       torch._scaled_mm with per-token and per-channel scales (fp8.py's path),
                the input's quantization kernel included
  rowwise_mm    the same matmul alone
  tensorwise    _scaled_mm with unit scalar scales (cuBLASLt), then the two scale
                vectors applied in one elementwise pass, quantization included
  gemv_triton   a Triton kernel reading e4m3 weights and bf16 inputs (weight-only fp8)

Prints each variant's time per pass and the weight bandwidth it reaches.
    python3 benchmarks/gpu/bench_fp8_gemm.py --out $OUT/fp8_gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replica_worker.engine.model import triton_ops  # noqa: E402
from replica_worker.engine.model.fp8 import FP8_MAX, Fp8Weight  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]   # (out, in)
LAYERS = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w.to(tl.bfloat16)))
    acc = acc * tl.load(s_ptr + rn)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


def gemv(x, w, s, block_n, block_k):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    _gemv_kernel[(n // block_n,)](x, w, s, out, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                  num_warps=4, num_stages=4)
    return out


def tensorwise(x, w_t, sw, one):
    """The engine's small-step path (fp8.Fp8Weight.linear), spelled out: quantize,
    a unit-scale matmul, then triton_ops' scale pass."""
    q, sx = triton_ops.quantize_rows_fp8(x, FP8_MAX, 1e-12)
    y = torch._scaled_mm(q, w_t, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return triton_ops.scale_rows_and_cols_(y, sx, sw)


def time_pass(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,8,16,32,64,128,256,2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        row = []
        for n, k in SHAPES:
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            f = Fp8Weight(w)
            row.append((w, f))
        layers.append(row)
    one = torch.ones((), device="cuda")
    bf16_bytes = sum(w.numel() * 2 for row in layers for w, _ in row)
    fp8_bytes = bf16_bytes // 2
    from benchmarks.common import tree_commit

    results = {"command": " ".join(["python3"] + sys.argv), "commit": tree_commit(),
               "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "layers": LAYERS, "shapes_out_in": SHAPES, "rows": []}
    for m in [int(t) for t in args.tokens.split(",")]:
        xs = {k: torch.randn(m, k, device="cuda").to(torch.bfloat16) for _, k in SHAPES}
        qx = {k: triton_ops.quantize_rows_fp8(x, FP8_MAX, 1e-12) for k, x in xs.items()}
        variants = {
            "bf16": (lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for row in layers for w, _ in row],
                     bf16_bytes),
            "rowwise": (lambda: [f.linear(xs[w.shape[1]], None, torch.bfloat16) for row in layers for w, f in row],
                        fp8_bytes),
            "rowwise_mm": (lambda: [torch._scaled_mm(qx[w.shape[1]][0], f.weight.t(), scale_a=qx[w.shape[1]][1],
                                                     scale_b=f.scale, out_dtype=torch.bfloat16)
                                    for row in layers for w, f in row], fp8_bytes),
            "tensorwise": (lambda: [tensorwise(xs[w.shape[1]], f.weight.t(), f.scale, one)
                                    for row in layers for w, f in row], fp8_bytes),
        }
        if m <= 16:
            for bn, bk in ((16, 256), (32, 256), (16, 512), (64, 128)):
                variants[f"gemv_triton_n{bn}_k{bk}"] = (
                    lambda bn=bn, bk=bk: [gemv(xs[w.shape[1]], f.weight, f.scale, bn, bk)
                                          for row in layers for w, f in row], fp8_bytes)
        row = {"tokens": m}
        for name, (fn, nbytes) in variants.items():
            try:
                t = time_pass(fn)
                row[name] = {"ms": t * 1e3, "weight_TBps": nbytes / t / 1e12}
            except Exception as exc:   # one variant failing leaves the others
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if os.environ.get("CHECK_GEMV", "1") == "1":   # the Triton kernel computes the same product
        w, f = layers[0][0]
        x = torch.randn(3, w.shape[1], device="cuda").to(torch.bfloat16)
        ref = x.float() @ (f.weight.float() * f.scale.t()).t()
        got = gemv(x, f.weight, f.scale, 16, 256).float()
        results["gemv_max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
        Path(args.out).write_text(json.dumps(results, indent=1))
        print("gemv max rel err", results["gemv_max_rel_err"])


if __name__ == "__main__":
    main()
