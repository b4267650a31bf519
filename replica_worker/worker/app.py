"""Builds a ReplicaWorker from its config: engine, tokenizer, advertised capacity."""

from __future__ import annotations

import logging

from common.pb.quadriga.v1 import replica_pb2 as pb
from common.tokenizer import load_tokenizer
from replica_worker.engine.core import EngineCore
from replica_worker.engine.llm import engine_config
from replica_worker.worker.client import ReplicaWorker
from replica_worker.worker.config import WorkerConfig

log = logging.getLogger(__name__)


def build_worker(config: WorkerConfig) -> ReplicaWorker:
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    engine_cfg = engine_config(
        config.model, scheduler=config.scheduler, device=config.device, **dict(config.engine_args)
    )
    engine = EngineCore(engine_cfg, load_tokenizer(config.model))
    # Under tensor parallelism this process is rank 0 (EngineCore started the other
    # ranks): it alone talks to the router, as one replica with the ranks' KV blocks.
    log.info("engine ready: %s on %s, %d KV blocks, scheduler %s, tensor parallel %d",
             config.model_name, config.device, engine.runner.num_blocks, engine_cfg.scheduler.name,
             engine_cfg.parallel.tensor_parallel_size)
    return worker_for(config, engine)


def worker_for(config: WorkerConfig, engine: EngineCore) -> ReplicaWorker:
    """A worker around a ready engine (a real one, or replica_worker/sim's), advertising its capacity."""
    sched = engine.config.scheduler
    capacity = pb.ReplicaCapacity(
        max_num_seqs=sched.max_num_seqs,
        num_kv_blocks=engine.runner.num_blocks,
        block_size=engine.config.cache.block_size,
        max_batch_tokens=sched.chunk_size,
        max_model_len=engine.max_model_len,
        prefetch=config.prefetch,
    )
    return ReplicaWorker(config, engine, capacity)
