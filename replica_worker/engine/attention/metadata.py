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
    extra: Seq[np.ndarray] = (),
) -> tuple[AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    """Returns the metadata, the positions [T] of the flattened tokens and the
    `extra` int arrays (e.g. input ids), all on the device, moved in one copy.

    Sequences must already be ordered prefills first. block_ids[i] must cover
    num_computed[i] + num_tokens[i] tokens (extra trailing blocks are ignored).
    """
    num_seqs = len(num_tokens)
    nc = np.asarray(num_computed, dtype=np.int64)
    nt = np.asarray(num_tokens, dtype=np.int64)
    qsl, seq_lens, positions, block_table, slot_mapping, kv_indptr, kv_indices, last_page_len = _host_layout(
        nc, nt, block_ids, block_size
    )
    total, max_blocks = int(qsl[-1]), block_table.shape[1]
    num_prefill_tokens = int(qsl[num_prefills])
    host = [qsl, seq_lens, nc, kv_indptr, last_page_len]
    as_int32 = [*host, kv_indices, block_table.reshape(-1)]
    as_int64 = [slot_mapping, positions, *extra]
    sizes = [a.size for a in as_int32 + as_int64]
    packed = _transfer(as_int32 + as_int64, device)
    n32 = sum(sizes[: len(as_int32)])
    i32 = packed[:n32].to(torch.int32).split(sizes[: len(as_int32)])
    dev = [None] * len(as_int32) + list(packed[n32:].split(sizes[len(as_int32):]))
    qsl_h, seq_lens_h, nc_h, kv_indptr_h, last_page_h = (torch.from_numpy(a).to(torch.int32) for a in host)
    md = AttentionMetadata(
        num_seqs=num_seqs,
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=total - num_prefill_tokens,
        block_size=block_size,
        max_query_len=int(nt.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        query_start_loc=i32[0],
        seq_lens=i32[1],
        num_computed=i32[2],
        paged_kv_indptr=i32[3],
        paged_kv_last_page_len=i32[4],
        paged_kv_indices=i32[5],
        block_tables=i32[6].view(num_seqs, max_blocks),
        slot_mapping=dev[7],
        query_start_loc_host=qsl_h,
        seq_lens_host=seq_lens_h,
        num_computed_host=nc_h,
        paged_kv_indptr_host=kv_indptr_h,
        paged_kv_last_page_len_host=last_page_h,
    )
    return md, dev[8], dev[9:]


def _host_layout(nc: np.ndarray, nt: np.ndarray, block_ids: Seq[Seq[int]], block_size: int):
    """Every per-token and per-sequence index array, vectorised over the batch."""
    num_seqs = len(nt)
    seq_lens = nc + nt
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(nt, out=qsl[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), nt)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[:-1][seq_of_token] + nc[seq_of_token]

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
    return qsl, seq_lens, positions, block_table, slot_mapping, kv_indptr, kv_indices, last_page_len


def _transfer(arrays: list[np.ndarray], device: torch.device | str) -> torch.Tensor:
    """int arrays -> one flat int64 tensor on the device, in one host-to-device copy."""
    packed = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays]))
    dev = torch.device(device)
    if dev.type != "cpu":
        packed = packed.pin_memory().to(dev, non_blocking=True)
    return packed
