"""Engine configuration: one frozen dataclass per subsystem, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_NAMES = ("sarathi", "vllm", "orca", "faster_transformer", "simple_chunking")
DTYPES = ("float32", "bfloat16", "float16")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """model: a local Hugging Face folder (config.json, safetensors, tokenizer).

    load_format "dummy" fills weights with random values of the configured shape;
    the folder then needs only config.json (and a tokenizer to detokenize).
    quantization "fp8" stores the decoder's projections in e4m3 after loading
    (model/fp8.py); None keeps the dtype's weights.
    """

    model: str
    dtype: str = "float32"
    load_format: str = "auto"  # "auto" (safetensors) or "dummy"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # dummy weights
    quantization: str | None = None  # "fp8": decoder projections in e4m3 (model/fp8.py)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.load_format in ("auto", "dummy"), f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")
        _require(self.quantization in (None, "fp8"), f"quantization must be 'fp8' or None, got {self.quantization!r}")


DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20
# The most the CPU default grows to for one whole-length request (a CPU server's
# common KV default): past it the cache stays smaller and says so at start.
MAX_DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. num_blocks wins when given; otherwise the cache is sized
    from kv_cache_memory_bytes (CPU; None: DEFAULT_CPU_KV_CACHE_BYTES, or one
    request of the model's whole length when that needs more) or
    gpu_memory_utilization (CUDA).
    enable_prefix_caching keeps computed full blocks for reuse by later
    requests with the same prefix (block_manager.py)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    watermark: float = 0.01  # fraction of blocks kept free when admitting new prompts
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size must be positive")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks must be positive")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 "kv_cache_memory_bytes must be positive")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _require(0.0 <= self.watermark < 1.0, "watermark must be in [0, 1)")


@dataclass(frozen=True)
class SchedulerConfig:
    """name picks the replica scheduler. chunk_size is the per-step token budget of
    the chunked schedulers (sarathi, simple_chunking); max_num_batched_tokens bounds
    the others' steps (None: the model's length limit)."""

    name: str = "sarathi"
    max_num_seqs: int = 128
    chunk_size: int = 512
    max_num_batched_tokens: int | None = None
    # Sarathi's optional dynamic chunk schedule: the chunk size ramps from
    # high_chunk_size down to low_chunk_size over the prefill of a long prompt.
    enable_dynamic_chunking_schedule: bool = False
    low_chunk_size: int = 128
    high_chunk_size: int = 2048
    chunk_schedule_max_tokens: int = 131072
    chunk_schedule_stages: int = 16

    def __post_init__(self) -> None:
        _require(self.name in SCHEDULER_NAMES, f"scheduler must be one of {SCHEDULER_NAMES}, got {self.name!r}")
        _require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _require(self.chunk_size > 0, "chunk_size must be positive")
        _require(self.low_chunk_size <= self.high_chunk_size, "low_chunk_size must not exceed high_chunk_size")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size processes hold one model, each a shard of every layer
    (docs/engine.md): rank 0 is the engine's own process and starts the others; on
    CUDA rank r runs on the r-th GPU from the configured device. The KV cache settings
    (num_blocks, kv_cache_memory_bytes, gpu_memory_utilization) are per rank."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: str = "cpu"  # "cpu" or "cuda"
    enable_cuda_graphs: bool = True  # CUDA only: decode-only steps replay captured graphs
    parallel: ParallelConfig = ParallelConfig()
    # Schedule and prepare the next step while the device runs this one (core.py).
    # None: on for CUDA, off for the CPU (where host and "device" are the same cores).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), f"device must be cpu or cuda, got {self.device!r}")
        _require(not (self.async_scheduling and self.parallel.tensor_parallel_size > 1),
                 "async scheduling needs tensor_parallel_size 1: the other ranks take token ids from rank 0's host")

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """The inverse of dataclasses.asdict (how rank 0 hands its config to the other ranks)."""
        return cls(
            model=ModelConfig(**d["model"]),
            cache=CacheConfig(**d["cache"]),
            scheduler=SchedulerConfig(**d["scheduler"]),
            device=d["device"],
            enable_cuda_graphs=d["enable_cuda_graphs"],
            parallel=ParallelConfig(**d["parallel"]),
            async_scheduling=d.get("async_scheduling"),
        )


_MODEL_KEYS = {"dtype", "load_format", "max_model_len", "seed", "quantization"}
_CACHE_KEYS = {"block_size", "num_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "watermark",
               "enable_prefix_caching"}
_PARALLEL_KEYS = {"tensor_parallel_size"}
_SCHEDULER_KEYS = {
    "max_num_seqs", "chunk_size", "max_num_batched_tokens", "enable_dynamic_chunking_schedule",
    "low_chunk_size", "high_chunk_size", "chunk_schedule_max_tokens", "chunk_schedule_stages",
}


def engine_config(model: str, scheduler: str = "sarathi", device: str = "cpu",
                  enable_cuda_graphs: bool = True, async_scheduling: bool | None = None,
                  **kwargs) -> EngineConfig:
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
        async_scheduling=async_scheduling,
    )
