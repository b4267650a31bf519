"""One modelled device shared by several simulated replicas, as two replicas share
one GPU in the single-GPU prefix benchmarks (benchmarks/gpu/run_prefix_affinity.sh).

Every simulated step holds an exclusive lock on one file for its modelled time,
so the steps of every replica naming that file run one at a time, in whatever
process they live: a GPU without MPS time-slices the contexts of several
processes, and a decode step of one replica waits behind the other's prefill
chunk. That wait is what made p99 TBT the bound in every GPU search there.
The lock is flock(2) on a descriptor of the replica's own, so replicas in one
process (threads) contend as processes do.
"""

from __future__ import annotations

import fcntl
import os


class SharedDevice:
    def __init__(self, path: str):
        if not path:
            raise ValueError("a shared device needs a lock file path")
        # Opened (and created) once: the lock is taken every step.
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> "SharedDevice":
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
