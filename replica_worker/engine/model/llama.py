"""One Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a flattened batch.

The forward takes every token of a mixed prefill+decode step as one flat
batch (input_ids [T], positions [T]) and returns hidden states [T, hidden].
q/k/v and gate/up projections are fused into single matmuls; the loader
copies the checkpoint's separate matrices into their row slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica_worker.engine.attention import AttentionBackend, AttentionMetadata
from replica_worker.engine.model.rotary import RotaryEmbedding, apply_rotary, rope_settings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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


def _weight(*shape: int) -> nn.Parameter:
    # Allocated on the ambient default device and dtype (see loader.model_context).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _weight(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, s.hidden_size)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size) if s.qkv_bias else None
        self.o_proj = _weight(s.hidden_size, self.q_size)
        self.backend = backend

    def forward(self, x, cos, sin, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, md)
        return F.linear(out.reshape(-1, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.intermediate_size = s.intermediate_size
        self.gate_up_proj = _weight(2 * s.intermediate_size, s.hidden_size)
        self.down_proj = _weight(s.hidden_size, s.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, backend)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x, cos, sin, kv_cache, md):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        s = self.shape = LlamaShape.from_hf_config(hf_config)
        self.hf_config = hf_config
        self.embed_tokens = _weight(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, backend) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = self.embed_tokens if s.tie_word_embeddings else _weight(s.vocab_size, s.hidden_size)
        self.rotary = RotaryEmbedding(
            rope_settings(hf_config), s.head_dim, max_positions,
            dtype=self.embed_tokens.dtype, device=self.embed_tokens.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        cos, sin = self.rotary.lookup(positions)
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, md)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab] for the (already selected) sampling rows."""
        return F.linear(hidden, self.lm_head).float()
