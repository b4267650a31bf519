"""Attention backends over a paged KV cache, and the per-step metadata they share."""

from replica_worker.engine.attention.backend import AttentionBackend, select_backend
from replica_worker.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from replica_worker.engine.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "build_attention_metadata",
    "select_backend",
]
