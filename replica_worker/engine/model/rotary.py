"""Rotary position embeddings with a precomputed cos/sin cache.

Matches transformers' "default", "linear" and "llama3" rope types (Llama 3.1
frequency scaling). Settings come from the loaded config object: transformers 5
keeps them in ``config.rope_parameters`` (older configs: ``rope_scaling`` and
``rope_theta``).
"""

from __future__ import annotations

import math

import torch


def rope_settings(hf_config) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def inverse_frequencies(rope: dict, rotary_dim: int) -> torch.Tensor:
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: dict, head_dim: int, max_positions: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Cast like transformers does (cos/sin in float32, then to the activation dtype).
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)
        # float32 [P, head_dim]: cos of each frequency, then sin (the fused rope kernels').
        # Built up front on CUDA (before any graph capture), on first use elsewhere.
        self._inv_freq = inv_freq
        self._cos_sin = self._build_cos_sin(positions) if torch.device(device).type == "cuda" else None
        self._max_positions = max_positions

    def _build_cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(positions, self._inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def cos_sin_cache(self) -> torch.Tensor:
        if self._cos_sin is None:
            positions = torch.arange(self._max_positions, dtype=torch.float32, device=self._inv_freq.device)
            self._cos_sin = self._build_cos_sin(positions)
        return self._cos_sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the step: gathered once, shared by every layer."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], rotate-half convention (Hugging Face checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
