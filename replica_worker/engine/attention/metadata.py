"""Per-step attention metadata for a flattened mixed prefill+decode batch.

Built once per step by the runner (never per layer). Sequences are ordered
prefills first, then decodes (one-token chunks), as flashinfer's separate
prefill and decode wrappers want. Every device tensor is also kept on the
host (``*_host``) so a backend can plan without a device-to-host sync.

Token t of sequence i sits at position ``num_computed[i] + (t - query_start_loc[i])``
and its K/V go to physical slot ``block_id * block_size + position % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_prefills: int  # the first num_prefills sequences; the rest are decodes
    num_prefill_tokens: int
    num_decode_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Device tensors.
    query_start_loc: torch.Tensor  # [B+1] int32, cu_seqlens of the query tokens
    seq_lens: torch.Tensor  # [B] int32, context length after this chunk
    num_computed: torch.Tensor  # [B] int32, context length before this chunk
    slot_mapping: torch.Tensor  # [T] int64, physical slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    paged_kv_indptr: torch.Tensor  # [B+1] int32 (flashinfer)
    paged_kv_indices: torch.Tensor  # [nnz_blocks] int32 (flashinfer)
    paged_kv_last_page_len: torch.Tensor  # [B] int32 (flashinfer), in 1..block_size
    # Host copies (CPU tensors) of the same numbers.
    query_start_loc_host: torch.Tensor
    seq_lens_host: torch.Tensor
    num_computed_host: torch.Tensor
    paged_kv_indptr_host: torch.Tensor
    paged_kv_last_page_len_host: torch.Tensor
    # Whatever the backend precomputes once per step (AttentionBackend.prepare).
    backend_data: Any = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.query_start_loc

    @property
    def qo_indptr_host(self) -> torch.Tensor:
        return self.query_start_loc_host


def build_attention_metadata(
    num_computed: Seq[int],
    num_tokens: Seq[int],
    block_ids: Seq[Seq[int]],
    num_prefills: int,
    block_size: int,
    device: torch.device | str,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Returns the metadata and the positions [T] (int64, host) of the flattened tokens.

    Sequences must already be ordered prefills first. block_ids[i] must cover
    num_computed[i] + num_tokens[i] tokens (extra trailing blocks are ignored).
    """
    num_seqs = len(num_tokens)
    nc = np.asarray(num_computed, dtype=np.int64)
    nt = np.asarray(num_tokens, dtype=np.int64)
    seq_lens = nc + nt
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(nt, out=qsl[1:])
    total = int(qsl[-1])

    seq_of_token = np.repeat(np.arange(num_seqs), nt)
    positions = np.arange(total, dtype=np.int64) - qsl[:-1][seq_of_token] + nc[seq_of_token]

    blocks_needed = (seq_lens + block_size - 1) // block_size
    max_blocks = int(blocks_needed.max()) if num_seqs else 0
    block_table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        n = int(blocks_needed[i])
        if len(ids) < n:
            raise ValueError(f"sequence {i} has {len(ids)} blocks, needs {n} for {int(seq_lens[i])} tokens")
        block_table[i, :n] = ids[:n]
    slot_mapping = block_table[seq_of_token, positions // block_size] * block_size + positions % block_size

    kv_indptr = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(blocks_needed, out=kv_indptr[1:])
    kv_indices = block_table[np.arange(max_blocks)[None, :] < blocks_needed[:, None]]
    last_page_len = seq_lens - (blocks_needed - 1) * block_size

    num_prefill_tokens = int(qsl[num_prefills])
    dev = torch.device(device)

    def host(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t if dev.type == "cpu" else t.pin_memory().to(dev, non_blocking=True)

    qsl_h = host(qsl, torch.int32)
    seq_lens_h = host(seq_lens, torch.int32)
    nc_h = host(nc, torch.int32)
    kv_indptr_h = host(kv_indptr, torch.int32)
    last_page_h = host(last_page_len, torch.int32)
    md = AttentionMetadata(
        num_seqs=num_seqs,
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=total - num_prefill_tokens,
        block_size=block_size,
        max_query_len=int(nt.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        query_start_loc=to_dev(qsl_h),
        seq_lens=to_dev(seq_lens_h),
        num_computed=to_dev(nc_h),
        slot_mapping=to_dev(host(slot_mapping, torch.int64)),
        block_tables=to_dev(host(block_table, torch.int32)),
        paged_kv_indptr=to_dev(kv_indptr_h),
        paged_kv_indices=to_dev(host(kv_indices, torch.int32)),
        paged_kv_last_page_len=to_dev(last_page_h),
        query_start_loc_host=qsl_h,
        seq_lens_host=seq_lens_h,
        num_computed_host=nc_h,
        paged_kv_indptr_host=kv_indptr_h,
        paged_kv_last_page_len_host=last_page_h,
    )
    return md, positions
