"""Plain-torch paged attention: the CPU backend and the reference for others.

Prefill chunks run one scaled_dot_product_attention each against their
gathered context; all decodes run as one padded, masked batch. Every index
tensor and mask is built once per step in prepare(), not per layer. A sliding
window only narrows the masks: the cache keeps every position.
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


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
            else:
                ctx = kv_cache[p.ctx_block, :, p.ctx_offset]  # [L, 2, Hkv, D]
                ki = ctx[:, 0].transpose(0, 1).unsqueeze(0)
                vi = ctx[:, 1].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, scale=self.scale, enable_gqa=True)
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        if plan.dec_block is not None:
            start = md.num_prefill_tokens
            ctx = kv_cache[plan.dec_block, :, plan.dec_offset]  # [B, Lmax, 2, Hkv, D]
            kd = ctx[:, :, 0].transpose(1, 2)  # [B, Hkv, Lmax, D]
            vd = ctx[:, :, 1].transpose(1, 2)
            qd = q[start:].unsqueeze(2)  # [B, Hq, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.dec_mask, scale=self.scale, enable_gqa=True)
            out[start:] = o.squeeze(2)
        return out
