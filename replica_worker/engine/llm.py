"""Offline batch generation in the ecosystem's convention:

    from replica_worker import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-folder", scheduler="sarathi", chunk_size=256)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from typing import Sequence as Seq

from common.tokenizer import load_tokenizer
from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from replica_worker.engine.core import EngineCore
from replica_worker.engine.outputs import CompletionOutput, RequestMetrics
from replica_worker.engine.sampling_params import SamplingParams

_MODEL_KEYS = {"dtype", "load_format", "max_model_len", "seed"}
_CACHE_KEYS = {"block_size", "num_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "watermark",
               "enable_prefix_caching"}
_PARALLEL_KEYS = {"tensor_parallel_size"}
_SCHEDULER_KEYS = {
    "max_num_seqs", "chunk_size", "max_num_batched_tokens", "enable_dynamic_chunking_schedule",
    "low_chunk_size", "high_chunk_size", "chunk_schedule_max_tokens", "chunk_schedule_stages",
}


def engine_config(model: str, scheduler: str = "sarathi", device: str = "cpu",
                  enable_cuda_graphs: bool = True, **kwargs) -> EngineConfig:
    """Builds an EngineConfig from flat keyword arguments (as LLM takes them)."""
    unknown = set(kwargs) - _MODEL_KEYS - _CACHE_KEYS - _SCHEDULER_KEYS - _PARALLEL_KEYS
    if unknown:
        raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
    pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys}  # noqa: E731
    return EngineConfig(
        model=ModelConfig(model=str(model), **pick(_MODEL_KEYS)),
        cache=CacheConfig(**pick(_CACHE_KEYS)),
        scheduler=SchedulerConfig(name=scheduler, **pick(_SCHEDULER_KEYS)),
        device=device,
        enable_cuda_graphs=enable_cuda_graphs,
        parallel=ParallelConfig(**pick(_PARALLEL_KEYS)),
    )


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **engine_kwargs):
        self.config = engine_config(model, **engine_kwargs)
        try:
            self.tokenizer = load_tokenizer(str(tokenizer or model))
        except (OSError, ValueError):
            if tokenizer is not None:
                raise
            self.tokenizer = None  # dummy weights without a tokenizer: token ids only
        self.engine = EngineCore(self.config, self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks (a no-op with one rank)."""
        self.engine.shutdown()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """One output per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        order, seqs = [], {}
        for prompt, p in zip(prompts, params_list):
            rid = f"offline-{next(self._ids)}"
            seqs[rid] = self.engine.add_request(rid, self._encode(prompt), p)
            order.append(rid)
        texts = {rid: [] for rid in order}
        reasons: dict[str, str] = {}
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step().deltas:
                    texts[delta.request_id].append(delta.text)
                    if delta.finish_reason:
                        reasons[delta.request_id] = delta.finish_reason
        finally:
            for rid in order:
                if rid not in reasons:
                    self.engine.abort_request(rid)
        return [
            CompletionOutput(
                request_id=rid,
                prompt_token_ids=seqs[rid].prompt_token_ids,
                token_ids=list(seqs[rid].output_token_ids),
                text="".join(texts[rid]),
                finish_reason=reasons[rid],
                metrics=RequestMetrics.of(seqs[rid]),
                num_cached_tokens=seqs[rid].num_cached_tokens,
            )
            for rid in order
        ]
