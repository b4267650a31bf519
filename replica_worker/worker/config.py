"""Replica worker settings: a frozen dataclass, from flags or QUADRIGA_* environment variables."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from replica_worker.engine.config import SCHEDULER_NAMES


@dataclass(frozen=True)
class WorkerConfig:
    # HOST:PORT of a router's gRPC port, or several, comma-separated: the worker
    # moves to the next one whenever its stream ends. A DNS name that resolves
    # to several routers (a Kubernetes Service) works too: gRPC tries each.
    router: str
    model: str                       # local Hugging Face folder
    replica_id: str
    model_name: str                  # what the router matches requests against
    device: str = "cpu"
    scheduler: str = "sarathi"
    auth_token: str = ""             # shared replica token, when the router requires one
    tls_ca_file: str = ""            # dial with TLS, trusting this CA bundle
    # Requests pulled beyond free seats, so a freed seat is refilled without a
    # round trip. Each one is bound to this replica early and may wait here
    # while another replica is idle, so the default is none.
    prefetch: int = 0
    reconnect_min_s: float = 0.2
    # Short: after a router restart its replicas should be back within a second
    # (a reconnect attempt costs next to nothing).
    reconnect_max_s: float = 1.0
    drain_timeout_s: float = 30.0    # on SIGTERM: finish running work for this long, then hand back
    metrics_port: int = 0            # Prometheus endpoint; 0: none
    threads: int = 0                 # torch CPU threads; 0: the default (engine_threads)
    # The engine steps on a thread of the worker's process instead of a process
    # of its own (engine_process.py), sharing the GIL with the gRPC side.
    engine_thread: bool = False
    engine_args: tuple[tuple[str, object], ...] = ()

    @property
    def engine_threads(self) -> int:
        """Torch CPU threads for the engine; 0 leaves torch's default (all cores).

        On an accelerator, one: the engine's host work is one Python thread, and
        with torch's default intra-op threads its steps summed 9-11% longer
        beside the worker, router and clients (benchmarks/results/gpu/serving/
        serving_h200_threads_ab.json). On the CPU the model's own matmuls need them."""
        if self.threads:
            return self.threads
        return 0 if self.device == "cpu" else 1

    @property
    def routers(self) -> list[str]:
        return [r.strip() for r in self.router.split(",") if r.strip()]

    def __post_init__(self) -> None:
        if not self.routers or any(":" not in r for r in self.routers):
            raise ValueError(f"--router must be HOST:PORT[,HOST:PORT...], got {self.router!r}")
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"--scheduler must be one of {SCHEDULER_NAMES}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port} is not a TCP port")
        if self.threads < 0:
            raise ValueError("--threads must be non-negative")
        if self.prefetch < 0 or self.drain_timeout_s < 0:
            raise ValueError("prefetch and drain timeout must be non-negative")


def _env(name: str, default=None):
    return os.environ.get(f"QUADRIGA_{name}", default)


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """Flags win over environment variables, which win over defaults."""
    p = argparse.ArgumentParser(prog="python -m replica_worker", description="Quadriga replica worker")
    p.add_argument("--router", default=_env("ROUTER_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--model", default=_env("MODEL"), required=_env("MODEL") is None)
    p.add_argument("--model-name", default=_env("MODEL_NAME"), help="default: the model folder's name")
    p.add_argument("--replica-id", default=_env("REPLICA_ID"), help="default: hostname-pid")
    p.add_argument("--device", default=_env("DEVICE", "cpu"))
    p.add_argument("--scheduler", default=_env("SCHEDULER", "sarathi"), choices=SCHEDULER_NAMES)
    p.add_argument("--chunk-size", type=int, default=int(_env("CHUNK_SIZE", 512)))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("MAX_NUM_BATCHED_TOKENS"),
                   help="token budget of a step for the unchunked schedulers (vllm, orca, ...); "
                        "default: the model's length limit")
    p.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", 128)))
    p.add_argument("--num-blocks", type=int, default=_env("NUM_BLOCKS"))
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", 16)))
    p.add_argument("--dtype", default=_env("DTYPE"), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--load-format", default=_env("LOAD_FORMAT", "auto"), choices=("auto", "dummy"))
    p.add_argument("--quantization", default=_env("QUANTIZATION", "") or None, choices=("fp8",),
                   help="fp8: decoder weights in e4m3 with per-channel scales, inputs quantized per "
                        "token (CUDA, compute capability 8.9+; emulated on the CPU). Default: none")
    p.add_argument("--async-scheduling", default=_env("ASYNC_SCHEDULING", "auto"), choices=("auto", "on", "off"),
                   help="schedule and prepare the next step while the device runs this one (auto: on "
                        "for CUDA with one rank, off on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=float(_env("GPU_MEMORY_UTILIZATION", 0.9)))
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached KV blocks of shared prefixes")
    p.add_argument("--tensor-parallel-size", type=int, default=int(_env("TENSOR_PARALLEL_SIZE", 1)),
                   help="processes (GPUs) holding one model, each a shard; this process is rank 0 and "
                        "starts the others (default 1)")
    p.add_argument("--prefetch", type=int, default=int(_env("PREFETCH", 0)),
                   help="requests to pull beyond free seats (default 0: bind only when a seat is free)")
    p.add_argument("--drain-timeout", type=float, default=float(_env("DRAIN_TIMEOUT_S", 30)))
    p.add_argument("--tls-ca-file", default=_env("TLS_CA_FILE", ""))
    p.add_argument("--metrics-port", type=int, default=int(_env("REPLICA_METRICS_PORT", 0)))
    p.add_argument("--threads", type=int, default=int(_env("TORCH_THREADS", 0)),
                   help="torch CPU threads (default: all cores on the CPU, 1 on an accelerator); give "
                        "each of N CPU replicas on one machine cores/N so they do not oversubscribe it")
    p.add_argument("--engine-thread", action="store_true", default=_env("ENGINE_THREAD", "") not in ("", "0"),
                   help="step the engine on a thread of this process, not in a process of its own "
                        "(which keeps detokenizing and the router stream off the engine's GIL)")
    a = p.parse_args(argv)
    engine_args = {
        "chunk_size": a.chunk_size,
        "max_num_seqs": a.max_num_seqs,
        "block_size": a.block_size,
        "load_format": a.load_format,
        "quantization": a.quantization,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "enable_prefix_caching": not a.no_prefix_caching,
        "tensor_parallel_size": a.tensor_parallel_size,
        "dtype": a.dtype or ("float32" if a.device == "cpu" else "bfloat16"),
        "async_scheduling": {"auto": None, "on": True, "off": False}[a.async_scheduling],
    }
    if a.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = int(a.max_num_batched_tokens)
    if a.num_blocks is not None:
        engine_args["num_blocks"] = int(a.num_blocks)
    return WorkerConfig(
        router=a.router,
        model=a.model,
        replica_id=a.replica_id or f"{socket.gethostname()}-{os.getpid()}",
        model_name=a.model_name or os.path.basename(os.path.normpath(a.model)),
        device=a.device,
        scheduler=a.scheduler,
        # Secrets only from the environment, never from argv (visible in ps).
        auth_token=_env("REPLICA_TOKEN", ""),
        tls_ca_file=a.tls_ca_file,
        prefetch=a.prefetch,
        drain_timeout_s=a.drain_timeout,
        metrics_port=a.metrics_port,
        threads=a.threads,
        engine_thread=a.engine_thread,
        engine_args=tuple(sorted(engine_args.items())),
    )
