"""Triton kernels of replica_worker.engine.model.triton_ops against their torch definitions.

Runs on CUDA when there is one, else on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported); skipped without triton.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.triton_device import DEV
from replica_worker.engine.model import triton_ops as ops
from replica_worker.engine.model.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies


def _close(a, b, dtype, ulps=1):
    # Agreement to about two rounding steps of the output dtype (the kernels round where
    # torch does, but a last-bit difference in the fp32 reduction can flip a rounding).
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype] * ulps
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (5, 384), (3, 4096)])
def test_rmsnorm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    _close(ops.rmsnorm(x, w, 1e-5), ops.rmsnorm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (7, 320), (2, 4096)])
def test_fused_add_rmsnorm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    res = (torch.randn(rows, hidden, generator=g) * 4).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    x_ref, res_ref = x.clone(), res.clone()
    ops.fused_add_rmsnorm_ref(x_ref, res_ref, w, 1e-5)
    ops.fused_add_rmsnorm(x, res, w, 1e-5)
    if DEV == "cuda":
        assert torch.equal(res, res_ref)  # the residual sum rounds exactly as torch's add
    else:  # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest
        _close(res, res_ref, dtype)
    _close(x, x_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 512), (4, 1000), (3, 2304)])
def test_silu_and_mul(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype).to(DEV)
    _close(ops.silu_and_mul(x), ops.silu_and_mul_ref(x), dtype)


def test_silu_and_mul_of_a_strided_batch():
    x = torch.randn(6, 2 * 256).to(torch.bfloat16).to(DEV)
    y = x.view(3, 2, 512)
    _close(ops.silu_and_mul(y).view(6, 256), ops.silu_and_mul_ref(x), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_q,n_k,head_dim", [(4, 2, 64), (6, 2, 128), (32, 8, 128), (3, 3, 32)])
def test_rope_on_qkv_views(dtype, n_q, n_k, head_dim):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    emb = RotaryEmbedding(rope, head_dim, 4096, dtype=dtype, device="cpu")
    inv = inverse_frequencies(rope, head_dim)
    f = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
    cos_sin = torch.cat((f.cos(), f.sin()), dim=-1).to(DEV)
    t = 9
    g = torch.Generator().manual_seed(n_q * head_dim)
    qkv = torch.randn(t, (n_q + 2 * n_k) * head_dim, generator=g).to(dtype).to(DEV)
    q, k, _ = qkv.split((n_q * head_dim, n_k * head_dim, n_k * head_dim), dim=-1)
    positions = torch.tensor([0, 1, 2, 100, 1023, 4095, 7, 7, 3000]).to(DEV)
    q_ref, k_ref = ops.rope_ref(positions, q, k, head_dim, cos_sin)
    before = qkv.clone()
    q_out, k_out = ops.apply_rope_with_cos_sin_cache(positions, q, k, head_dim, cos_sin, is_neox=True)
    assert torch.equal(qkv, before)  # out of place
    assert q_out.is_contiguous() and k_out.is_contiguous()
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    # and against the model's own rotary (bf16 cos/sin tables): within bf16 noise
    cos, sin = emb.lookup(positions.cpu())
    q_model = apply_rotary(q.cpu().view(t, n_q, head_dim), cos, sin).reshape(t, -1)
    _close(q_out.cpu(), q_model, dtype, ulps=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_q,n_k,head_dim", [(4, 2, 64), (32, 8, 128), (3, 3, 32)])
def test_rope_and_store_kv_writes_the_cache_rows(dtype, n_q, n_k, head_dim):
    """The fused kernel's q equals apply_rope's; its cache rows equal rope's k and the
    value stored by index_copy_; rows no token names stay as they were."""
    inv = inverse_frequencies({"rope_type": "default", "rope_theta": 10000.0}, head_dim)
    f = torch.outer(torch.arange(2048, dtype=torch.float32), inv)
    cos_sin = torch.cat((f.cos(), f.sin()), dim=-1).to(DEV)
    t, num_rows = 7, 40
    g = torch.Generator().manual_seed(n_q + n_k + head_dim)
    qkv = torch.randn(t, (n_q + 2 * n_k) * head_dim, generator=g).to(dtype).to(DEV)
    q, k, v = qkv.split((n_q * head_dim, n_k * head_dim, n_k * head_dim), dim=-1)
    positions = torch.tensor([0, 1, 5, 100, 2047, 9, 9]).to(DEV)
    # k and v rows interleaved as the flashinfer layout's flat view has them
    k_index = torch.tensor([0, 2, 4, 16, 18, 20, 38]).to(DEV)
    v_index = k_index + 1
    rows = torch.randn(num_rows, n_k, head_dim, generator=g).to(dtype).to(DEV)
    want_rows = rows.clone()
    want_q = ops.rope_and_store_kv_ref(positions, q, k, v, head_dim, cos_sin, want_rows, k_index, v_index)
    got_q = ops.rope_and_store_kv(positions, q, k, v, head_dim, cos_sin, rows, k_index, v_index)
    assert got_q.is_contiguous()
    _close(got_q, want_q, dtype)
    _close(rows, want_rows, dtype)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[torch.cat((k_index, v_index)).cpu()] = False
    assert torch.equal(rows[untouched.to(DEV)], want_rows[untouched.to(DEV)])
    assert torch.equal(rows[v_index], v.reshape(t, n_k, head_dim))   # values are copied, not rounded


def test_empty_inputs():
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEV)
    assert ops.rmsnorm(x, w).shape == (0, 256)
    assert ops.silu_and_mul(torch.empty(0, 512, dtype=torch.bfloat16, device=DEV)).shape == (0, 256)


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_fused_forward_matches_the_torch_forward(tiny_model_factory, arch):
    """The whole model with the kernels (as llama.fused_kernels selects on CUDA) against
    its plain torch forward, bf16, one prompt through the paged path."""
    from replica_worker.engine.attention import TorchAttentionBackend, build_attention_metadata
    from replica_worker.engine.config import ModelConfig
    from replica_worker.engine.kv_cache import KVCache
    from replica_worker.engine.model import get_model, load_hf_config

    path = tiny_model_factory(arch)
    cfg = load_hf_config(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    model = get_model(ModelConfig(str(path), dtype="bfloat16", load_format="dummy"), backend, DEV, 256)
    prompt = list(range(3, 40, 2))
    bs = 4
    blocks = -(-len(prompt) // bs)

    def run(fused):
        model.fused = fused
        cache = KVCache(model.shape.num_layers, blocks, bs, model.shape.num_kv_heads, head_dim, torch.bfloat16, DEV)
        md, positions, _ = build_attention_metadata([0], [len(prompt)], [list(range(blocks))], 1, bs, DEV)
        backend.prepare(md)
        with torch.inference_mode():
            return model(torch.tensor(prompt, device=DEV), positions, cache.layers, md).float(), cache

    ref, ref_cache = run(None)
    out, cache = run(ops)
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 0.05 * scale, ((out - ref).abs().max(), scale)
    for a, b in zip(cache.layers, ref_cache.layers):
        assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 256), (5, 4096), (3, 1000)])
def test_quantize_rows_fp8(dtype, rows, cols):
    from replica_worker.engine.model.fp8 import FP8_MAX, quantize_rows

    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 5).to(dtype)
    x[0, :7] = 0.0
    q, s = ops.quantize_rows_fp8(x.to(DEV), FP8_MAX, 1e-12)
    q_ref, s_ref = quantize_rows(x)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    if DEV == "cuda":   # the interpreter's fp32 -> e4m3 cast is not the hardware's (-125.7 became -64)
        assert torch.equal(q.cpu().float(), q_ref.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scale_rows_and_cols(dtype, with_bias):
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(5, 1500, generator=g) * 100).to(dtype)
    rs, cs = torch.rand(5, 1, generator=g), torch.rand(1, 1500, generator=g)
    bias = torch.randn(1500, generator=g).to(dtype) if with_bias else None
    want = y.float() * rs * cs + (bias.float() if with_bias else 0)
    got = ops.scale_rows_and_cols_(y.to(DEV), rs.to(DEV), cs.to(DEV), None if bias is None else bias.to(DEV))
    _close(got.cpu(), want.to(dtype), dtype)
