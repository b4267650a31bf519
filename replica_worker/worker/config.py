"""Replica worker settings: a frozen dataclass, from flags or QUADRIGA_* environment variables."""

from __future__ import annotations

import argparse
import os
import socket
import sys
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


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise argparse.ArgumentTypeError(f"{text!r} is neither on nor off (1/0, true/false, yes/no)")
    return value in _TRUE


class _Flags:
    """Each flag's environment variable is named in --help, and its value, a
    string, goes through the flag's own type (argparse converts a string
    default), so a bad value is a usage error naming the flag; check_env checks
    what argparse does not check in a default: choices, and switches."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.env_names: list[str] = []
        self._bad_env: list[tuple[str, str]] = []   # (flag, what is wrong with its variable)

    def add(self, flag: str, env: str, default=None, help: str = "", **kw) -> None:
        self.env_names.append(f"QUADRIGA_{env}")
        value = _env(env)
        if kw.get("action") == "store_true":
            # A switch: QUADRIGA_X=on/off (1/0, true/false, yes/no); the flag turns it on.
            try:
                kw["default"] = default if value is None else _switch(value)
            except argparse.ArgumentTypeError as exc:
                self._bad_env.append((flag, f"{flag}: QUADRIGA_{env}: {exc}"))
        else:
            kw["default"] = default if value is None else value
            choices = kw.get("choices")
            if value is not None and choices:
                converted = kw.get("type", str)(value)
                if converted is not None and converted not in choices:
                    self._bad_env.append((flag, f"{flag}: QUADRIGA_{env}={value!r} is not one of "
                                                f"{', '.join(map(str, choices))}"))
        note = f"env QUADRIGA_{env}"
        self.parser.add_argument(flag, help=f"{help} ({note})" if help else note, **kw)

    def check_env(self, argv: list[str]) -> None:
        """Bad values of variables whose flag argv does not give (the flag wins)."""
        given = {arg.split("=", 1)[0] for arg in argv}
        bad = [message for flag, message in self._bad_env if flag not in given]
        if bad:
            self.parser.error("; ".join(bad))


def env_names() -> set[str]:
    """Every environment variable the worker reads, for the docs and the manifests' checks."""
    return set(_flags().env_names) | {"QUADRIGA_REPLICA_TOKEN"}


def _flags() -> _Flags:
    p = argparse.ArgumentParser(prog="python -m replica_worker", description="Quadriga replica worker")
    f = _Flags(p)
    f.add("--router", "ROUTER_ADDRESS", "127.0.0.1:50051")
    f.add("--model", "MODEL", required=_env("MODEL") is None)
    f.add("--model-name", "MODEL_NAME", help="default: the model folder's name")
    f.add("--replica-id", "REPLICA_ID", help="default: hostname-pid")
    f.add("--device", "DEVICE", "cpu")
    f.add("--scheduler", "SCHEDULER", "sarathi", choices=SCHEDULER_NAMES)
    f.add("--chunk-size", "CHUNK_SIZE", 512, type=int)
    f.add("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", type=int,
          help="token budget of a step for the unchunked schedulers (vllm, orca, ...); "
               "default: the model's length limit")
    f.add("--max-num-seqs", "MAX_NUM_SEQS", 128, type=int)
    f.add("--num-blocks", "NUM_BLOCKS", type=int,
          help="KV cache blocks; default: from free memory on CUDA, on the CPU 256 MiB or one "
               "request of the model's whole length if more")
    f.add("--block-size", "BLOCK_SIZE", 16, type=int)
    f.add("--dtype", "DTYPE", help="default: float32 on cpu, bfloat16 on cuda")
    f.add("--load-format", "LOAD_FORMAT", "auto", choices=("auto", "dummy"))
    f.add("--quantization", "QUANTIZATION", type=lambda v: v or None, choices=("fp8",),
          help="fp8: decoder weights in e4m3 with per-channel scales, inputs quantized per "
               "token (CUDA, compute capability 8.9+; emulated on the CPU). Default: none")
    f.add("--async-scheduling", "ASYNC_SCHEDULING", "auto", choices=("auto", "on", "off"),
          help="schedule and prepare the next step while the device runs this one (auto: on "
               "for CUDA with one rank, off on the CPU)")
    f.add("--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION", 0.9, type=float)
    f.add("--no-prefix-caching", "NO_PREFIX_CACHING", False, action="store_true",
          help="do not reuse cached KV blocks of shared prefixes")
    f.add("--tensor-parallel-size", "TENSOR_PARALLEL_SIZE", 1, type=int,
          help="processes (GPUs) holding one model, each a shard; this process is rank 0 and "
               "starts the others (default 1)")
    f.add("--prefetch", "PREFETCH", 0, type=int,
          help="requests to pull beyond free seats (default 0: bind only when a seat is free)")
    f.add("--drain-timeout", "DRAIN_TIMEOUT_S", 30.0, type=float)
    f.add("--tls-ca-file", "TLS_CA_FILE", "")
    f.add("--metrics-port", "REPLICA_METRICS_PORT", 0, type=int)
    f.add("--threads", "TORCH_THREADS", 0, type=int,
          help="torch CPU threads (default: all cores on the CPU, 1 on an accelerator); give "
               "each of N CPU replicas on one machine cores/N so they do not oversubscribe it")
    f.add("--engine-thread", "ENGINE_THREAD", False, action="store_true",
          help="step the engine on a thread of this process, not in a process of its own "
               "(which keeps detokenizing and the router stream off the engine's GIL)")
    return f


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """Flags win over environment variables, which win over defaults."""
    f = _flags()
    p = f.parser
    a = p.parse_args(argv)
    f.check_env(sys.argv[1:] if argv is None else argv)
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
