"""Philox4x32-10, the counter-based generator of Salmon et al. (SC'11), in numpy.

A draw is a pure function of (key, counter): no state is carried between
draws, so the draw for a request's output index i is the same whichever
step, batch or replica computes it. Vectorized over rows; the sampler
needs one draw per seeded row per step, so this runs on the host and its
results travel with the step's other sampling inputs.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
ROUNDS = 10


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = ROUNDS) -> np.ndarray:
    """counter [n, 4] and key [n, 2] of 32-bit words -> [n, 4] uint32 random words."""
    c = np.asarray(counter, dtype=np.uint64)
    k = np.asarray(key, dtype=np.uint64)
    c0, c1, c2, c3 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    k0, k1 = k[:, 0], k[:, 1]
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _LOW32
            k1 = (k1 + _W1) & _LOW32
        # A 32x32-bit product fits in 64 bits: its high and low words are exact.
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _LOW32, (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _LOW32
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key of a 64-bit seed: its low and high 32-bit words."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def uniforms(keys: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One float64 in (0, 1] per row, from 53 random bits of Philox(key, (index, 0, 0, 0)).

    keys [n, 2] uint32 words; indices [n] non-negative ints below 2**64.
    """
    idx = np.asarray(indices, dtype=np.uint64)
    counter = np.zeros((len(idx), 4), dtype=np.uint64)
    counter[:, 0] = idx & _LOW32
    counter[:, 1] = idx >> _SHIFT32
    words = philox4x32(counter, keys).astype(np.uint64)
    bits53 = (words[:, 0] << np.uint64(21)) | (words[:, 1] >> np.uint64(11))
    return (bits53 + np.uint64(1)).astype(np.float64) * 2.0**-53
