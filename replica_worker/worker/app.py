"""Builds a ReplicaWorker from its config: engine (in a process of its own, or on a
thread of the worker's), tokenizer, advertised capacity."""

from __future__ import annotations

import logging

from common.pb.quadriga.v1 import replica_pb2 as pb
from common.tokenizer import load_decoder
from replica_worker.engine.config import engine_config
from replica_worker.worker.client import ReplicaWorker
from replica_worker.worker.config import WorkerConfig
from replica_worker.worker.engine_process import EngineProcess
from replica_worker.worker.engine_wire import EngineInfo

log = logging.getLogger(__name__)


def build_worker(config: WorkerConfig) -> ReplicaWorker:
    log.info("starting the engine: %s on %s", config.model_name, config.device)
    engine_cfg = engine_config(
        config.model, scheduler=config.scheduler, device=config.device, **dict(config.engine_args)
    )
    # The worker only decodes: load_decoder's tokenizer spares this process
    # transformers and torch, whose imports would double a replica's start-up CPU.
    tokenizer = load_decoder(config.model)
    if config.engine_thread:
        from replica_worker.engine.core import EngineCore

        if config.engine_threads:
            import torch

            torch.set_num_threads(config.engine_threads)
        engine = EngineCore(engine_cfg, tokenizer)
    else:
        engine = EngineProcess(engine_cfg, tokenizer, threads=config.engine_threads)
    # Under tensor parallelism the engine is rank 0 (EngineCore started the other
    # ranks): the worker alone talks to the router, as one replica with the ranks' KV blocks.
    log.info("engine ready%s: %s on %s, %d KV blocks, scheduler %s, tensor parallel %d",
             "" if config.engine_thread else f" in process {engine.pid}", config.model_name, config.device,
             _info(engine).num_kv_blocks, engine_cfg.scheduler.name, engine_cfg.parallel.tensor_parallel_size)
    return worker_for(config, engine)


def _info(engine) -> EngineInfo:
    """engine: an EngineProcess, or an EngineCore (or replica_worker/sim's) in this process."""
    return engine.info if isinstance(engine, EngineProcess) else EngineInfo.of(engine)


def worker_for(config: WorkerConfig, engine) -> ReplicaWorker:
    """A worker around a ready engine (a real one, in this process or its own, or
    replica_worker/sim's), advertising its capacity."""
    info = _info(engine)
    capacity = pb.ReplicaCapacity(
        max_num_seqs=info.max_num_seqs,
        num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size,
        max_batch_tokens=info.max_batch_tokens,
        max_model_len=info.max_model_len,
        prefetch=config.prefetch,
    )
    return ReplicaWorker(config, engine, capacity)
