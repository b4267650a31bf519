"""Runs one engine step: flatten the scheduled chunks, run the model, sample.

Contract with the scheduler: a chunk (seq, num_tokens) computes tokens
[seq.num_computed_tokens, + num_tokens) of seq.token_ids at those positions,
into blocks seq.block_ids that already cover them. The KV cache holds tokens
[0, num_computed_tokens). A chunk that reaches the last known token samples
one token. The runner never modifies sequences; the engine advances them.

Host work per step: one pass over the chunks to build the inputs and the
attention metadata, and one device-to-host sync (the sampled ids, with any
logprobs). Nothing host-side runs per layer except inside the plain torch
backend. The sampling rows are the sequences themselves: the sampler reads
their settings and output index, and their token lists only when it builds
a penalty row's counts (sampler.py, penalty_state.py).

On CUDA the attention backend is flashinfer where it can serve the model
(see attention.select_backend), and decode-only steps of up to max_num_seqs
sequences replay CUDA graphs captured at start-up (cuda_graph.DecodeGraphs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from replica_worker.engine.attention import AttentionMetadata, build_attention_metadata, select_backend
from replica_worker.engine.config import EngineConfig
from replica_worker.engine.kv_cache import KVCache, bytes_per_block, determine_num_blocks
from replica_worker.engine.model import DTYPES, get_model, load_hf_config, sliding_window_of
from replica_worker.engine.sampler import Sampler, SampledBatch, SamplerOutput
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class ChunkLike(Protocol):
    seq: Sequence
    num_tokens: int


@dataclass
class _Chunk:
    seq: Sequence
    num_tokens: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows that sample, in chunk order
    sampling_rows: list[Sequence]


def _samples(chunk: ChunkLike) -> bool:
    return chunk.seq.num_computed_tokens + chunk.num_tokens == chunk.seq.num_tokens


def eos_id_list(eos: int | list[int] | None) -> list[int]:
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [t for t in eos if isinstance(t, int)]


def _read_eos(model_dir: str, hf_config) -> int | list[int] | None:
    """generation_config.json wins (as in transformers' generate); else config.json."""
    import json
    from pathlib import Path

    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return eos
    return getattr(hf_config, "eos_token_id", None)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model
        self.hf_config = load_hf_config(mc.model)
        max_pos = self.hf_config.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's max_position_embeddings {max_pos}")
        self.max_model_len: int = mc.max_model_len or max_pos
        self.dtype = DTYPES[mc.dtype]
        self.eos_token_id = _read_eos(mc.model, self.hf_config)

        t0 = time.perf_counter()
        n_heads = self.hf_config.num_attention_heads
        head_dim = getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // n_heads
        n_kv = getattr(self.hf_config, "num_key_value_heads", None) or n_heads
        self.sliding_window = sliding_window_of(self.hf_config, self.max_model_len)
        backend_cls = select_backend(self.device, self.dtype, head_dim, self.sliding_window)
        extra = {"dtype": self.dtype, "device": self.device} if backend_cls.name == "flashinfer" else {}
        self.backend = backend_cls(n_heads, n_kv, head_dim, sliding_window=self.sliding_window, **extra)
        self.model = get_model(mc, self.backend, self.device, self.max_model_len, self.hf_config)
        self._sync()
        t1 = time.perf_counter()
        self.vocab_size: int = self.model.shape.vocab_size
        self.sampler = Sampler(self.device, seed=mc.seed, eos_token_ids=eos_id_list(self.eos_token_id))

        self.block_size = config.cache.block_size
        num_layers = self.model.shape.num_layers
        block_bytes = bytes_per_block(num_layers, self.block_size, n_kv, head_dim, self.dtype)
        use_graphs = config.enable_cuda_graphs and self.device.type == "cuda" and self.backend.supports_cuda_graphs
        num_blocks = determine_num_blocks(config.cache, block_bytes, self.device, self._profile_run)
        if use_graphs and config.cache.num_blocks is None:
            num_blocks -= 1  # room for the scratch block
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(num_layers, self.num_blocks, self.block_size, n_kv, head_dim, self.dtype, self.device,
                                scratch_blocks=1 if use_graphs else 0)
        self.bytes_per_block = block_bytes
        self._sync()
        t2 = time.perf_counter()
        self.graphs = None
        if use_graphs:
            from replica_worker.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.scheduler.max_num_seqs)
        t3 = time.perf_counter()
        # Start-up phases in seconds (weights, KV sizing + allocation, graph capture).
        self.startup_seconds = {"weights": t1 - t0, "kv_cache": t2 - t1, "cuda_graphs": t3 - t2}
        logger.info("runner ready: backend %s, %d KV blocks, start-up %s", self.backend.name, self.num_blocks,
                    {k: round(v, 2) for k, v in self.startup_seconds.items()})

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- sampler state the engine owns ----
    def set_eos_token_ids(self, ids) -> None:
        """The EOS ids that min_tokens keeps from being sampled."""
        self.sampler.set_eos_token_ids(ids)

    def release(self, seq: Sequence) -> None:
        """seq has left the engine (finished or aborted)."""
        self.sampler.release(seq)

    # ---- one step ----
    def execute(self, chunks: list[ChunkLike]) -> SamplerOutput:
        """Sampled token ids (and logprobs), one per chunk that samples, in chunk order."""
        if not chunks:
            return SamplerOutput([])
        if self.graphs is not None and len(chunks) <= self.graphs.max_batch and all(c.num_tokens == 1 for c in chunks):
            sampling = [i for i, c in enumerate(chunks) if _samples(c)]
            return self.graphs.execute(chunks, sampling, [chunks[i].seq for i in sampling])
        inputs = self.prepare_inputs(chunks)
        with torch.inference_mode():
            sampled = self._run(inputs, self.kv_cache.layers)
            return SamplerOutput([]) if sampled is None else sampled.to_host()  # the step's one host sync

    def _run(self, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> SampledBatch | None:
        self.backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)
        if not inputs.sampling_rows:
            return None
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return self.sampler(logits, inputs.sampling_rows)

    def prepare_inputs(self, chunks: list[ChunkLike]) -> StepInputs:
        # Prefills (chunks of more than one token) first, then decodes, as the
        # backends want; samples keep the caller's chunk order via logits_indices.
        order = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        num_prefills = len(order)
        order += [i for i, c in enumerate(chunks) if c.num_tokens <= 1]
        ordered = [chunks[i] for i in order]
        for c in ordered:
            if c.num_tokens < 1 or c.seq.num_computed_tokens + c.num_tokens > c.seq.num_tokens:
                raise ValueError(f"bad chunk of {c.num_tokens} tokens for {c.seq!r}")
            if c.seq.num_computed_tokens + c.num_tokens > self.max_model_len:
                raise ValueError(f"{c.seq!r} exceeds max_model_len {self.max_model_len}")
        token_ids: list[int] = []
        qsl = [0]
        for c in ordered:
            start = c.seq.num_computed_tokens
            token_ids.extend(c.seq.token_ids[start : start + c.num_tokens])
            qsl.append(len(token_ids))
        row_of = {idx: qsl[k + 1] - 1 for k, idx in enumerate(order)}  # last token of each chunk
        sampling = [i for i, c in enumerate(chunks) if _samples(c)]
        md, positions, (input_ids, logits_indices) = build_attention_metadata(
            [c.seq.num_computed_tokens for c in ordered],
            [c.num_tokens for c in ordered],
            [c.seq.block_ids for c in ordered],
            num_prefills,
            self.block_size,
            self.device,
            extra=(np.asarray(token_ids, dtype=np.int64), np.asarray([row_of[i] for i in sampling], dtype=np.int64)),
        )
        return StepInputs(input_ids, positions, md, logits_indices, [chunks[i].seq for i in sampling])

    # ---- KV cache sizing on CUDA ----
    def _profile_run(self) -> None:
        """One forward of the largest step the scheduler may send, against a
        throwaway cache, so the peak activation memory is counted before sizing."""
        sc = self.config.scheduler
        budget = max(sc.chunk_size, sc.max_num_batched_tokens or 0)
        num_tokens = min(budget, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        s = self.model.shape
        tmp = KVCache(s.num_layers, blocks, self.block_size, s.num_kv_heads, s.head_dim, self.dtype, self.device)
        seq = Sequence("profile", [0] * num_tokens, SamplingParams(temperature=0.0))
        seq.block_ids = list(range(blocks))
        with torch.inference_mode():
            self._run(self.prepare_inputs([_Chunk(seq, num_tokens)]), tmp.layers)
        del tmp
