"""Paged attention for the CPU, over a head-major cache.

Each layer's cache is [2, num_kv_heads, num_blocks, block_size, head_dim]
(kv_cache.HEAD_MAJOR). Gathering a sequence's blocks along dim 2 copies whole
blocks, and the result is already [2, heads, context, head_dim]: for a batch
of decodes the gathered rows view as [batch, heads, context, head_dim] with
no further copy. The NHD layout the torch backend shares with flashinfer
needs a per-position gather and a transpose instead, which on two cores was
a third of a batch-64 decode step (benchmarks/engine/cpu_vs_transformers.py).

The math is the torch backend's, on the same values; only decodes group
their query heads differently, which moves results by rounding alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica_worker.engine.attention.backend import AttentionBackend
from replica_worker.engine.attention.metadata import AttentionMetadata
from replica_worker.engine.attention.torch_backend import causal_mask, decode_mask
from replica_worker.engine.kv_cache import HEAD_MAJOR


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    # None when the chunk is its whole context: attend to the new k, v directly.
    ctx_blocks: torch.Tensor | None  # [num_blocks] the sequence's blocks, in order
    ctx_len: int
    mask: torch.Tensor | None  # [Q, L] bool, True = attend; None = plain causal


@dataclass
class _CpuPlan:
    prefills: list[_Prefill]
    dec_blocks: torch.Tensor | None  # [D * max_blocks] block table rows of the decodes, flattened
    dec_shape: tuple[int, int] | None  # (D, max_blocks * block_size)
    dec_mask: torch.Tensor | None  # [D, 1, 1, Lmax]


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    kv_layout = HEAD_MAJOR

    def prepare(self, md: AttentionMetadata) -> None:
        bs = md.block_size
        qsl = md.query_start_loc_host.tolist()
        nc = md.num_computed_host.tolist()
        lens = md.seq_lens_host.tolist()
        window = self.sliding_window
        prefills = []
        for i in range(md.num_prefills):
            windowed = window is not None and lens[i] > window
            mask = causal_mask(nc[i], lens[i], window, "cpu") if nc[i] or windowed else None
            blocks = md.block_tables[i, : -(-lens[i] // bs)].long() if nc[i] else None
            prefills.append(_Prefill(qsl[i], qsl[i + 1], blocks, lens[i], mask))
        dec_blocks = dec_shape = dec_mask = None
        if md.num_decodes:
            max_blocks = -(-max(lens[md.num_prefills:]) // bs)
            # Rows are padded with block 0: the mask hides whatever it holds.
            dec_blocks = md.block_tables[md.num_prefills:, :max_blocks].reshape(-1).long()
            dec_shape = (md.num_decodes, max_blocks * bs)
            dec_mask = decode_mask(md.seq_lens[md.num_prefills:], max_blocks * bs, window)
        md.backend_data = _CpuPlan(prefills, dec_blocks, dec_shape, dec_mask)

    @staticmethod
    def _plan(md: AttentionMetadata) -> _CpuPlan:
        if md.backend_data is None:
            raise RuntimeError("CpuAttentionBackend.prepare(metadata) was not called for this step")
        return md.backend_data

    def write_kv(self, kv_cache, k, v, md):
        two, heads, blocks, bs, dim = kv_cache.shape
        slots = kv_cache.view(two, heads, blocks * bs, dim)
        slots.index_copy_(2, md.slot_mapping, torch.stack((k, v)).transpose(1, 2))

    def attend(self, q, k, v, kv_cache, md):
        plan = self._plan(md)
        two, heads, _, bs, dim = kv_cache.shape
        out = torch.empty_like(q)
        for p in plan.prefills:
            qi = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
            if p.ctx_blocks is None:
                ki = k[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
                vi = v[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
            else:
                ctx = kv_cache.index_select(2, p.ctx_blocks).view(two, heads, -1, dim)[:, :, : p.ctx_len]
                ki, vi = ctx[0].unsqueeze(0), ctx[1].unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, is_causal=p.mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        if plan.dec_blocks is not None:
            start = md.num_prefill_tokens
            num_decodes, ctx_len = plan.dec_shape
            ctx = kv_cache.index_select(2, plan.dec_blocks).view(two, heads, num_decodes, ctx_len, dim)
            ctx = ctx.transpose(1, 2)  # [2, D, Hkv, Lmax, dim], a view
            # The query heads that share a KV head ride as that head's query rows,
            # all seeing the same keys: one pass over each KV head, not one per
            # query head (a fifth less time than enable_gqa at batch 64 on two cores).
            group = self.num_heads // self.num_kv_heads
            qd = q[start:].view(num_decodes, self.num_kv_heads, group, dim)
            o = F.scaled_dot_product_attention(qd, ctx[0], ctx[1], attn_mask=plan.dec_mask, scale=self.scale)
            out[start:] = o.view(num_decodes, self.num_heads, dim)
        return out
