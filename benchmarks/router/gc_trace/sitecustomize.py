"""Put on a router's PYTHONPATH with QUADRIGA_GC_TRACE=FILE_PREFIX (benchmarks only):
every garbage collection's generation, start (monotonic s) and pause (ms) is
written to FILE_PREFIX.PID, one line each. benchmarks/router/gc_steady.py reads it."""

import gc
import os
import time

_prefix = os.environ.get("QUADRIGA_GC_TRACE")
if _prefix:
    _out = open(f"{_prefix}.{os.getpid()}", "w", buffering=1)
    _started = [0.0]

    def _trace(phase, info):
        if phase == "start":
            _started[0] = time.monotonic()
        else:
            pause_ms = (time.monotonic() - _started[0]) * 1e3
            _out.write(f"{info['generation']} {_started[0]:.4f} {pause_ms:.3f}\n")

    gc.callbacks.append(_trace)
