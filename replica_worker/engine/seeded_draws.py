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

# The scalar functions are shared with the router, which expands n completions
# into n requests with these seeds.
from common.seeds import GOLDEN, _MIX1, _MIX2, derived_seed, mix64  # noqa: E402,F401


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
