"""The cpu-tiny profile: the tiny random Llama (common/tiny_model.py) on this
machine's CPU, float32, torch attention, measured here.

Each point is the median wall time of ModelRunner.execute for one batch (as
bench_engine.py times the GPU runner): decodes at several batch sizes and
contexts (so, unlike the H200 data, per-sequence and per-KV-token costs
separate), prefills of several lengths, some after a cached context, and
mixed steps of a prefill chunk with decodes. The KV cache holds whatever was
written before: timing does not depend on its values.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from pathlib import Path

from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from replica_worker.engine.model_runner import ModelRunner, _Chunk
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from replica_worker.sim.cost_model import features_of
from replica_worker.sim.fit import Point, fit_points, profile_entry

NAME = "cpu-tiny"
BLOCK_SIZE = 16
NUM_BLOCKS = 2048
DECODES = [(b, ctx) for b in (1, 4, 16, 32) for ctx in (64, 256, 768)]
PREFILLS = [(n, 0) for n in (16, 64, 256, 512)] + [(64, 512), (256, 256)]
MIXED = [(256, 0, 16, 256), (128, 256, 32, 128)]  # prefill n after cached c, with b decodes at ctx


def tiny_model_dir() -> Path:
    """The tiny model the local stack and the harness use (built offline, once)."""
    from stack.__main__ import tiny_model

    return Path(tiny_model())


def _seq(seq_id: str, rng: random.Random, num_tokens: int, computed: int, block_start: int):
    seq = Sequence(seq_id, [rng.randrange(500) for _ in range(num_tokens)], SamplingParams(temperature=0.0))
    blocks = -(-num_tokens // BLOCK_SIZE)
    seq.block_ids = list(range(block_start, block_start + blocks))
    seq.num_computed_tokens = computed
    if computed:  # in decode: the last token is output, so the sequence is past its prefill
        seq.output_token_ids.append(seq.prompt_token_ids.pop())
    return seq, block_start + blocks


def _batch(rng, decodes: tuple[int, int] = (0, 0), prefill: tuple[int, int] | None = None):
    """Chunks of one step: a prefill of n tokens after c cached (if any), then b decodes
    at context ctx. The cache is large enough for the largest batch above."""
    chunks, start = [], 0
    if prefill:
        n, cached = prefill
        seq, start = _seq("p", rng, cached + n, 0, start)
        seq.num_computed_tokens = cached
        chunks.append(_Chunk(seq, n))
    b, ctx = decodes
    for i in range(b):
        seq, start = _seq(f"d{i}", rng, ctx, ctx - 1, start)
        chunks.append(_Chunk(seq, 1))
    return chunks


def _median_s(runner: ModelRunner, chunks, reps: int) -> float:
    for _ in range(2):
        runner.execute(chunks)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(runner: ModelRunner, reps: int) -> list[Point]:
    rng = random.Random(0)
    source = f"measured here ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    batches = [(f"decode batch {b} context {ctx}", _batch(rng, (b, ctx))) for b, ctx in DECODES]
    batches += [(f"prefill {n} tokens after {c} cached", _batch(rng, prefill=(n, c))) for n, c in PREFILLS]
    batches += [(f"prefill {n} after {c} cached + {b} decodes at {ctx}", _batch(rng, (b, ctx), (n, c)))
                for n, c, b, ctx in MIXED]
    return [Point(label, source, features_of(chunks), _median_s(runner, chunks, reps))
            for label, chunks in batches]


def cpu_profile(reps: int = 7, threads: int = 1) -> tuple[str, dict]:
    import torch

    torch.set_num_threads(threads)
    model = tiny_model_dir()
    config = EngineConfig(ModelConfig(str(model)), CacheConfig(BLOCK_SIZE, NUM_BLOCKS), SchedulerConfig())
    runner = ModelRunner(config)
    points = measure(runner, reps)
    fit = fit_points(points)
    shape = {"vocab_size": runner.vocab_size, "max_model_len": runner.max_model_len,
             "num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE}
    return NAME, profile_entry(
        fit, description=f"tiny random Llama ({model.name}) on this CPU, float32, torch threads {threads}; "
                         f"step = runner.execute wall time, median of {reps}",
        shape=shape, fixed_why={}, extra={"torch_threads": threads, "load_average": os.getloadavg()})
