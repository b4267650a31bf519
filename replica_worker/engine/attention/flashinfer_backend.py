"""FlashInfer paged attention over the shared KV cache (CUDA, fp16/bf16).

Per step, prepare() plans once: the prefill wrapper for the prefill chunks'
queries (causal, against each chunk's cached context plus itself) and the
decode wrapper for the one-token chunks. Every layer then only writes its
k, v (two index_copy_ launches into a flat view of the cache) and calls run().
Plans take the host copies of the indptr arrays, so planning never waits on
the device.

The decode wrapper uses flashinfer's fa2 kernels with tensor cores (GQA
groups of 4+ fill them): on the H200, with Llama-3.1-8B's heads, they beat the
CUDA-core decode kernel at every batch from 1 to 256 at contexts 1024 and 4096
(10.5 against 11.0 us a call at batch 1, 270 against 400 at 256;
benchmarks/results/gpu/decode_attention_h200.json). The prefill wrapper uses fa3 on Hopper (compute
capability 9.0) and fa2 elsewhere: on the H200, fa3 took 2048-token prompts
from 75.5% to 77.8% of the matmul rate and 8192-token ones from 70.0% to
76.2% (benchmarks/results/gpu/async_stream_fa{2,3}_h200.json).
QUADRIGA_FLASHINFER_PREFILL=fa2|fa3 overrides the choice. A fresh machine
compiles one module per (kernels, dtype, head_dim) on first use.

CUDA graphs: make_graph_decode() builds a decode wrapper on fixed-size
buffers for one batch size; plan_graph_decode() refreshes it before each
replay; graph_step() computes the write indices inside the captured region.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from replica_worker.engine.attention.backend import AttentionBackend
from replica_worker.engine.attention.metadata import AttentionMetadata

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 256 << 20
_KERNELS = "fa2"


def prefill_kernels(device: torch.device) -> str:
    """fa3 on Hopper, else fa2, unless QUADRIGA_FLASHINFER_PREFILL names one."""
    chosen = os.environ.get("QUADRIGA_FLASHINFER_PREFILL", "auto")
    if chosen not in ("auto", "fa2", "fa3"):
        raise ValueError(f"QUADRIGA_FLASHINFER_PREFILL must be auto, fa2 or fa3, not {chosen!r}")
    if chosen == "auto":
        return "fa3" if torch.cuda.get_device_capability(device) == (9, 0) else "fa2"
    return chosen


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def flashinfer_supports(dtype: torch.dtype | None, head_dim: int | None) -> str | None:
    """None when flashinfer can serve this model, else the reason it cannot. Any
    sliding window is served (window_left; tests/engine/test_sliding_window_cuda.py)."""
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"flashinfer has no {dtype} kernels (float16/bfloat16 only)"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return f"flashinfer supports head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}"
    if not flashinfer_importable():
        return "flashinfer is not importable"
    return None


@dataclass
class _Step:
    k_index: torch.Tensor  # [T] row of each new token's K in the flat cache view
    v_index: torch.Tensor  # [T]
    num_prefill_tokens: int
    prefill: Any | None  # planned wrapper for tokens [:num_prefill_tokens]
    decode: Any | None  # planned wrapper for tokens [num_prefill_tokens:]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        reason = flashinfer_supports(dtype, head_dim)
        if reason:
            raise ValueError(reason)
        # A query at position p sees keys p - window_left .. p: a window of W tokens
        # (keys > p - W, as transformers masks) is window_left W - 1; -1 is no window.
        # A windowed model builds kernels of its own (a template flag) on first use.
        self.window_left = self.sliding_window - 1 if self.sliding_window else -1
        import flashinfer

        self._fi = flashinfer
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeroed before first use, as flashinfer asks; shared by every wrapper
        # (they run one after another on one stream).
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_kernels = prefill_kernels(self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_kernels)
        self.decode_wrapper = self._decode_wrapper()
        # plan() fills the wrapper's pinned int workspace on the host, then
        # cudaMemcpyAsync's it to the device; the next plan() of the same
        # wrapper must not rewrite it before that copy has run.
        self._plan_done: dict[int, torch.cuda.Event] = {}

    def _decode_wrapper(self, **graph_buffers):
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend=_KERNELS,
            use_cuda_graph=bool(graph_buffers), **graph_buffers,
        )

    # ---- per step ----
    def _write_indices(self, slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Flat view [num_blocks * 2 * block_size, H, D]: block b, K/V j, offset o
        # sits at row (2b + j) * block_size + o.
        k_index = (slot_mapping // block_size) * (2 * block_size) + slot_mapping % block_size
        return k_index, k_index + block_size

    def _plan(self, wrapper, *args, **kwargs) -> None:
        done = self._plan_done.get(id(wrapper))
        if done is not None:
            done.synchronize()  # usually already complete: free
        wrapper.plan(*args, **kwargs)
        done = self._plan_done.setdefault(id(wrapper), torch.cuda.Event())
        done.record()

    def _plan_decode(self, wrapper, indptr_host, indices, last_page_len_host, block_size) -> None:
        self._plan(wrapper,
            indptr_host, indices, last_page_len_host,
            self.num_heads, self.num_kv_heads, self.head_dim, block_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
            window_left=self.window_left,
        )

    def prepare(self, md: AttentionMetadata) -> None:
        bs, p = md.block_size, md.num_prefills
        kv_indptr = md.paged_kv_indptr_host
        nnz_prefill = int(kv_indptr[p])
        prefill = decode = None
        if p:
            self._plan(
                self.prefill_wrapper,
                md.query_start_loc_host[: p + 1], kv_indptr[: p + 1], md.paged_kv_indices[:nnz_prefill],
                md.paged_kv_last_page_len_host[:p],
                self.num_heads, self.num_kv_heads, self.head_dim, bs,
                causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
                window_left=self.window_left,
            )
            prefill = self.prefill_wrapper
        if md.num_decodes:
            self._plan_decode(
                self.decode_wrapper, kv_indptr[p:] - nnz_prefill, md.paged_kv_indices[nnz_prefill:],
                md.paged_kv_last_page_len_host[p:], bs,
            )
            decode = self.decode_wrapper
        k_index, v_index = self._write_indices(md.slot_mapping, bs)
        md.backend_data = _Step(k_index, v_index, md.num_prefill_tokens, prefill, decode)

    # ---- CUDA graphs (decode-only steps) ----
    def make_graph_decode(self, indptr_buf: torch.Tensor, indices_buf: torch.Tensor, last_page_len_buf: torch.Tensor):
        """A decode wrapper for batch len(last_page_len_buf) on fixed buffers."""
        return self._decode_wrapper(
            paged_kv_indptr_buffer=indptr_buf,
            paged_kv_indices_buffer=indices_buf,
            paged_kv_last_page_len_buffer=last_page_len_buf,
        )

    def plan_graph_decode(self, wrapper, md: AttentionMetadata) -> None:
        """Outside the graph, before each replay: md is the padded decode-only step."""
        self._plan_decode(
            wrapper, md.paged_kv_indptr_host, md.paged_kv_indices, md.paged_kv_last_page_len_host, md.block_size
        )

    def graph_step(self, wrapper, slot_mapping: torch.Tensor, block_size: int) -> _Step:
        """Inside the captured region: the step's write indices from the static slots."""
        k_index, v_index = self._write_indices(slot_mapping, block_size)
        return _Step(k_index, v_index, 0, None, wrapper)

    # ---- per layer ----
    @staticmethod
    def _step(md: AttentionMetadata) -> _Step:
        if not isinstance(md.backend_data, _Step):
            raise RuntimeError("FlashInferBackend.prepare(metadata) was not called for this step")
        return md.backend_data

    def kv_store_rows(self, kv_cache, md):
        step = self._step(md)
        return kv_cache.view(-1, self.num_kv_heads, self.head_dim), step.k_index, step.v_index

    def write_kv(self, kv_cache, k, v, md):
        step = self._step(md)
        flat = kv_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(0, step.k_index, k)
        flat.index_copy_(0, step.v_index, v)

    def attend(self, q, k, v, kv_cache, md):
        step = self._step(md)
        out = torch.empty_like(q)
        n = step.num_prefill_tokens
        if step.prefill is not None:
            step.prefill.run(q[:n], kv_cache, out=out[:n])
        if step.decode is not None:
            step.decode.run(q[n:], kv_cache, out=out[n:])
        return out
