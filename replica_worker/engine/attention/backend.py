"""Attention backend interface.

A backend names the KV cache layout it reads (kv_cache.py): NHD, flashinfer's
paged layout, which the torch backend shares so the two can be checked on the
same tensors, or HEAD_MAJOR, the CPU backend's.
"""

from __future__ import annotations

import abc
import logging
import os

import torch

from replica_worker.engine.attention.metadata import AttentionMetadata
from replica_worker.engine.kv_cache import NHD

logger = logging.getLogger(__name__)


class AttentionBackend(abc.ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = False
    kv_layout: str = NHD

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, not {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # None: full causal attention. W: a query at position p sees keys at p-W+1 .. p.
        self.sliding_window = sliding_window

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Once per step, before the first layer: precompute whatever every layer
        reuses (index tensors, masks, flashinfer plans) into metadata.backend_data."""

    @abc.abstractmethod
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Stores the new tokens' k, v ([T, num_kv_heads, head_dim]) at metadata.slot_mapping."""

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, num_heads, head_dim] against each sequence's cached context
        (which already holds this step's k, v); returns [T, num_heads, head_dim].
        A query at position p sees keys at positions <= p of its own sequence,
        and with a sliding window W only those > p - W."""

    def kv_store_rows(self, kv_cache: torch.Tensor, metadata: AttentionMetadata):
        """(rows, k_index, v_index) for a kernel that stores this step's k and v itself
        (triton_ops.rope_and_store_kv): the layer's cache as contiguous rows
        [R, num_kv_heads, head_dim] and each new token's K and V row in it. None when
        this backend stores them only through write_kv."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, metadata)
        return self.attend(q, k, v, kv_cache, metadata)


def select_backend(
    device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int | None = None,
) -> type[AttentionBackend]:
    """The backend class for a device: on the CPU the head-major CPU backend;
    on CUDA flashinfer when it can serve the model (fp16/bf16, head_dim
    64/128/256, importable; with or without a sliding window), else plain torch, with a warning.
    QUADRIGA_ATTENTION_BACKEND=torch|cpu|flashinfer forces one."""
    from replica_worker.engine.attention.cpu_backend import CpuAttentionBackend
    from replica_worker.engine.attention.torch_backend import TorchAttentionBackend

    forced = os.environ.get("QUADRIGA_ATTENTION_BACKEND", "").strip().lower()
    if forced == "torch":
        return TorchAttentionBackend
    if forced == "cpu" or torch.device(device).type != "cuda":
        return CpuAttentionBackend
    from replica_worker.engine.attention import flashinfer_backend as fb

    reason = fb.flashinfer_supports(dtype, head_dim)
    if reason is None:
        return fb.FlashInferBackend
    if forced == "flashinfer":
        raise RuntimeError(f"flashinfer backend forced but unusable: {reason}")
    logger.warning("attention on CUDA falls back to the torch backend: %s", reason)
    return TorchAttentionBackend
