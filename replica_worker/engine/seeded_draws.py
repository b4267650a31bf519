"""Counter-based random draws for seeded requests: SplitMix64, vectorized in numpy.

The draw for (seed, i) is output i of the SplitMix64 generator seeded with
seed (Steele, Lea and Flood, OOPSLA 2014): mix64(seed + (i + 1) * GOLDEN).
It is a pure function of (seed, i), with no state carried between draws, so
the draw for a request's output index i is the same whichever step, batch
or replica computes it. A step needs one draw per seeded row; computing
them on the host costs a handful of numpy operations over the rows, and the
draws travel with the step's other sampling inputs.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (a bijection of 64-bit words)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def derived_seed(seed: int, index: int) -> int:
    """A seed of its own for stream `index` of `seed` (completion index of n)."""
    return mix64(seed ^ mix64(index * GOLDEN))


def stream_words(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Output `indices` of the SplitMix64 streams seeded with `seeds` (uint64 [n])."""
    z = np.asarray(seeds, dtype=np.uint64) + (np.asarray(indices, dtype=np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One float64 in (0, 1] per row, from the top 53 bits of its stream's output."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 intends
        words = stream_words(seeds, indices)
    return ((words >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
