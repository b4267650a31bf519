"""Plain-torch paged attention: the CPU backend and the reference for others.

Prefill chunks run one scaled_dot_product_attention each against their
gathered context; all decodes run as one padded, masked batch. Every index
tensor and mask is built once per step in prepare(), not per layer. A sliding
window only narrows the masks: pages wholly before a sequence's window may
name the block manager's null block (zeros), which the masks hide.

On CUDA this is the fallback (flashinfer cannot serve the model, or is not
importable), and the KV cache is sized from a profiling prefill with no
context. A masked call may run on the math kernel, which expands K and V to
every query head and materialises the scores, so a batch of 256 decodes at
1024 tokens of context would want gigabytes per layer beyond the profile
(the Llama-3.1-8B shape asked an 80 GB card for 4 GiB more than it had). The decodes, and the query rows of a
prefill with cached context, therefore run in slices whose working set stays
under WORKSPACE_BYTES, well inside what gpu_memory_utilization leaves free.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from replica_worker.engine.attention.backend import AttentionBackend
from replica_worker.engine.attention.metadata import AttentionMetadata


@dataclass
class _PrefillPlan:
    q_start: int
    q_end: int
    # None when the chunk is the whole context (num_computed == 0): attend to
    # the new k, v directly (is_causal, or `mask` under a sliding window).
    ctx_block: torch.Tensor | None  # [L] physical block of each context position
    ctx_offset: torch.Tensor | None  # [L]
    mask: torch.Tensor | None  # [Q, L] bool, True = attend


@dataclass
class _TorchPlan:
    write_block: torch.Tensor  # [T]
    write_offset: torch.Tensor  # [T]
    prefills: list[_PrefillPlan]
    dec_block: torch.Tensor | None  # [D, Lmax]
    dec_offset: torch.Tensor | None  # [Lmax]
    dec_mask: torch.Tensor | None  # [D, 1, 1, Lmax]


def causal_mask(num_computed: int, seq_len: int, window: int | None, device) -> torch.Tensor:
    """[Q, L] bool, True = attend: query positions num_computed..seq_len-1 against
    keys 0..seq_len-1, each seeing keys at or before it (and within the window)."""
    pos = torch.arange(seq_len, device=device)
    q_pos = torch.arange(num_computed, seq_len, device=device)
    mask = pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= pos[None, :] > q_pos[:, None] - window
    return mask


def decode_mask(seq_lens: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[D, 1, 1, length] bool, True = attend: each decode's query (at position
    seq_len - 1) against key positions 0..length-1, padding hidden."""
    pos = torch.arange(length, device=seq_lens.device)
    lens = seq_lens[:, None]
    visible = pos[None, :] < lens
    if window is not None:
        visible &= pos[None, :] >= lens - window
    return visible[:, None, None, :]


_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The most a masked attention call may hold at once (see the module docstring).
WORKSPACE_BYTES = 512 << 20


def rows_per_slice(bytes_per_row: int, workspace: int) -> int:
    """How many rows (decodes, or a prefill's query rows) fit in one call."""
    return max(1, workspace // max(1, bytes_per_row))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    workspace_bytes = WORKSPACE_BYTES

    def prepare(self, md: AttentionMetadata) -> None:
        bs = md.block_size
        device = md.slot_mapping.device
        qsl = md.query_start_loc_host.tolist()
        nc = md.num_computed_host.tolist()
        lens = md.seq_lens_host.tolist()
        window = self.sliding_window
        prefills = []
        for i in range(md.num_prefills):
            windowed = window is not None and lens[i] > window
            if nc[i] == 0 and not windowed:
                prefills.append(_PrefillPlan(qsl[i], qsl[i + 1], None, None, None))
                continue
            mask = causal_mask(nc[i], lens[i], window, device)
            if nc[i] == 0:  # the chunk is its whole context: no gather
                prefills.append(_PrefillPlan(qsl[i], qsl[i + 1], None, None, mask))
                continue
            pos = torch.arange(lens[i], device=device)
            prefills.append(
                _PrefillPlan(qsl[i], qsl[i + 1], md.block_tables[i, pos // bs].long(), pos % bs, mask)
            )
        dec_block = dec_offset = dec_mask = None
        if md.num_decodes:
            lmax = max(lens[md.num_prefills:])
            pos = torch.arange(lmax, device=device)
            dec_block = md.block_tables[md.num_prefills:, pos // bs].long()
            dec_offset = pos % bs
            dec_mask = decode_mask(md.seq_lens[md.num_prefills:], lmax, window)
        md.backend_data = _TorchPlan(
            md.slot_mapping // bs, md.slot_mapping % bs, prefills, dec_block, dec_offset, dec_mask
        )

    @staticmethod
    def _plan(md: AttentionMetadata) -> _TorchPlan:
        if md.backend_data is None:
            raise RuntimeError("TorchAttentionBackend.prepare(metadata) was not called for this step")
        return md.backend_data

    def write_kv(self, kv_cache, k, v, md):
        plan = self._plan(md)
        # Advanced indices around a slice put the indexed dim first: [T, 2, H, D].
        kv_cache[plan.write_block, :, plan.write_offset] = torch.stack((k, v), dim=1)

    def attend(self, q, k, v, kv_cache, md):
        # cuDNN attention builds a graph per new shape (hundreds of ms); every
        # step here brings new context lengths, so keep to the other kernels.
        ctx = sdpa_kernel(_CUDA_SDPA) if q.is_cuda else contextlib.nullcontext()
        with ctx:
            return self._attend(q, k, v, kv_cache, md)

    def _attend(self, q, k, v, kv_cache, md):
        plan = self._plan(md)
        out = torch.empty_like(q)
        for p in plan.prefills:
            qi = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
            if p.ctx_block is None:
                ki = k[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
                vi = v[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, is_causal=p.mask is None,
                                                   scale=self.scale, enable_gqa=True)
                out[p.q_start : p.q_end] = o[0].transpose(0, 1)
                continue
            ctx = kv_cache[p.ctx_block, :, p.ctx_offset]  # [L, 2, Hkv, D]
            ki = ctx[:, 0].transpose(0, 1).unsqueeze(0)
            vi = ctx[:, 1].transpose(0, 1).unsqueeze(0)
            length, hq, dim = ki.shape[2], qi.shape[1], ki.shape[3]
            # Per query row: its scores (float) and mask row; plus, once, K and V
            # expanded to every query head.
            fixed = 2 * length * hq * dim * ki.element_size()
            step = rows_per_slice(length * (hq * 4 + 1), max(self.workspace_bytes - fixed, self.workspace_bytes // 2))
            for a in range(0, qi.shape[2], step):
                o = F.scaled_dot_product_attention(qi[:, :, a : a + step], ki, vi, attn_mask=p.mask[a : a + step],
                                                   scale=self.scale, enable_gqa=True)
                out[p.q_start + a : p.q_start + a + o.shape[2]] = o[0].transpose(0, 1)
        if plan.dec_block is not None:
            start = md.num_prefill_tokens
            lmax, hkv, dim = plan.dec_block.shape[1], kv_cache.shape[-2], kv_cache.shape[-1]
            hq = q.shape[1]
            # Per decode: its gathered K and V, their expansion to every query
            # head, and its scores.
            per_row = lmax * (2 * (hkv + hq) * dim * kv_cache.element_size() + hq * 4)
            step = rows_per_slice(per_row, self.workspace_bytes)
            for a in range(0, plan.dec_block.shape[0], step):
                ctx = kv_cache[plan.dec_block[a : a + step], :, plan.dec_offset]  # [b, Lmax, 2, Hkv, D]
                kd = ctx[:, :, 0].transpose(1, 2)  # [b, Hkv, Lmax, D]
                vd = ctx[:, :, 1].transpose(1, 2)
                qd = q[start + a : start + a + step].unsqueeze(2)  # [b, Hq, 1, D]
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.dec_mask[a : a + step],
                                                   scale=self.scale, enable_gqa=True)
                out[start + a : start + a + o.shape[0]] = o.squeeze(2)
        return out
