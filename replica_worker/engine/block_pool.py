"""The physical KV blocks: reference counts, the free list and the cache of full blocks.

Every block is in exactly one of three states:
- referenced: held by refcount >= 1 sequences (more than one only for a
  cached block, which is full and never written again);
- evictable: cached (it has a content hash) but held by nobody, kept in
  least-recently-released order until a block is needed;
- free: neither referenced nor cached.

A block's content hash (common/block_hash.py) names its tokens and every token
before them, so a cached block can serve any sequence with the same prefix.
One block per hash: a second block filled with the same content stays
uncached and returns to the free list when released.

Taking a block prefers the free list, then evicts the least recently released
evictable block. Available blocks (what admission may count on) are free plus
evictable ones.
"""

from __future__ import annotations

from collections import OrderedDict

from replica_worker.engine.kv_events import KVEventLog

# The event log's bound, in multiples of the cache's block count: past it a
# snapshot (at most one hash a block) is smaller than the pending changes.
EVENT_LOG_BLOCKS_FACTOR = 2


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # Popped from the end: a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.events = KVEventLog(EVENT_LOG_BLOCKS_FACTOR * num_blocks, self.cached_hashes)

    # ---- counts ----
    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def cached_hashes(self) -> list[int]:
        return list(self._block_of)

    # ---- the cache ----
    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of hashes found, in order."""
        found = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache(self, block_id: int, block_hash: int) -> None:
        """Gives a full, referenced block its content address, unless another
        block already has it (the cache keeps one block per hash)."""
        assert self._refs[block_id] > 0, f"caching unreferenced block {block_id}"
        assert block_id not in self._hash_of, f"block {block_id} is already cached"
        if block_hash in self._block_of:
            return
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self.events.stored(block_hash)

    # ---- references ----
    def take(self, n: int) -> list[int]:
        assert n <= self.num_available, f"taking {n} blocks, {self.num_available} available"
        taken = []
        for _ in range(n):
            block_id = self._free.pop() if self._free else self._evict()
            assert self._refs[block_id] == 0, block_id
            self._refs[block_id] = 1
            taken.append(block_id)
        return taken

    def ref(self, block_id: int) -> None:
        """One more holder of a cached block (a prefix hit)."""
        assert block_id in self._hash_of, f"sharing uncached block {block_id}"
        if self._refs[block_id] == 0:
            del self._evictable[block_id]
        self._refs[block_id] += 1

    def unref(self, block_id: int) -> None:
        assert self._refs[block_id] > 0, f"block {block_id} is not held (double free?)"
        self._refs[block_id] -= 1
        if self._refs[block_id]:
            return
        if block_id in self._hash_of:
            self._evictable[block_id] = None
        else:
            self._free.append(block_id)

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        self.events.evicted(block_hash)
        return block_id
