"""Settings of a process of simulated replicas: a frozen dataclass, from flags
(the worker's engine flags where they mean the same) or QUADRIGA_* variables."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from common.tokenizer import read_model_config
from replica_worker.engine.config import SCHEDULER_NAMES
from replica_worker.sim.cost_model import PROFILES_PATH
from replica_worker.worker.config import WorkerConfig


@dataclass(frozen=True)
class SimConfig:
    router: str
    replica_id: str                  # with K > 1 replicas, each is replica_id-0 .. replica_id-(K-1)
    profile: str = "h200-8b"
    profiles_file: str = str(PROFILES_PATH)
    replicas_per_process: int = 1
    model_name: str = ""             # Register.model; empty: not stated (the router accepts it)
    vocab_size: int | None = None    # None: the profile's
    max_model_len: int | None = None
    eos_token_id: int | None = None  # None: no token ends a request by itself
    scheduler: str = "sarathi"
    time_scale: float = 1.0          # multiplies every modelled step time
    shared_device: str = ""          # file of a device shared with other replicas; "": its own
    async_scheduling: bool = False   # model the overlap of host work and device (runner.py)
    prefetch: int = 0
    drain_timeout_s: float = 30.0
    metrics_port: int = 0            # replica i serves on metrics_port + i; 0: none
    auth_token: str = ""
    tls_ca_file: str = ""
    engine_args: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas_per_process < 1:
            raise ValueError("--replicas-per-process must be at least 1")
        if self.time_scale < 0:
            raise ValueError("--time-scale must be non-negative")
        if not (0 <= self.metrics_port and self.metrics_port + self.replicas_per_process <= 65536):
            raise ValueError(f"--metrics-port {self.metrics_port} leaves no room for every replica's port")
        self.worker_config(0)  # the worker's own checks: router address, scheduler name, ...

    def replica_ids(self) -> list[str]:
        if self.replicas_per_process == 1:
            return [self.replica_id]
        return [f"{self.replica_id}-{i}" for i in range(self.replicas_per_process)]

    def worker_config(self, index: int) -> WorkerConfig:
        """Replica `index`'s worker settings: its identity and metrics port, the rest shared."""
        return WorkerConfig(
            router=self.router, model=f"simulated:{self.profile}", replica_id=self.replica_ids()[index],
            model_name=self.model_name, scheduler=self.scheduler, auth_token=self.auth_token,
            tls_ca_file=self.tls_ca_file, prefetch=self.prefetch, drain_timeout_s=self.drain_timeout_s,
            metrics_port=self.metrics_port + index if self.metrics_port else 0,
            engine_args=self.engine_args)


def _env(name: str, default=None):
    return os.environ.get(f"QUADRIGA_{name}", default)


def _model_facts(model: str | None) -> dict:
    """What a model folder's config.json says: served name, vocabulary, length limit, EOS."""
    if not model:
        return {}
    config = read_model_config(model)
    eos = config.get("eos_token_id")
    return {"model_name": Path(model).resolve().name, "vocab_size": int(config["vocab_size"]),
            "max_model_len": config.get("max_position_embeddings"),
            "eos_token_id": eos if isinstance(eos, int) else None}


def parse_args(argv: list[str] | None = None) -> SimConfig:
    p = argparse.ArgumentParser(prog="python -m replica_worker.sim",
                                description="simulated replicas: the real worker and scheduler, a modelled step time")
    p.add_argument("--router", default=_env("ROUTER_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--replica-id", default=_env("REPLICA_ID"), help="default: hostname-pid")
    p.add_argument("--profile", default=_env("SIM_PROFILE", "h200-8b"), help="cost model profile name")
    p.add_argument("--profiles-file", default=str(PROFILES_PATH))
    p.add_argument("--replicas-per-process", "-k", type=int, default=1)
    p.add_argument("--model", default=_env("MODEL"),
                   help="model folder whose config.json gives the served name, vocabulary, length limit and EOS")
    p.add_argument("--model-name", help="default: the --model folder's name, else none stated")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--scheduler", default=_env("SCHEDULER", "sarathi"), choices=SCHEDULER_NAMES)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--num-blocks", type=int, help="default: the profile's KV blocks")
    p.add_argument("--block-size", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies modelled step times")
    p.add_argument("--shared-device", default=_env("SIM_SHARED_DEVICE", ""), metavar="FILE",
                   help="replicas naming one file share one modelled device: while n of them are in a "
                        "step, each advances at 1/n, as processes time-share one GPU (default: a device each)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="model async scheduling, the CUDA engine's default: a step's host work overlaps "
                        "the previous step on the device (default: host work and step in sequence)")
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--metrics-port", type=int, default=0, help="first replica's Prometheus port; 0: none")
    p.add_argument("--tls-ca-file", default=_env("TLS_CA_FILE", ""))
    a = p.parse_args(argv)
    facts = _model_facts(a.model)
    engine_args = {"chunk_size": a.chunk_size, "max_num_seqs": a.max_num_seqs,
                   "enable_prefix_caching": not a.no_prefix_caching}
    for key in ("max_num_batched_tokens", "num_blocks", "block_size"):
        if getattr(a, key) is not None:
            engine_args[key] = getattr(a, key)
    return SimConfig(
        router=a.router,
        replica_id=a.replica_id or f"sim-{socket.gethostname()}-{os.getpid()}",
        profile=a.profile, profiles_file=a.profiles_file, replicas_per_process=a.replicas_per_process,
        model_name=a.model_name or facts.get("model_name", ""),
        vocab_size=a.vocab_size or facts.get("vocab_size"),
        max_model_len=a.max_model_len or facts.get("max_model_len"),
        eos_token_id=facts.get("eos_token_id"),
        scheduler=a.scheduler, time_scale=a.time_scale, shared_device=a.shared_device,
        async_scheduling=a.async_scheduling,
        prefetch=a.prefetch,
        drain_timeout_s=a.drain_timeout, metrics_port=a.metrics_port,
        auth_token=_env("REPLICA_TOKEN", ""),  # secrets from the environment only (argv shows in ps)
        tls_ca_file=a.tls_ca_file, engine_args=tuple(sorted(engine_args.items())),
    )
