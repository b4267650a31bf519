"""Sarathi-Serve: chunked prefills piggybacked on decodes under a per-step token budget.

Each step: every running decode gets one token first (so prefills never stall
decodes, and preemption by recompute frees blocks from the tail when a decode
needs a slot); then partially prefilled running sequences continue; then
waiting sequences are admitted head-of-line, each with a chunk, while budget,
seats and blocks allow.

The optional dynamic chunk schedule shrinks a prefill's chunk in stages, from
high_chunk_size to low_chunk_size, as more of its context is computed: the
later chunks of a long prompt attend over more KV and cost more per token.
"""

from __future__ import annotations

import math

from replica_worker.engine.schedulers.base import BaseScheduler, _Step
from replica_worker.engine.sequence import Sequence


def chunk_size_schedule(low: int, high: int, stages: int) -> list[int]:
    """stages sizes from high down to low, evenly spaced, rounded to a multiple
    of min(32, low) (kernel-friendly sizes), never below 1."""
    unit = max(1, min(32, low))
    if stages == 1:
        return [max(1, round(low / unit) * unit)]
    sizes = []
    for i in range(stages):
        exact = high - (high - low) * i / (stages - 1)
        sizes.append(max(unit, round(exact / unit) * unit))
    return sizes


class SarathiScheduler(BaseScheduler):
    CHUNKS_PREFILLS = True

    def __init__(self, scheduler_config, cache_config, num_blocks: int, max_model_len: int,
                 sliding_window: int | None = None) -> None:
        cfg = scheduler_config
        # Set before the base constructor, which asks for the step budget.
        self._chunk_sizes: list[int] | None = None
        if cfg.enable_dynamic_chunking_schedule:
            assert cfg.chunk_schedule_stages > 0 and cfg.chunk_schedule_max_tokens > 0
            self._chunk_sizes = chunk_size_schedule(
                cfg.low_chunk_size, cfg.high_chunk_size, cfg.chunk_schedule_stages
            )
            self._tokens_per_stage = math.ceil(cfg.chunk_schedule_max_tokens / cfg.chunk_schedule_stages)
        super().__init__(scheduler_config, cache_config, num_blocks, max_model_len, sliding_window)

    def _step_budget(self) -> int:
        # Under the dynamic schedule a step holds at most the largest stage's chunk.
        return max(self._chunk_sizes) if self._chunk_sizes else self.config.chunk_size

    def _min_step_budget(self) -> int:
        return min(self._chunk_sizes) if self._chunk_sizes else self.budget

    def chunk_size_for(self, seq: Sequence) -> int:
        """The step size limit a prefill of seq works under, given its progress."""
        return self._chunk_size_at(seq.num_computed_tokens)

    def _chunk_size_at(self, num_computed: int) -> int:
        if self._chunk_sizes is None:
            return self.config.chunk_size
        stage = min(num_computed // self._tokens_per_stage, len(self._chunk_sizes) - 1)
        return self._chunk_sizes[stage]

    def _chunk(self, num_computed: int, num_tokens: int, step: _Step) -> int:
        # As in Sarathi-Serve, the stage's size bounds the whole step's tokens
        # once this prefill joins, not only this prefill's share.
        limit = min(self._chunk_size_at(num_computed) - step.num_tokens, step.room)
        return min(num_tokens - num_computed, limit)

    def _schedule(self, step: _Step) -> None:
        prefilling = self._schedule_decodes(step)
        self._schedule_prefills(step, prefilling, chunked=True)
        self._admit_waiting(step, chunked=True)
