"""One modelled device shared by several simulated replicas, as two replicas share
one GPU in the single-GPU prefix benchmarks (benchmarks/gpu/run_prefix_affinity.sh).

A GPU without MPS time-slices the contexts of several processes: while n of them
have work, each advances at about 1/n of its speed, so a decode step of one replica
that meets the other's prefill chunk takes longer, and so does the chunk. That
wait is what made p99 TBT the bound in every GPU search there. The model is
processor sharing: a step of modelled length s runs in slices, each advancing it
by its wall time divided by the number of replicas running a step at that moment.

The replicas meet in a small file, mapped into each process: one slot per
replica (the owner's pid and whether it is in a step), claimed under flock(2)
when a replica starts. A slot whose owner has died counts as idle, so a killed
replica does not slow the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time

SLOTS = 64
_SLOT = struct.Struct("ii")        # owner pid (0: free), 1 while in a step
SLICE_S = 0.001                    # modelled seconds a slice: how often the share is re-read
_LIVENESS_EVERY_S = 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedDevice:
    def __init__(self, path: str):
        if not path:
            raise ValueError("a shared device needs a file path")
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < SLOTS * _SLOT.size:
                    os.ftruncate(fd, SLOTS * _SLOT.size)
                self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
                self.slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._dead: set[int] = set()
        self._checked_at = 0.0

    def _claim(self) -> int:
        pid = os.getpid()
        for i in range(SLOTS):
            owner, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if owner == 0 or (owner != pid and not _alive(owner)):
                _SLOT.pack_into(self._map, i * _SLOT.size, pid, 0)
                return i
        raise RuntimeError(f"more than {SLOTS} replicas share {self.path}")

    def _set_running(self, running: bool) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), 1 if running else 0)

    def running_count(self) -> int:
        """Replicas in a step now (slots of dead owners left out)."""
        now = time.monotonic()
        if now - self._checked_at > _LIVENESS_EVERY_S:
            self._checked_at = now
            self._dead = {owner for owner, _ in _SLOT.iter_unpack(self._map)
                          if owner and not _alive(owner)}
        return sum(1 for owner, busy in _SLOT.iter_unpack(self._map) if busy and owner not in self._dead)

    @contextlib.contextmanager
    def _running(self):
        self._set_running(True)
        try:
            yield
        finally:
            self._set_running(False)

    def run_step(self, modelled_s: float, time_scale: float) -> None:
        """Waits out a step of modelled_s seconds on the shared device: each slice
        advances it by the slice's wall time (unscaled) over the replicas running."""
        if modelled_s <= 0 or time_scale <= 0:
            return
        with self._running():
            left = modelled_s
            last = time.monotonic()
            while left > 1e-9:
                n = max(1, self.running_count())   # this one, at the least
                time.sleep(min(SLICE_S, left * n) * time_scale)
                now = time.monotonic()
                left -= (now - last) / time_scale / n
                last = now
