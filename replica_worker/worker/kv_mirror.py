"""The worker's copy of its engine's prefix cache, as block hashes, and the
changes the router has not been told yet.

The engine thread takes the cache's changes after every step
(EngineCore.take_kv_events) and the worker applies them here, on its event
loop, in order. A Register carries the whole copy (`snapshot`); from then on
each StepOutputs carries what changed since the message before (`take`), so
the router's view equals this copy at every message boundary. With no
session open nothing is kept pending: the next Register sends the whole copy.

Pending changes are bounded: past `max_pending` distinct hashes they collapse
into one `cleared` message carrying the whole copy, never a longer history.
"""

from __future__ import annotations

from replica_worker.engine.kv_events import KVCacheEvents


class KVMirror:
    def __init__(self, initial, max_pending: int) -> None:
        assert max_pending > 0, max_pending
        self.hashes: set[int] = set(initial)
        self.max_pending = max_pending
        self._pending: dict[int, bool] | None = None   # hash -> cached; None: no session
        self._cleared = False

    def apply(self, events: KVCacheEvents) -> None:
        """One take of the engine's event log (stored and evicted are disjoint)."""
        if events.cleared:
            self.hashes = set(events.stored)
            self._collapse()
            return
        self.hashes.difference_update(events.evicted)
        self.hashes.update(events.stored)
        if self._pending is None or self._cleared:
            return
        for h in events.stored:
            self._pending[h] = True
        for h in events.evicted:
            self._pending[h] = False
        if len(self._pending) > self.max_pending:
            self._collapse()

    def _collapse(self) -> None:
        if self._pending is not None:
            self._pending.clear()
            self._cleared = True

    def snapshot(self) -> list[int]:
        """The whole copy, for a Register; changes are tracked from here on."""
        self._pending, self._cleared = {}, False
        return list(self.hashes)

    def end_session(self) -> None:
        self._pending, self._cleared = None, False

    def take(self) -> KVCacheEvents | None:
        """What changed since the snapshot or the last take; None when nothing did."""
        if self._pending is None:
            return None
        if self._cleared:
            self._cleared = False
            return KVCacheEvents(stored=tuple(self.hashes), cleared=True)
        if not self._pending:
            return None
        pending, self._pending = self._pending, {}
        return KVCacheEvents(stored=tuple(h for h, p in pending.items() if p),
                             evicted=tuple(h for h, p in pending.items() if not p))
