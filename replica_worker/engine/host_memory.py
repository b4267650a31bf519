"""Keeps freed host memory for reuse, for an engine that runs on the CPU.

Every layer of a CPU step allocates activations of megabytes. glibc's malloc
serves allocations past its mmap threshold (dynamic, at most 32 MiB) with
fresh mmaps and unmaps them on free, so each such tensor pays a page fault
per 4 KiB, zero-filled, on first touch, every layer of every step: at a
prefill of 8,192 tokens on two cores that was a fifth of the step
(benchmarks/engine/cpu_vs_transformers.py). jemalloc or tcmalloc, which
vLLM's and IPEX's CPU guides preload, avoid it; glibc's own mallopt knobs do
the same without preloading anything:

- M_MMAP_MAX 0: no allocation is served by mmap; they come from the heap;
- M_TRIM_THRESHOLD at its largest: freed memory stays in the heap;
- M_ARENA_MAX 1: threads started from here on (the engine loop) share the
  main arena, whose heap can grow to any size; another thread's arena can
  hold at most 64 MiB in one block and would fall back to mmap past that.

The process then keeps its peak allocation for reuse instead of handing it
back, which is the point. Only glibc has these knobs; elsewhere this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

_applied = False


def retain_freed_memory() -> bool:
    """Applies the settings above once per process; True when they took."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX)))
    if not ok:
        log.warning("mallopt refused a setting: freed host memory may be returned to the system")
    _applied = ok
    return ok
