"""KV events: a mirror that applies every take equals the cache's own snapshot,
whatever happened between takes; a log nobody drains stays bounded."""

from __future__ import annotations

import random

from replica_worker.engine.block_manager import BlockManager
from replica_worker.engine.block_pool import EVENT_LOG_BLOCKS_FACTOR
from replica_worker.engine.kv_events import KVCacheEvents, KVEventLog
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence


def apply(mirror: set[int], events: KVCacheEvents) -> None:
    """What a router does with one take."""
    if events.cleared:
        mirror.clear()
    mirror.difference_update(events.evicted)
    mirror.update(events.stored)


def test_each_hash_reports_its_last_change_since_the_previous_take():
    log = KVEventLog(100, snapshot=lambda: [])
    log.stored(1)
    log.evicted(1)
    log.evicted(2)
    log.stored(2)
    log.stored(3)
    events = log.take()
    assert set(events.stored) == {2, 3} and events.evicted == (1,) and not events.cleared
    assert log.take().empty


def test_an_undrained_log_collapses_to_a_snapshot():
    cache = {10, 11}
    log = KVEventLog(3, snapshot=lambda: sorted(cache))
    for h in range(1000):
        log.stored(h)
        log.evicted(h)
    assert len(log._present) == 0  # bounded: nothing kept past the overflow
    events = log.take()
    assert events.cleared and events.stored == (10, 11) and events.evicted == ()
    log.stored(12)
    assert log.take() == KVCacheEvents(stored=(12,))


def run_random_workload(bm: BlockManager, rng: random.Random, mirror: set[int] | None, n: int) -> None:
    running: list[Sequence] = []
    prefixes = [[rng.randrange(500) for _ in range(rng.choice([4, 8, 12]))] for _ in range(6)]
    for i in range(n):
        tokens = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 9))]
        seq = Sequence(f"s{i}", tokens, SamplingParams(max_tokens=4))
        while not bm.can_allocate(seq) and running:
            bm.free(running.pop(0))
        bm.allocate(seq)
        seq.num_computed_tokens = rng.randrange(seq.num_computed_tokens, seq.num_tokens + 1)
        bm.cache_computed(seq)
        running.append(seq)
        if mirror is not None and rng.random() < 0.5:
            apply(mirror, bm.take_kv_events())
    for seq in running:
        bm.free(seq)


def test_a_mirror_fed_by_events_equals_the_snapshot_under_eviction():
    bm = BlockManager(12, 4, 0.0)
    mirror: set[int] = set()
    run_random_workload(bm, random.Random(5), mirror, 300)
    apply(mirror, bm.take_kv_events())
    assert mirror == set(bm.cached_block_hashes())
    assert bm.prefix_cache_stats().hits > 0 and bm.pool.num_cached > 0


def test_a_mirror_recovers_after_the_log_overflowed():
    bm = BlockManager(12, 4, 0.0)
    mirror = {123456789}  # stale: must be dropped by the snapshot
    run_random_workload(bm, random.Random(6), None, 300)
    assert len(bm.pool.events._present) <= EVENT_LOG_BLOCKS_FACTOR * 12
    events = bm.take_kv_events()
    assert events.cleared
    apply(mirror, events)
    assert mirror == set(bm.cached_block_hashes())
