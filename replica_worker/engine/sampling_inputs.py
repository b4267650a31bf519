"""A step's sampling inputs: built on the host with numpy, sent in one copy.

Each request's constant settings are packed once (SamplingParams.packed)
into NUM_COLUMNS int32 words; a step joins its rows' bytes into a [S, C]
array, so reading the batch's settings costs one bytes join, not a dozen
attribute reads per row. Everything the device needs (the columns, the
random draws, the row groups of each stage) is concatenated into one int32
array and moved with one non-blocking host-to-device copy from pinned memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from replica_worker.engine.sampling_params import SamplingParams

# float32 columns, then int32 columns.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
NUM_FLOAT_COLUMNS = 6
TOP_K, FLAGS, LOGPROBS, MIN_TOKENS, SEED_LOW, SEED_HIGH = range(6, 12)  # the seed's 32-bit halves
NUM_COLUMNS = 12

GREEDY, SEEDED, PENALTIES, REPETITION_PENALTY, LOGIT_BIAS = 1, 2, 4, 8, 16
NO_LOGPROBS = -1


def pack_params(p: "SamplingParams") -> bytes:
    """The constant columns of a request's rows as int32 words (floats bit-cast)."""
    floats = np.array(
        [1.0 if p.greedy else p.temperature, p.top_p, p.min_p,
         p.presence_penalty, p.frequency_penalty, p.repetition_penalty],
        dtype=np.float32,
    )
    flags = (GREEDY * p.greedy) | (SEEDED * (p.seed is not None)) | (PENALTIES * p.uses_penalties)
    flags |= REPETITION_PENALTY * (p.repetition_penalty != 1.0)
    flags |= LOGIT_BIAS * bool(p.logit_bias)
    seed = p.seed or 0
    ints = np.array(
        [max(p.top_k, 0), flags, NO_LOGPROBS if p.logprobs is None else p.logprobs, p.min_tokens,
         seed & 0xFFFFFFFF, seed >> 32],
        dtype=np.int64,
    ).astype(np.uint32)
    return floats.tobytes() + ints.tobytes()


def columns(params: list["SamplingParams"]) -> np.ndarray:
    """[S, NUM_COLUMNS] int32: each row's packed settings."""
    raw = b"".join([p.packed for p in params])
    return np.frombuffer(raw, dtype=np.int32).reshape(len(params), NUM_COLUMNS)


def float_columns(cols: np.ndarray) -> np.ndarray:
    return cols[:, :NUM_FLOAT_COLUMNS].view(np.float32)


def seeds(cols: np.ndarray) -> np.ndarray:
    """The rows' 64-bit seeds (0 for unseeded rows)."""
    halves = cols[:, [SEED_LOW, SEED_HIGH]].view(np.uint32).astype(np.uint64)
    return halves[:, 0] | (halves[:, 1] << np.uint64(32))


def transfer(sections: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Named 1-D arrays (int32, int64, float32, float64) -> the same on the device, in one copy.

    They travel as one int32 array; each section starts 8-byte aligned so
    that it can be viewed back as its own dtype. (torch is imported here, not
    above: a replica worker packs sampling parameters without loading torch.)
    """
    import torch

    words = [np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in sections.values()]
    sizes = [w.size + (w.size & 1) for w in words]
    flat = np.zeros(sum(sizes), dtype=np.int32)
    offset = 0
    for w, size in zip(words, sizes):
        flat[offset: offset + w.size] = w
        offset += size
    packed = torch.from_numpy(flat)
    if device.type != "cpu":
        # The caching host allocator keeps the pinned block until the copy is done.
        packed = packed.pin_memory().to(device, non_blocking=True)
    out = {}
    for (name, array), part, w in zip(sections.items(), packed.split(sizes), words):
        out[name] = part[: w.size].view(getattr(torch, array.dtype.name))
    return out
