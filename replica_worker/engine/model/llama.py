"""One Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a flattened batch.

The forward takes every token of a mixed prefill+decode step as one flat
batch (input_ids [T], positions [T]) and returns hidden states [T, hidden].
q/k/v and gate/up projections are fused into single matmuls; the loader
copies the checkpoint's separate matrices into their row slices.

Under tensor parallelism (group.size > 1) every projection and the vocabulary are
sharded (model/parallel.py): a rank holds its heads, its share of the MLP's
intermediate features and of the vocabulary, and two all-reduces per layer (after
o_proj and down_proj) give every rank the whole residual stream. Norms are replicated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica_worker.engine.attention import AttentionBackend, AttentionMetadata
from replica_worker.engine.distributed.group import SINGLE_RANK, TensorGroup
from replica_worker.engine.model.parallel import (
    ColumnParallelLinear,
    HeadShard,
    ParallelLMHead,
    RowParallelLinear,
    RowSlice,
    VocabParallelEmbedding,
    check_shape,
    empty_param,
    head_shard,
)
from replica_worker.engine.model.rotary import RotaryEmbedding, apply_rotary, rope_settings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def fused_kernels(device: torch.device, dtype: torch.dtype):
    """The module whose fused residual-add+RMSNorm, rotary and SiLU*up kernels run this
    model's layers (CUDA, fp16/bf16), else None (plain torch ops).

    QUADRIGA_FUSED_OPS selects it: unset or "triton" -> replica_worker's Triton kernels
    (model/triton_ops.py) when triton imports; "1" or "flashinfer" -> flashinfer's (its
    norm/rope/activation JIT modules must already be built: their first build on a fresh
    H200 machine was never seen to finish, see docs/gpu.md); "0" -> off. Both modules
    expose the same four functions, so the fused forward calls either one the same way."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    mode = os.environ.get("QUADRIGA_FUSED_OPS", "triton").strip().lower()
    if mode in ("1", "flashinfer"):
        try:
            import flashinfer
        except Exception:
            return None
        return flashinfer
    if mode in ("triton", ""):
        from replica_worker.engine.model import triton_ops

        return triton_ops if triton_ops.available() else None
    return None


def store_kv_in_rope(fused) -> bool:
    """Whether the rotary kernel also stores k and v into the KV cache (one kernel
    instead of three a layer; backends that expose kv_store_rows). Only Quadriga's
    Triton module has that kernel. On by default (two H100 runs of
    benchmarks/gpu/run_decode_kernels.sh: never slower beyond the noise);
    QUADRIGA_FUSED_KV_STORE=0 turns it off."""
    return (fused is not None and hasattr(fused, "rope_and_store_kv")
            and os.environ.get("QUADRIGA_FUSED_KV_STORE", "1").strip() == "1")


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaShape":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only silu (SwiGLU) is implemented")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
        )


class RMSNorm(nn.Module):
    """Replicated on every rank."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_param(size)
        self.eps = eps

    def expected_loads(self) -> set[tuple[str, str]]:
        return {("", "weight")}

    def load(self, part: str, kind: str, source) -> None:
        check_shape(source, tuple(self.weight.shape), kind)
        self.weight.copy_(source[:])

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        self.weight.fill_(1.0)  # unit norms keep activations from vanishing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def qkv_slices(s: LlamaShape, heads: HeadShard) -> list[RowSlice]:
    d = s.head_dim
    q = RowSlice("q", s.num_heads * d, heads.q_start * d, heads.num_heads * d)
    k, v = (RowSlice(p, s.num_kv_heads * d, heads.kv_start * d, heads.num_kv_heads * d) for p in "kv")
    return [q, k, v]


class Attention(nn.Module):
    """This rank's heads: q/k/v column-parallel, o_proj row-parallel over the same heads."""

    def __init__(self, s: LlamaShape, backend: AttentionBackend, group: TensorGroup) -> None:
        super().__init__()
        heads = head_shard(s.num_heads, s.num_kv_heads, group.rank, group.size)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, s.head_dim
        self.q_size = heads.num_heads * s.head_dim
        self.kv_size = heads.num_kv_heads * s.head_dim
        self.qkv_proj = ColumnParallelLinear(s.hidden_size, qkv_slices(s, heads), bias=s.qkv_bias)
        self.o_proj = RowParallelLinear(s.num_heads * s.head_dim, s.hidden_size, heads.q_start * s.head_dim, group)
        self.backend = backend
        self.store_kv_in_rope = False   # set by LlamaForCausalLM (see store_kv_in_rope)

    def forward(self, x, cos, sin, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, md)
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward_fused(self, x, positions, cos_sin, kv_cache, md, fi) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        rows = self.backend.kv_store_rows(kv_cache, md) if self.store_kv_in_rope else None
        if rows is not None:
            # One kernel rotates q and k and stores k and v in the cache.
            q = fi.rope_and_store_kv(positions, q, k, v, self.head_dim, cos_sin, *rows)
            out = self.backend.attend(q.view(-1, self.num_heads, self.head_dim), None, None, kv_cache, md)
            return self.o_proj(out.reshape(-1, self.q_size))
        # Out of place: q and k come back contiguous, as the attention kernels like them.
        q, k = fi.apply_rope_with_cos_sin_cache(positions, q, k, self.head_dim, cos_sin, is_neox=True)
        out = self.backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            kv_cache, md,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    """This rank's intermediate features: gate/up column-parallel, down row-parallel."""

    def __init__(self, s: LlamaShape, group: TensorGroup) -> None:
        super().__init__()
        rank, size = group.rank, group.size
        self.intermediate_size = s.intermediate_size // size
        self.gate_up_proj = ColumnParallelLinear(
            s.hidden_size, [RowSlice.even(p, s.intermediate_size, rank, size) for p in ("gate", "up")], bias=False
        )
        self.down_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, rank * self.intermediate_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, fi) -> torch.Tensor:
        return self.down_proj(fi.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape, backend: AttentionBackend, group: TensorGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, backend, group)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s, group)

    def forward(self, x, cos, sin, kv_cache, md):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, residual, positions, cos_sin, kv_cache, md, fi):
        """(layer output, residual stream): each norm adds the pending output into
        the residual stream and normalises it in one kernel, in place."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = x, fi.rmsnorm(x, norm1.weight, norm1.eps)
        else:
            fi.fused_add_rmsnorm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn.forward_fused(x, positions, cos_sin, kv_cache, md, fi)
        fi.fused_add_rmsnorm(x, residual, norm2.weight, norm2.eps)
        return self.mlp.forward_fused(x, fi), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, backend: AttentionBackend, max_positions: int,
                 group: TensorGroup = SINGLE_RANK) -> None:
        """backend: built for this rank's heads (Attention.num_heads, num_kv_heads)."""
        super().__init__()
        s = self.shape = LlamaShape.from_hf_config(hf_config)
        self.hf_config = hf_config
        self.group = group
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(s, backend, group) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = ParallelLMHead(s.vocab_size, s.hidden_size, group,
                                      tied_to=self.embed_tokens if s.tie_word_embeddings else None)
        weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            rope_settings(hf_config), s.head_dim, max_positions, dtype=weight.dtype, device=weight.device,
        )
        self.fused = fused_kernels(weight.device, weight.dtype)
        fuse_store = store_kv_in_rope(self.fused)
        for layer in self.layers:
            layer.self_attn.store_kv_in_rope = fuse_store

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        if self.fused is not None:
            return self._forward_fused(input_ids, positions, kv_caches, md, self.fused)
        cos, sin = self.rotary.lookup(positions)
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, md)
        return self.norm(x)

    def _forward_fused(self, input_ids, positions, kv_caches, md, fi) -> torch.Tensor:
        cos_sin = self.rotary.cos_sin_cache()
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward_fused(x, residual, positions, cos_sin, kv_cache, md, fi)
        fi.fused_add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab] for the (already selected) sampling rows, on every rank."""
        return self.lm_head(hidden)

    def weight_nbytes(self) -> int:
        """Bytes of weights held, fp8 projections (with their scales) included."""
        held = sum(p.numel() * p.element_size() for p in self.parameters())
        for module in self.modules():
            fp8 = getattr(module, "fp8", None)
            if fp8 is not None:
                held += sum(t.numel() * t.element_size() for t in (fp8.weight, fp8.scale))
        return held

    def quantize_fp8(self) -> None:
        """Every decoder projection to fp8 weights (model/fp8.py), layer by layer, so at
        most one layer's weights are held twice; embedding, norms and head stay."""
        for layer in self.layers:
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.quantize_fp8()

    def weight_modules(self) -> list[nn.Module]:
        """Every module holding checkpoint weights, in the order dummy weights are drawn
        (the order of the parameters before they were sharded modules, so that a seed
        draws the dummy model it always drew)."""
        out: list[nn.Module] = [self.embed_tokens, self.lm_head]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [layer.input_layernorm, attn.qkv_proj, attn.o_proj, layer.post_attention_layernorm,
                    mlp.gate_up_proj, mlp.down_proj]
        return out + [self.norm]
