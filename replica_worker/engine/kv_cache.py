"""Paged KV cache: one tensor per layer, in the layout its attention backend reads.

- NHD, [num_blocks, 2, block_size, num_kv_heads, head_dim] (dim 1: K then V):
  flashinfer's paged layout, which the torch backend also reads, so the two
  can be checked against each other on the same tensors.
- HEAD_MAJOR, [2, num_kv_heads, num_blocks, block_size, head_dim]: the CPU
  backend's, where a sequence's blocks gather into one contiguous run per head.

Either way a block id names the same tokens' K and V on every layer.
"""

from __future__ import annotations

from typing import Callable

import torch

from replica_worker.engine.config import (DEFAULT_CPU_KV_CACHE_BYTES, MAX_DEFAULT_CPU_KV_CACHE_BYTES,
                                          CacheConfig)

NHD = "nhd"
HEAD_MAJOR = "head_major"


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV bytes of one block across all layers (the unit the BlockManager hands out)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def determine_num_blocks(
    cache_config: CacheConfig,
    block_bytes: int,
    device: torch.device,
    profile: Callable[[], None] | None = None,
    max_model_len: int = 0,
) -> int:
    """num_blocks when configured; on the CPU kv_cache_memory_bytes // block_bytes;
    on CUDA what fits in total * gpu_memory_utilization once the weights and the
    peak activations of a profiling forward (`profile`) are counted.

    The CPU default holds at least one request of max_model_len tokens, up to
    MAX_DEFAULT_CPU_KV_CACHE_BYTES: a server whose client leaves max_tokens out
    asks for the length the prompt leaves, and a cache that could never hold it
    would refuse such requests on a model and settings that are otherwise fine.
    A budget given is kept as given."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    if device.type != "cuda":
        budget = cache_config.kv_cache_memory_bytes
        if budget is None:
            whole_request = min(-(-max_model_len // cache_config.block_size) + 1,
                                MAX_DEFAULT_CPU_KV_CACHE_BYTES // block_bytes)
            num = max(DEFAULT_CPU_KV_CACHE_BYTES // block_bytes, whole_request)
        else:
            num = budget // block_bytes
    else:
        torch.cuda.synchronize(device)
        if profile is not None:
            profile()
            torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        # (total - free) holds the weights, the allocator's cached activation
        # memory (reused by later steps) and non-torch usage (CUDA context).
        num = int(total * cache_config.gpu_memory_utilization - (total - free)) // block_bytes
    if num < 1:
        raise RuntimeError(
            f"no memory left for the KV cache ({block_bytes} bytes per block); "
            "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_blocks"
        )
    return int(num)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch_blocks: int = 0,
        layout: str = NHD,
    ) -> None:
        """scratch_blocks extra blocks follow the num_blocks the BlockManager
        hands out (ids num_blocks, ...): CUDA-graph padding rows write there."""
        if layout not in (NHD, HEAD_MAJOR):
            raise ValueError(f"unknown KV cache layout {layout!r}")
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks if scratch_blocks else None
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        blocks = num_blocks + scratch_blocks
        if layout == NHD:
            shape = (blocks, 2, block_size, num_kv_heads, head_dim)
        else:
            shape = (2, num_kv_heads, blocks, block_size, head_dim)
        # Zeros, not empty: padded decode rows gather never-written slots, and
        # NaN garbage there would poison the masked softmax's matmul.
        self.layers: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
