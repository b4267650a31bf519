"""What the prefix cache tells the outside: hit counters and stored/evicted block hashes.

A router mirrors each replica's cache as a set of block hashes (common/block_hash.py).
It applies KVCacheEvents in the order it takes them; the log keeps only each hash's
last change since the previous take, which leaves a mirror in the same state as
replaying every change would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative, in tokens, as vLLM counts them: each admission (a preempted
    sequence's re-admission too) queries its whole known context and hits the
    tokens it finds cached. cached_blocks is a gauge: full blocks with an address now."""

    queries: int = 0
    hits: int = 0
    cached_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class KVCacheEvents:
    """Block hashes stored in and evicted from the cache since the last take.

    cleared: the log overflowed (nobody took it for a long while), so the
    consumer must forget what it holds for this cache; stored is then the
    whole cache (a snapshot) and evicted is empty.
    """

    stored: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    cleared: bool = False

    @property
    def empty(self) -> bool:
        return not (self.stored or self.evicted or self.cleared)


class KVEventLog:
    """Net changes since the last take, at most max_pending hashes of them.

    Past the bound the log forgets its changes and records nothing until the
    next take, which then returns a snapshot: a consumer that never drains
    costs a bounded amount of memory, and one that drains late gets a state no
    larger than the cache itself instead of an ever longer history.
    """

    def __init__(self, max_pending: int, snapshot: Callable[[], Iterable[int]]) -> None:
        assert max_pending > 0, max_pending
        self.max_pending = max_pending
        self._snapshot = snapshot
        self._present: dict[int, bool] = {}  # hash -> cached after its last change
        self._overflowed = False

    def stored(self, block_hash: int) -> None:
        self._record(block_hash, True)

    def evicted(self, block_hash: int) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: int, present: bool) -> None:
        if self._overflowed:
            return
        self._present[block_hash] = present
        if len(self._present) > self.max_pending:
            self._present.clear()
            self._overflowed = True

    def take(self) -> KVCacheEvents:
        if self._overflowed:
            self._overflowed = False
            return KVCacheEvents(stored=tuple(self._snapshot()), cleared=True)
        present, self._present = self._present, {}
        return KVCacheEvents(
            stored=tuple(h for h, p in present.items() if p),
            evicted=tuple(h for h, p in present.items() if not p),
        )
