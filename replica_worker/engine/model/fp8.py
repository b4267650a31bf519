"""fp8 weights for the decode-bound case (`quantization="fp8"`): a step at small
batch reads every weight once, so halving the weight bytes halves its floor.

The scheme (W8A8, scales computed by the engine, none read from the checkpoint):
- Each projection of a decoder layer (q|k|v, o, gate|up, down) is stored as
  float8 e4m3 with one float32 scale per output channel: scale = max |row| / 448,
  so a row's largest weight maps to e4m3's largest finite value. The checkpoint
  stays bf16 (or whatever it is); quantization happens once, after loading.
- Each matmul's input is quantized per token, each step: scale = max |x_row| / 448.
- The product is dequantized by both scales: y = (x_q * s_x) @ (w_q * s_w)^T.
- The embedding, the norms and the output head stay in the model's dtype.

On CUDA (compute capability 8.9 and up, bfloat16 models) the product is one
`torch._scaled_mm`: with row-wise scales for large steps, and for small ones
(decode) with unit scales followed by one Triton pass that applies both scale
vectors, which cuBLASLt's kernels make faster there. The input's quantization is
one Triton kernel where triton imports. Elsewhere (the CPU) the same arithmetic
is emulated in float32, which is what tests check the engine against
(`quantize_rows` is the definition); it is for correctness, not speed. Under
tensor parallelism a row-parallel projection's scales cover the rank's input
slice only, so sizes 1 and 2 round slightly differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale, not a division by zero

# Up to this many tokens a step's fp8 matmul runs with unit scalar scales and the
# scales applied after: on the H200 that read the weights at 2.2-2.7 TB/s against
# 1.7-2.2 with row-wise scales in `_scaled_mm` (benchmarks/gpu/bench_fp8_gemm.py,
# results/gpu/fp8_gemm_h200.json); from 256 tokens on, row-wise was faster.
TENSORWISE_MAX_TOKENS = 128


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as e4m3, float32 scales [rows, 1]) with x ~= q * scale row by row: the
    reference for both the weights and, per token, the activations."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def emulate_in_transformers(model: torch.nn.Module, weights: bool = True, inputs: bool = True) -> torch.nn.Module:
    """Makes a transformers Llama-family model compute what this scheme computes, in
    its own dtype: each decoder projection's weight replaced by its dequantized fp8
    value, and its input quantized and dequantized per token by a forward pre-hook.
    The reference the fp8 engine is tested and measured against. weights / inputs
    False leave that half out (to measure where the error comes from)."""

    def quantize_input(module, args):
        q, s = quantize_rows(args[0].reshape(-1, args[0].shape[-1]))
        return ((q.float() * s).to(args[0].dtype).reshape(args[0].shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            if weights:
                q, s = quantize_rows(module.weight)
                module.weight.copy_(q.float() * s)
            if inputs:
                module.register_forward_pre_hook(quantize_input)
    return model


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError where fp8 matmuls cannot run (the CPU emulates them, any dtype)."""
    if device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("quantization fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)")
    if dtype != torch.bfloat16:
        # Row-wise scaled matmuls write bf16 only, and the unit-scale path's unscaled
        # product (up to 448 * 448 * in_features) is past float16's range.
        raise ValueError(f"quantization fp8 on CUDA runs bfloat16 models; dtype is {dtype}")


class Fp8Weight:
    """One projection's weight, quantized: e4m3 [out, in] and float32 scales [1, out]
    (the shape `_scaled_mm` takes for the second operand's row-wise scales)."""

    def __init__(self, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        if weight.is_cuda and (in_features % 16 or out_features % 16):
            raise ValueError(f"quantization fp8: a projection of {out_features} x {in_features} "
                             "is not a multiple of 16 on both sides, which the fp8 matmul needs")
        q, scale = quantize_rows(weight)
        self.weight = q
        self.scale = scale.reshape(1, out_features).contiguous()
        # The scalar scale of the small-step path, made here, not while a CUDA graph captures.
        self._one = torch.ones((), dtype=torch.float32, device=weight.device)
        self._ops = _triton_ops() if weight.is_cuda else None   # looked up once, not per matmul

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            ops = self._ops
            q, s = ops.quantize_rows_fp8(x2, FP8_MAX, _MIN_AMAX) if ops is not None else quantize_rows(x2)
            if x2.shape[0] <= TENSORWISE_MAX_TOKENS and ops is not None:
                # Unit scalar scales (cuBLASLt's fp8 kernels), then both scale vectors in one pass.
                out = torch._scaled_mm(q, self.weight.t(), scale_a=self._one, scale_b=self._one,
                                       out_dtype=out_dtype)
                out = ops.scale_rows_and_cols_(out, s, self.scale, bias)
                return out.reshape(*shape[:-1], out.shape[-1])
            out = torch._scaled_mm(q, self.weight.t(), scale_a=s, scale_b=self.scale, out_dtype=out_dtype)
        else:
            q, s = quantize_rows(x2)
            w = self.weight.float() * self.scale.t()
            out = F.linear(q.float() * s, w).to(out_dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def _triton_ops():
    from replica_worker.engine.model import triton_ops

    return triton_ops if triton_ops.available() else None
