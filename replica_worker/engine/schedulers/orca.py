"""Orca baseline: iteration-level batching of whole prefills with decodes.

Every step decodes all running sequences and adds whole prompts of waiting
ones while the token budget and seats allow. Blocks for a sequence's maximum
length are reserved at admission, so running sequences never run out of KV
(preemption remains only as a fallback if a sequence outgrows its reservation).
"""

from __future__ import annotations

from replica_worker.engine.block_manager import BlockManager, ReservingBlockManager
from replica_worker.engine.config import CacheConfig
from replica_worker.engine.schedulers.base import BaseScheduler, _Step


class OrcaScheduler(BaseScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_limit = min(self.max_model_len, self.budget)

    def _make_block_manager(self, cache_config: CacheConfig, num_blocks: int) -> BlockManager:
        return ReservingBlockManager(num_blocks, cache_config.block_size, self.max_model_len,
                                     cache_config.enable_prefix_caching, sliding_window=self.sliding_window)

    def _schedule(self, step: _Step) -> None:
        prefilling = self._schedule_decodes(step)
        self._schedule_prefills(step, prefilling, chunked=False)
        self._admit_waiting(step, chunked=False)
