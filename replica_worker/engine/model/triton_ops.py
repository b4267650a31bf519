"""Triton kernels for the decoder's small steps: residual add + RMSNorm, SiLU(gate) * up,
rotary embedding of q and k (alone, or with k and v stored into the paged KV cache in
the same kernel), and (fp8 only) a matmul input's per-token quantization, each one
kernel.

Plain torch runs these as ~40 small kernels per layer (fp32 RMSNorm alone is six or
seven), which at batch-1 decode cost more than the attention, and at prefill the
SiLU * up over the strided halves of the fused gate_up output falls on torch's slow
non-vectorised path. The functions mirror flashinfer's (rmsnorm, fused_add_rmsnorm,
silu_and_mul, apply_rope_with_cos_sin_cache), so the model calls either module the
same way (see llama.fused_kernels).

Numerics follow the torch path of llama.py: bf16/fp16 in and out, fp32 inside, with
the same rounding points (the residual sum is rounded before the norm, the normalised
row is rounded before the weight multiply, SiLU is rounded before the up multiply).
Rotary uses the fp32 cos/sin cache, as flashinfer's kernel does.

Used on CUDA only, when triton imports (``available``); the ``*_ref`` functions are
the torch definitions the kernels are tested against. With TRITON_INTERPRET=1 the
kernels also run on CPU tensors (tests/engine/test_fused_ops.py).

The kernels are launched with grids and arguments that do not depend on the number
of tokens except through the grid, so one compiled variant serves every batch size
and CUDA-graph capture finds it already compiled after the capture's warm-up.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # not installed (CPU-only installs, CI)
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


# ---------------------------------------------------------------- torch references
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rmsnorm_ref(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(rmsnorm_ref(residual, weight, eps))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_ref(positions, query, key, head_size, cos_sin_cache):
    """Out-of-place rotate-half rotary in fp32: (q, k) shaped [T, heads * head_size]."""
    half = head_size // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x):
        x = x.reshape(x.shape[0], -1, head_size).float()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return (rot(query).to(query.dtype).reshape(query.shape[0], -1),
            rot(key).to(key.dtype).reshape(key.shape[0], -1))


def rope_and_store_kv_ref(positions, query, key, value, head_size, cos_sin_cache, kv_rows, k_index, v_index):
    """rope_ref, then the rotated key and the value copied into rows k_index and
    v_index of kv_rows [R, Hk, head_size]; returns the rotated query."""
    q, k = rope_ref(positions, query, key, head_size, cos_sin_cache)
    n_k = key.shape[-1] // head_size
    kv_rows.index_copy_(0, k_index, k.view(-1, n_k, head_size))
    kv_rows.index_copy_(0, v_index, value.reshape(-1, n_k, head_size))
    return q


# ---------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n_cols, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_heads(src, dst, n_heads, c, s, d, dmask, HALF: tl.constexpr, BH: tl.constexpr):
        h = tl.arange(0, BH)
        m = (h[:, None] < n_heads) & dmask[None, :]
        off = h[:, None] * (2 * HALF) + d[None, :]
        x1 = tl.load(src + off, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + off + HALF, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        tl.store(dst + off, o1.to(dst.dtype.element_ty), mask=m)
        tl.store(dst + off + HALF, o2.to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, v_ptr, q_out, k_out, pos_ptr, k_row_ptr, v_row_ptr, cs_ptr,
                     q_stride, k_stride, v_stride, cs_stride, n_q, n_k,
                     HALF: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, STORE: tl.constexpr):
        # One token: q rotated into q_out. k rotated into row t of k_out; with STORE,
        # k_out is the cache's rows (each the token's n_k heads, contiguous), k goes to
        # row k_row[t] and v is copied to row v_row[t].
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, BD)
        dmask = d < HALF
        c = tl.load(cs_ptr + pos * cs_stride + d, mask=dmask, other=0.0).to(tl.float32)
        s = tl.load(cs_ptr + pos * cs_stride + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        row_len = n_k * 2 * HALF
        _rope_heads(q_ptr + t * q_stride, q_out + t * (n_q * 2 * HALF), n_q, c, s, d, dmask, HALF, BQ)
        if STORE:
            k_row = tl.load(k_row_ptr + t).to(tl.int64)
        else:
            k_row = t
        _rope_heads(k_ptr + t * k_stride, k_out + k_row * row_len, n_k, c, s, d, dmask, HALF, BK)
        if STORE:
            v_row = tl.load(v_row_ptr + t).to(tl.int64)
            e = tl.arange(0, BV)
            vmask = e < row_len
            v = tl.load(v_ptr + t * v_stride + e, mask=vmask, other=0.0)
            tl.store(k_out + v_row * row_len + e, v.to(k_out.dtype.element_ty), mask=vmask)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, x_stride, n_cols, fp8_max, min_amax, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # Correctly rounded divisions, as torch's: plain `/` lowers to an approximate one.
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), min_amax), fp8_max)
        q = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


    @triton.jit
    def _scale_out_kernel(y_ptr, sx_ptr, sw_ptr, b_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * tl.load(sx_ptr + row) * tl.load(sw_ptr + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    # ~8 elements (16 bytes of bf16) per thread.
    return max(1, min(16, block // 256))


def _norm(x, residual, weight, out, eps: float) -> None:
    n = x.shape[-1]
    if x.numel() == 0:
        return
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and weight.is_contiguous()
    block = triton.next_power_of_2(n)
    rows = x.numel() // n
    _rmsnorm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), n, float(eps),
        HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
    )


# ---------------------------------------------------------------- public API (flashinfer's names)
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rmsnorm(x) * weight, new tensor. x: [T, H] with unit stride along H."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, None, weight, out, eps)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    """In place: residual += x; x = rmsnorm(residual) * weight."""
    _norm(x, residual, weight, x, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up, as the fused gate_up matmul writes them) -> SiLU(gate) * up [T, I]."""
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    assert x.stride(-1) == 1
    x2 = x.reshape(-1, 2 * n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out, x2.stride(0), n, n, BLOCK=block, num_warps=_warps(block),
    )
    return out


def quantize_rows_fp8(x: torch.Tensor, fp8_max: float, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit stride along K) -> (e4m3 [T, K], float32 scales [T, 1]), row by
    row as fp8.quantize_rows defines it, in one kernel."""
    rows, n = x.shape
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    assert x.stride(-1) == 1
    block = triton.next_power_of_2(n)
    _quant_rows_kernel[(rows,)](x, q, scale, x.stride(0), n, fp8_max, min_amax, BLOCK=block,
                                num_warps=_warps(block))
    return q, scale


def scale_rows_and_cols_(y: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """In place: y[i, j] = y[i, j] * row_scale[i] * col_scale[j] (+ bias[j]), in fp32,
    rounded once to y's dtype. y [T, N] contiguous; row_scale [T] or [T, 1], col_scale
    [N] or [1, N], float32."""
    rows, n = y.shape
    if y.numel() == 0:
        return y
    assert y.is_contiguous()
    block = min(1024, triton.next_power_of_2(n))
    _scale_out_kernel[(rows, triton.cdiv(n, block))](
        y, row_scale, col_scale, bias if bias is not None else y, n,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=_warps(block),
    )
    return y


def apply_rope_with_cos_sin_cache(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool = True):
    """Rotate-half rotary of query [T, Hq * D] and key [T, Hk * D] (row-strided views of the
    qkv output are fine) at positions [T]; cos_sin_cache [P, D] float32 (cos of each
    frequency, then sin). Returns new contiguous (q, k) of the same shapes."""
    if not is_neox:
        raise NotImplementedError("only the rotate-half (neox) layout")
    t = query.shape[0]
    n_q, n_k = query.shape[-1] // head_size, key.shape[-1] // head_size
    q_out = torch.empty((t, n_q * head_size), dtype=query.dtype, device=query.device)
    k_out = torch.empty((t, n_k * head_size), dtype=key.dtype, device=key.device)
    if t == 0:
        return q_out, k_out
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    half = head_size // 2
    bd = triton.next_power_of_2(half)
    bq, bk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    _rope_kernel[(t,)](
        query, key, key, q_out, k_out, positions, positions, positions, cos_sin_cache,
        query.stride(0), key.stride(0), 0, cos_sin_cache.stride(0), n_q, n_k,
        HALF=half, BD=bd, BQ=bq, BK=bk, BV=1, STORE=False, num_warps=_warps(bq * bd),
    )
    return q_out, k_out


def rope_and_store_kv(positions, query, key, value, head_size: int, cos_sin_cache, kv_rows, k_index, v_index):
    """apply_rope_with_cos_sin_cache and the cache write of this step's k and v in one
    kernel: the rotated key and the value go straight to rows k_index[t] and v_index[t]
    of kv_rows [R, Hk, head_size] (the cache's flat row view, contiguous), so neither
    the rotated key nor two index_copy_ launches exist. Returns the rotated query,
    new and contiguous [T, Hq * head_size]. query/key/value may be row-strided views of
    the qkv output."""
    t = query.shape[0]
    n_q, n_k = query.shape[-1] // head_size, key.shape[-1] // head_size
    q_out = torch.empty((t, n_q * head_size), dtype=query.dtype, device=query.device)
    if t == 0:
        return q_out
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv_rows.is_contiguous() and kv_rows.shape[1:] == (n_k, head_size)
    assert cos_sin_cache.stride(-1) == 1
    half = head_size // 2
    bq, bk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    bd = triton.next_power_of_2(half)
    _rope_kernel[(t,)](
        query, key, value, q_out, kv_rows, positions, k_index, v_index, cos_sin_cache,
        query.stride(0), key.stride(0), value.stride(0), cos_sin_cache.stride(0), n_q, n_k,
        HALF=half, BD=bd, BQ=bq, BK=bk, BV=triton.next_power_of_2(n_k * head_size), STORE=True,
        num_warps=_warps(bq * bd),
    )
    return q_out
