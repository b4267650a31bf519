"""Seeds shared by the engine and the router: SplitMix64's finalizer, and the
seed of completion i of a seeded request with n completions (the router
expands n into n requests; offline LLM.generate does the same), so the same
body gets the same answers through either door."""

from __future__ import annotations

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
