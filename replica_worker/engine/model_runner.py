"""Runs one engine step: flatten the scheduled chunks, run the model, sample.

Contract with the scheduler: a chunk (seq, num_tokens) computes tokens
[seq.num_computed_tokens, + num_tokens) of seq.token_ids at those positions,
into blocks seq.block_ids that already cover them. The KV cache holds tokens
[0, num_computed_tokens). A chunk that reaches the last known token samples
one token. The runner never modifies sequences; the engine advances them.

Host work per step: one pass over the chunks to build the inputs and the
attention metadata, and one device-to-host copy (the sampled ids, with any
logprobs), which launch() starts without waiting for it: the engine may
queue the next step first (core.py), its placeholders filled on the device. Nothing host-side runs per layer except inside the plain torch
backend. The sampling rows are the sequences themselves: the sampler reads
their settings and output index, and their token lists only when it builds
a penalty row's counts (sampler.py, penalty_state.py).

On CUDA the attention backend is flashinfer where it can serve the model
(see attention.select_backend), and decode-only steps of up to max_num_seqs
sequences replay CUDA graphs captured at start-up (cuda_graph.DecodeGraphs).

Tensor parallelism (a RankContext): every rank has a runner with its shard of the
model and its heads' KV cache, the same block ids on every rank. Rank 0's execute()
publishes each step's StepBatch before running it; the other ranks call run_batch()
on what they receive, with no sampling rows: they run the forward (and its
collectives) only, and rank 0 alone samples.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from replica_worker.engine.attention import AttentionMetadata, build_attention_metadata, select_backend
from replica_worker.engine.config import EngineConfig
from replica_worker.engine.distributed.group import SINGLE_RANK, RankContext
from replica_worker.engine.host_memory import retain_freed_memory
from replica_worker.engine.kv_cache import KVCache, bytes_per_block, determine_num_blocks
from replica_worker.engine.model import DTYPES, get_model, load_hf_config, sliding_window_of
from replica_worker.engine.model.parallel import head_shard
from replica_worker.engine.sampler import Sampler, SampledBatch, SamplerOutput
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from replica_worker.engine.step_batch import Chunk, ChunkLike, StepBatch, batch_of, fill_placeholders

logger = logging.getLogger(__name__)

_Chunk = Chunk  # the name benchmarks import


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows that sample, in chunk order


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
    def __init__(self, config: EngineConfig, ranks: RankContext | None = None) -> None:
        """ranks: this process's place in a tensor-parallel engine (None: the whole model here)."""
        self.config = config
        self.ranks = ranks
        group = SINGLE_RANK if ranks is None else ranks.tensors
        self.device = torch.device(config.device if ranks is None else ranks.device)
        mc = config.model
        self.hf_config = load_hf_config(mc.model)
        max_pos = self.hf_config.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's max_position_embeddings {max_pos}")
        self.max_model_len: int = mc.max_model_len or max_pos
        self.dtype = DTYPES[mc.dtype]
        self.eos_token_id = _read_eos(mc.model, self.hf_config)

        if self.device.type == "cpu":
            retain_freed_memory()
        t0 = time.perf_counter()
        n_heads = self.hf_config.num_attention_heads
        head_dim = getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // n_heads
        heads = head_shard(n_heads, getattr(self.hf_config, "num_key_value_heads", None) or n_heads,
                           group.rank, group.size)
        n_kv = self.num_kv_heads = heads.num_kv_heads  # this rank's
        self.sliding_window = sliding_window_of(self.hf_config, self.max_model_len)
        backend_cls = select_backend(self.device, self.dtype, head_dim)
        extra = {"dtype": self.dtype, "device": self.device} if backend_cls.name == "flashinfer" else {}
        self.backend = backend_cls(heads.num_heads, n_kv, head_dim, sliding_window=self.sliding_window, **extra)
        self.model = get_model(mc, self.backend, self.device, self.max_model_len, self.hf_config, group)
        self._sync()
        t1 = time.perf_counter()
        self.vocab_size: int = self.model.shape.vocab_size
        self.sampler = Sampler(self.device, seed=mc.seed, eos_token_ids=eos_id_list(self.eos_token_id))

        self.block_size = config.cache.block_size
        num_layers = self.model.shape.num_layers
        block_bytes = bytes_per_block(num_layers, self.block_size, n_kv, head_dim, self.dtype)
        use_graphs = config.enable_cuda_graphs and self.device.type == "cuda" and self.backend.supports_cuda_graphs
        num_blocks = determine_num_blocks(config.cache, block_bytes, self.device, self._profile_run,
                                          self.max_model_len)
        if use_graphs and config.cache.num_blocks is None:
            num_blocks -= 1  # room for the scratch block
        if ranks is not None:
            num_blocks = ranks.steps.agree_min(num_blocks)  # one block id means one block on every rank
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(num_layers, self.num_blocks, self.block_size, n_kv, head_dim, self.dtype, self.device,
                                scratch_blocks=1 if use_graphs else 0, layout=self.backend.kv_layout)
        self.bytes_per_block = block_bytes
        self._sync()
        t2 = time.perf_counter()
        self.graphs = None
        if use_graphs:
            from replica_worker.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.scheduler.max_num_seqs)
        t3 = time.perf_counter()
        if self.kv_cache.scratch_block is not None:
            self._warm_up_prefills()
        t4 = time.perf_counter()
        # Start-up phases in seconds (weights, KV sizing + allocation, graph capture, prefill warm-up).
        self.startup_seconds = {"weights": t1 - t0, "kv_cache": t2 - t1, "cuda_graphs": t3 - t2,
                                "prefill_warm_up": t4 - t3}
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
        """Sampled token ids (and logprobs), one per chunk that samples, in chunk order.
        Waits for the step."""
        sampled = self.launch(chunks)
        return SamplerOutput([]) if sampled is None else sampled.to_host()

    def launch(self, chunks: list[ChunkLike], previous: SampledBatch | None = None) -> SampledBatch | None:
        """Queues the step on the device and returns its sampled batch, its copy to
        the host under way (None when no chunk samples). previous: the step still
        in flight, whose sampled ids fill this step's placeholders on the device."""
        if not chunks:
            return None
        batch, sampling = batch_of(chunks, self.max_model_len)
        seqs = [chunks[i].seq for i in sampling]
        if self.ranks is not None:
            if batch.has_placeholders:
                raise ValueError("tensor-parallel ranks receive token ids from the host: resolve placeholders first")
            self.ranks.steps.publish(batch)
        sampled = self.run_batch(batch, seqs, previous)
        return None if sampled is None else sampled.start_copy()

    def run_batch(self, batch: StepBatch, seqs: list[Sequence] | None,
                  previous: SampledBatch | None = None) -> SampledBatch | None:
        """Runs the step; seqs (the sampling rows' sequences) None on a rank other than
        0, which computes the logits, for their collective, and samples nothing."""
        fill_from = previous.token_ids_device if previous is not None and batch.has_placeholders else None
        if self.graphs is not None and batch.decode_only and batch.num_seqs <= self.graphs.max_batch:
            return self.graphs.execute(batch, seqs, fill_from)
        inputs = self.inputs_for(batch, fill_from)
        with torch.inference_mode():
            return self._run(inputs, self.kv_cache.layers, seqs)

    def _run(self, inputs: StepInputs, kv_caches: list[torch.Tensor],
             seqs: list[Sequence] | None) -> SampledBatch | None:
        self.backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)
        if inputs.logits_indices.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return None if seqs is None else self.sampler(logits, seqs)

    def prepare_inputs(self, chunks: list[ChunkLike]) -> StepInputs:
        return self.inputs_for(batch_of(chunks, self.max_model_len)[0])

    def inputs_for(self, batch: StepBatch, fill_from: torch.Tensor | None = None) -> StepInputs:
        """fill_from: the in-flight step's sampled ids, when batch has placeholders."""
        md, positions, (input_ids, logits_indices) = build_attention_metadata(
            batch.num_computed,
            batch.num_tokens,
            batch.block_ids,
            batch.num_prefills,
            self.block_size,
            self.device,
            extra=(batch.token_ids, batch.sample_rows),
        )
        if batch.has_placeholders:
            input_ids = fill_placeholders(input_ids, fill_from)
        return StepInputs(input_ids, positions, md, logits_indices)

    def _warm_up_prefills(self) -> None:
        """One eager forward at each power of two from 16 tokens up to the step budget,
        every KV slot in the scratch block. CUDA loads a kernel on its first launch, and
        flashinfer and cuBLAS pick kernels by size: without this, the first prefill of a
        process took 2.6x its later ones on the H200 (50 against 19.5 ms at 512 tokens,
        benchmarks/results/gpu/prefill_first_call_fa2_h200.json). Every rank runs the
        same forwards, so their collectives pair up."""
        sc = self.config.scheduler
        budget = min(max(sc.chunk_size, sc.max_num_batched_tokens or 0), self.max_model_len)
        sizes = sorted({*(1 << k for k in range(4, budget.bit_length()) if 1 << k < budget), budget})
        scratch = self.kv_cache.scratch_block
        with torch.inference_mode():
            for n in sizes:
                seq = Sequence("warm-up", [0] * n, SamplingParams(temperature=0.0))
                seq.block_ids = [scratch] * -(-n // self.block_size)
                self._run(self.prepare_inputs([Chunk(seq, n)]), self.kv_cache.layers, None)
        self._sync()

    # ---- KV cache sizing on CUDA ----
    def _profile_run(self) -> None:
        """One forward of the largest step the scheduler may send, against a
        throwaway cache, so the peak activation memory is counted before sizing."""
        sc = self.config.scheduler
        budget = max(sc.chunk_size, sc.max_num_batched_tokens or 0)
        num_tokens = min(budget, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        s = self.model.shape
        tmp = KVCache(s.num_layers, blocks, self.block_size, self.num_kv_heads, s.head_dim, self.dtype, self.device,
                      layout=self.backend.kv_layout)
        seq = Sequence("profile", [0] * num_tokens, SamplingParams(temperature=0.0))
        seq.block_ids = list(range(blocks))
        with torch.inference_mode():
            self._run(self.prepare_inputs([Chunk(seq, num_tokens)]), tmp.layers, [seq])
        del tmp
