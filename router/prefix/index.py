"""The router's view of every replica's prefix cache: which full KV blocks each
one holds, by content hash (common/block_hash.py).

Updated only from what replicas report: the whole set at Register (`replace`),
then each step's changes (`apply`), in stream order. A replica's view goes
when it leaves for good: at once when it was dropped (`drop`), or once its
lease would have lapsed after its stream broke (`depart`, then `expire`);
a replica that comes back in time replaces its view with its new snapshot.

Memory is bounded: past `max_entries` (replica, hash) entries in all, the
least recently stored entry of any replica goes. The view then holds less
than the replica does, so a match can only be shorter than the truth.

Lookups: a hash maps to a bit mask of the replicas holding it, so the
longest cached prefix of a request on each of several replicas costs one
dictionary read per block of the longest match.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Iterable

from common.block_hash import BlockHasher


class HasherMismatch(ValueError):
    """A replica addresses blocks differently from the others (block size, scheme, salt)."""


class PrefixIndex:
    def __init__(self, max_entries: int) -> None:
        assert max_entries > 0, max_entries
        self.max_entries = max_entries
        self.hasher: BlockHasher | None = None    # shared by every replica with a view
        self.evictions = 0                        # entries dropped for the bound
        self._views: dict[str, OrderedDict[int, int]] = {}   # replica -> hash -> stamp, oldest first
        self._bit: dict[str, int] = {}
        self._replica_of_bit: dict[int, str] = {}
        self._holders: dict[int, int] = {}        # hash -> bit mask of replicas holding it
        self._departed: dict[str, float] = {}     # replica -> when its view goes
        self._stamps = itertools.count()
        self._entries = 0

    # ---- reads ----
    def __len__(self) -> int:
        return self._entries

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._views

    def size_of(self, replica_id: str) -> int:
        view = self._views.get(replica_id)
        return len(view) if view is not None else 0

    def hashes_of(self, replica_id: str) -> set[int]:
        return set(self._views.get(replica_id, ()))

    def check_hasher(self, replica_id: str, hasher: BlockHasher) -> None:
        """Raises HasherMismatch unless the replica addresses blocks as the others do."""
        if self.hasher is None or hasher == self.hasher:
            return
        others = [r for r in self._views if r != replica_id]
        if others:
            raise HasherMismatch(
                f"its prefix cache uses block size {hasher.block_size}, scheme {hasher.scheme!r} and "
                f"a {len(hasher.salt)}-byte salt; replica {others[0]!r} uses block size "
                f"{self.hasher.block_size}, scheme {self.hasher.scheme!r} and a "
                f"{len(self.hasher.salt)}-byte salt (all replicas of a router serve one model "
                "with one --block-size)")

    def matched_blocks(self, hashes: list[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica, how many leading blocks of `hashes` it holds (0 without a view)."""
        result = {}
        alive = 0
        for rid in replica_ids:
            result[rid] = 0
            bit = self._bit.get(rid)
            if bit is not None:
                alive |= 1 << bit
        holders = self._holders
        depth = 0
        for depth, h in enumerate(hashes):
            still = holders.get(h, 0) & alive
            if still != alive:
                self._record(result, alive & ~still, depth)
                alive = still
                if not alive:
                    return result
        if alive:
            self._record(result, alive, len(hashes))
        return result

    def _record(self, result: dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            result[self._replica_of_bit[low.bit_length() - 1]] = depth
            mask ^= low

    # ---- changes ----
    def replace(self, replica_id: str, hasher: BlockHasher, hashes: Iterable[int]) -> None:
        """A replica's whole cache (Register): its view becomes exactly this."""
        self.check_hasher(replica_id, hasher)
        self._clear(replica_id)
        self._departed.pop(replica_id, None)
        self.hasher = hasher
        if replica_id not in self._bit:
            bit = next(b for b in itertools.count() if b not in self._replica_of_bit)
            self._bit[replica_id] = bit
            self._replica_of_bit[bit] = replica_id
        self._views[replica_id] = OrderedDict()
        self._store(replica_id, hashes)

    def apply(self, replica_id: str, stored: Iterable[int], evicted: Iterable[int],
              cleared: bool) -> None:
        """One step's changes; cleared: `stored` is the whole cache."""
        if replica_id not in self._views:
            return
        if cleared:
            self._clear(replica_id)
            self._views[replica_id] = OrderedDict()
        else:
            self._remove(replica_id, evicted)
        self._store(replica_id, stored)

    def drop(self, replica_id: str) -> None:
        """The replica left for good: its view goes."""
        self._clear(replica_id)
        self._departed.pop(replica_id, None)
        bit = self._bit.pop(replica_id, None)
        if bit is not None:
            del self._replica_of_bit[bit]
        if not self._views:
            self.hasher = None

    def depart(self, replica_id: str, until: float) -> None:
        """Its stream broke: the view stays until `until`, unless it registers again."""
        if replica_id in self._views:
            self._departed[replica_id] = until

    def expire(self, now: float) -> list[str]:
        """Drops the views of replicas departed before now; returns their ids."""
        gone = [rid for rid, until in self._departed.items() if until <= now]
        for rid in gone:
            self.drop(rid)
        return gone

    # ---- internals ----
    def _store(self, replica_id: str, hashes: Iterable[int]) -> None:
        view = self._views[replica_id]
        bit = 1 << self._bit[replica_id]
        holders = self._holders
        for h in hashes:
            if h in view:
                view.move_to_end(h)
            else:
                self._entries += 1
                holders[h] = holders.get(h, 0) | bit
            view[h] = next(self._stamps)
        while self._entries > self.max_entries:
            self._evict_oldest()

    def _remove(self, replica_id: str, hashes: Iterable[int]) -> None:
        view = self._views[replica_id]
        keep = ~(1 << self._bit[replica_id])
        for h in hashes:
            if view.pop(h, None) is not None:
                self._entries -= 1
                self._unhold(h, keep)

    def _unhold(self, h: int, keep: int) -> None:
        left = self._holders[h] & keep
        if left:
            self._holders[h] = left
        else:
            del self._holders[h]

    def _clear(self, replica_id: str) -> None:
        view = self._views.pop(replica_id, None)
        if view:
            keep = ~(1 << self._bit[replica_id])
            for h in view:
                self._unhold(h, keep)
            self._entries -= len(view)

    def _evict_oldest(self) -> None:
        # Each view is in store order, so the oldest entry of all heads one of them.
        replica_id, view = min(((r, v) for r, v in self._views.items() if v),
                               key=lambda item: next(iter(item[1].values())))
        h, _ = view.popitem(last=False)
        self._entries -= 1
        self._unhold(h, ~(1 << self._bit[replica_id]))
        self.evictions += 1
