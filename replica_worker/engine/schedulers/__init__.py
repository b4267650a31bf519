"""Replica schedulers behind one interface, picked by SchedulerConfig.name."""

from __future__ import annotations

from replica_worker.engine.config import CacheConfig, SchedulerConfig
from replica_worker.engine.schedulers.base import (
    AdmissionCapacity,
    BaseScheduler,
    ScheduledChunk,
    SchedulerOutput,
)
from replica_worker.engine.schedulers.faster_transformer import FasterTransformerScheduler
from replica_worker.engine.schedulers.orca import OrcaScheduler
from replica_worker.engine.schedulers.sarathi import SarathiScheduler
from replica_worker.engine.schedulers.simple_chunking import SimpleChunkingScheduler
from replica_worker.engine.schedulers.vllm import VllmScheduler

SCHEDULERS: dict[str, type[BaseScheduler]] = {
    "sarathi": SarathiScheduler,
    "vllm": VllmScheduler,
    "orca": OrcaScheduler,
    "faster_transformer": FasterTransformerScheduler,
    "simple_chunking": SimpleChunkingScheduler,
}


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    max_model_len: int,
    sliding_window: int | None = None,
) -> BaseScheduler:
    try:
        cls = SCHEDULERS[scheduler_config.name]
    except KeyError:
        raise ValueError(f"unknown scheduler {scheduler_config.name!r}; known: {sorted(SCHEDULERS)}") from None
    return cls(scheduler_config, cache_config, num_blocks, max_model_len, sliding_window)


__all__ = [
    "AdmissionCapacity",
    "BaseScheduler",
    "ScheduledChunk",
    "SchedulerOutput",
    "SCHEDULERS",
    "make_scheduler",
]
