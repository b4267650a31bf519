"""CUDA graphs for decode-only steps.

At start-up (after the KV cache exists) one graph is captured per batch-size
bucket, largest first, all sharing one memory pool. A graph covers the whole
step on the device: write indices, every layer, the final norm, the logits of
every row and their argmax. Its inputs are static buffers (input ids,
positions, slots) plus the backend's fixed-size decode buffers; a step copies
its inputs into them, pads the batch to the bucket (padding rows write to and
read from the cache's scratch block), re-plans the bucket's decode wrapper
and replays. The sampler takes the graph's logits and its argmax, which is
the whole answer when every row is plain greedy. The step's one device-to-host
copy, of the sampled ids (and logprobs), is the runner's (model_runner.launch).

Under tensor parallelism the graphs hold the layers' all-reduces and the logits'
all-gather (NCCL collectives are captured like kernels). Every rank captures the
same buckets in the same order at start-up and replays the same bucket each step
(rank 0's batch decides it), so each replay's collectives meet their peers'.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from replica_worker.engine.attention import build_attention_metadata
from replica_worker.engine.step_batch import fill_placeholders

if TYPE_CHECKING:
    from replica_worker.engine.model_runner import ModelRunner
    from replica_worker.engine.sampler import SampledBatch
    from replica_worker.engine.step_batch import StepBatch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def decode_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in BUCKETS if b <= max_batch]
    if not buckets or buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: object  # the backend's fixed-size decode wrapper
    logits: torch.Tensor  # [bucket, vocab] float32, written by the graph
    greedy: torch.Tensor  # [bucket] int64


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_batch: int) -> None:
        self.runner = runner
        self.backend = runner.backend
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.block_size = runner.block_size
        self.scratch = runner.kv_cache.scratch_block
        if self.scratch is None:
            raise ValueError("CUDA graphs need a KV cache with a scratch block")
        dev, n = runner.device, self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), self.scratch * self.block_size, dtype=torch.int64, device=dev)
        # Flashinfer's fixed buffers, shared by every bucket (one replay at a
        # time; each plan rewrites them). A step's pages never exceed the
        # cache's blocks plus one scratch page per padding row.
        self.kv_indptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(runner.num_blocks + n + 1, dtype=torch.int32, device=dev)
        self.kv_last_page_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0
        self.pool = None
        start = time.perf_counter()
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self.graphs[b] = self._capture(b)
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch %s) in %.2f s",
                    len(self.buckets), self.buckets, self.capture_seconds)

    # ---- capture ----
    def _padded_metadata(self, num_computed, block_ids, token_ids, bucket: int):
        pad = bucket - len(num_computed)
        md, positions, (input_ids,) = build_attention_metadata(
            list(num_computed) + [0] * pad,
            [1] * bucket,
            list(block_ids) + [[self.scratch]] * pad,
            0,
            self.block_size,
            self.runner.device,
            extra=(np.concatenate([np.asarray(token_ids, dtype=np.int64), np.zeros(pad, dtype=np.int64)]),),
        )
        return md, positions, input_ids

    def _body(self, b: int, wrapper, md):
        # md carries nothing the graph reads but backend_data (set here, from
        # the static slots); it is built before capture, as it copies to the device.
        r = self.runner
        md.backend_data = self.backend.graph_step(wrapper, self.slots[:b], self.block_size)
        hidden = r.model(self.input_ids[:b], self.positions[:b], r.kv_cache.layers, md)
        logits = r.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _capture(self, b: int) -> _Graph:
        n = self.max_batch
        wrapper = self.backend.make_graph_decode(self.kv_indptr[: b + 1], self.kv_indices, self.kv_last_page_len[:b])
        md, _, _ = self._padded_metadata([], [], [], b)
        self.backend.plan_graph_decode(wrapper, md)
        self.slots[:n].fill_(self.scratch * self.block_size)
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy init, autotuning, allocator
                self._body(b, wrapper, md)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, greedy = self._body(b, wrapper, md)
        if self.pool is None:
            self.pool = graph.pool()
        return _Graph(graph, wrapper, logits, greedy)

    # ---- replay ----
    def bucket_for(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def execute(self, batch: "StepBatch", rows: list | None,
                fill_from: torch.Tensor | None = None) -> "SampledBatch | None":
        """batch: decode-only, at most max_batch sequences; rows: the sequences of its
        sample_rows, in order; None (a rank other than 0): replay only. fill_from:
        the in-flight step's sampled ids, when batch has placeholders."""
        n = batch.num_seqs
        b = self.bucket_for(n)
        g = self.graphs[b]
        md, positions, input_ids = self._padded_metadata(batch.num_computed, batch.block_ids, batch.token_ids, b)
        with torch.inference_mode():
            if batch.has_placeholders:
                input_ids = fill_placeholders(input_ids, fill_from)
            self.input_ids[:b].copy_(input_ids)
            self.positions[:b].copy_(positions)
            self.slots[:b].copy_(md.slot_mapping)
            self.backend.plan_graph_decode(g.wrapper, md)
            g.graph.replay()
            self.replays += 1
            sampling = batch.sample_rows  # one token per sequence: row k is sequence k
            if rows is None or not len(sampling):
                return None
            logits, argmax = g.logits[:n], g.greedy[:n]
            if len(sampling) != n:
                idx = torch.from_numpy(sampling).to(logits.device)
                logits, argmax = logits[idx], argmax[idx]
            # The sampler may overwrite the graph's logits, and plain greedy returns the
            # graph's own argmax buffer: the next replay rewrites both, after (on the
            # same stream) this step's copy to the host and any placeholder fill.
            return self.runner.sampler(logits, rows, argmax=argmax)
