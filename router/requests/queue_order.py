"""The requests of one queue in queue order (priority, then arrival), so the
oldest few can be read without sorting the whole queue: a heap whose
removed entries are skipped when they surface, and rebuilt once they
outnumber the live ones."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class QueueOrder:
    def __init__(self) -> None:
        self._heap: list = []                 # (order, seq, request)
        self._entry: dict[str, int] = {}      # request id -> seq of its live entry
        self._seqs = itertools.count()

    def __len__(self) -> int:
        return len(self._entry)

    def add(self, req) -> None:
        seq = next(self._seqs)
        self._entry[req.id] = seq
        heapq.heappush(self._heap, (req.order, seq, req))

    def remove(self, req) -> None:
        del self._entry[req.id]
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = [e for e in self._heap if self._entry.get(e[2].id) == e[1]]
            heapq.heapify(self._heap)

    def first(self, n: int, wanted: Callable[[object], bool]) -> list:
        """The first n live requests that are `wanted`, in queue order."""
        heap, seen, out = self._heap, [], []
        while heap and len(out) < n:
            entry = heapq.heappop(heap)
            if self._entry.get(entry[2].id) != entry[1]:
                continue   # removed: dropped for good
            seen.append(entry)
            if wanted(entry[2]):
                out.append(entry[2])
        for entry in seen:
            heapq.heappush(heap, entry)
        return out
