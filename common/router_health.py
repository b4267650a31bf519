"""Which routers failed lately, for anything that dials one of several routers
(a client following a stream, a replica worker): it starts at its first
router unless that one is known to be down, and otherwise, and after a
failure, at another drawn at random among those not known to be down. So
both the streams of a router that died and the new work meant for it spread
over all the others (taken in list order they would all land on the next
one and double its load).

A router that failed is passed over for `down_for` seconds, doubling with each
failure in a row up to `max_down_for`; one that serves again is cleared. Shared
by many streams, one death is many failures in a row (every stream it broke), so
a process passes a dead router over for the longest time at once; the failover
runs of benchmarks/router/NOTES.md measured that behaviour.
When its pass-over ends, one caller takes it (first or after returns it) as a
trial, and the others keep passing it over until that trial fails (passed over
again, for longer) or is served (cleared): a router that still does not answer
(frozen: TCP accepts, HTTP/2 never does, about 8 s to fail with the keepalive
settings of client/api.py) holds up that one stream, not every new request
meant for it.
Not thread-safe: one owner per event loop.
"""

from __future__ import annotations

import random
import time


class RouterHealth:
    def __init__(self, down_for: float = 1.0, max_down_for: float = 16.0):
        self.down_for, self.max_down_for = down_for, max_down_for
        self._down_until: dict[str, float] = {}
        self._failures: dict[str, int] = {}

    def failed(self, address: str) -> None:
        n = self._failures.get(address, 0) + 1
        self._failures[address] = n
        self._down_until[address] = time.monotonic() + min(self.max_down_for, self.down_for * 2 ** (n - 1))

    def served(self, address: str) -> None:
        if address in self._failures:
            del self._failures[address]
            self._down_until.pop(address, None)

    def usable(self, address: str) -> bool:
        return self._down_until.get(address, 0.0) <= time.monotonic()

    def first(self, routers: list[str], rng: random.Random | None = None) -> str:
        """The first router in the list unless it is known to be down; then one
        drawn at random among the others not known to be down (the first, if all
        are). A client that starts each request at its own router keeps that
        spread when one of them dies."""
        if self.usable(routers[0]):
            return self._take(routers[0])
        live = [r for r in routers[1:] if self.usable(r)]
        return self._take((rng or random).choice(live) if live else routers[0])

    def after(self, routers: list[str], failed: str, rng: random.Random) -> tuple[str, bool]:
        """The router to try after `failed` failed, and whether to wait first:
        one drawn at random among the others not known to be down, at once;
        when every other one is, the next in list order, after a wait."""
        live = [r for r in routers if r != failed and self.usable(r)]
        if live:
            return self._take(rng.choice(live)), False
        return self._take(routers[(routers.index(failed) + 1) % len(routers)]), True

    def _take(self, address: str) -> str:
        """A router that failed and is tried again: the others pass it over
        while this trial lasts (until failed or served; max_down_for at most)."""
        if address in self._down_until:
            self._down_until[address] = time.monotonic() + self.max_down_for
        return address
