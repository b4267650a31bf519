"""Builds a process's simulated replicas: each a real ReplicaWorker (its own router
stream, identity, engine thread and credit) around its own SimulatedEngine."""

from __future__ import annotations

import asyncio
import logging

from replica_worker.sim.config import SimConfig
from replica_worker.sim.cost_model import Profile, load_profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.shared_device import SharedDevice
from replica_worker.worker.app import worker_for
from replica_worker.worker.client import ReplicaWorker

log = logging.getLogger(__name__)


def build_engine(config: SimConfig, profile: Profile) -> SimulatedEngine:
    kwargs = dict(config.engine_args)
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    shared = SharedDevice(config.shared_device) if config.shared_device else None
    return SimulatedEngine.from_profile(profile, config.scheduler, vocab_size=config.vocab_size,
                                        eos_token_id=config.eos_token_id, time_scale=config.time_scale,
                                        shared_device=shared, overlap=config.async_scheduling, **kwargs)


def build_workers(config: SimConfig) -> list[ReplicaWorker]:
    profile = load_profile(config.profile, config.profiles_file)
    engines = [build_engine(config, profile) for _ in config.replica_ids()]
    workers = [worker_for(config.worker_config(i), engine) for i, engine in enumerate(engines)]
    log.info("%d simulated replicas ready: profile %s, %d KV blocks of %d, scheduler %s%s",
             len(engines), profile.name, engines[0].runner.num_blocks,
             engines[0].config.cache.block_size, config.scheduler,
             (f", sharing the device of {config.shared_device}" if config.shared_device else "")
             + (", async scheduling modelled" if config.async_scheduling else ""))
    return workers


async def run_workers(workers: list[ReplicaWorker]) -> None:
    """Runs them all until each has drained (or one's registration is refused)."""
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
