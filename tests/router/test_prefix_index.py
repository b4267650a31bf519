"""The router's view of the replicas' prefix caches (router/prefix/), on its own:
snapshots, events, cleared, the memory bound, replicas leaving, and the
hashes the router computes for a request against the engine's own."""

import pytest

from common.block_hash import BlockHasher
from replica_worker.engine.block_manager import BlockManager
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from router.prefix.index import HasherMismatch, PrefixIndex
from router.prefix.matcher import PrefixMatcher, context_hashes
from router.scheduling.policies import Arrival

H16 = BlockHasher(16)


def chain(n: int, seed: int = 0) -> list[int]:
    """n block hashes of one prefix, as a replica would report them."""
    return H16.hashes([seed * 1000 + i for i in range(16 * n)])


def test_snapshot_then_events_and_longest_prefix_per_replica():
    idx = PrefixIndex(1000)
    a = chain(6)
    idx.replace("r0", H16, a[:4])
    idx.replace("r1", H16, a[:2])
    assert idx.matched_blocks(a, ["r0", "r1", "r2"]) == {"r0": 4, "r1": 2, "r2": 0}
    idx.apply("r1", stored=a[2:6], evicted=(), cleared=False)
    assert idx.matched_blocks(a, ["r0", "r1"]) == {"r0": 4, "r1": 6}
    # A hole ends the match, as the engine's lookup stops at its first miss.
    idx.apply("r1", stored=(), evicted=[a[1]], cleared=False)
    assert idx.matched_blocks(a, ["r1"]) == {"r1": 1}
    assert idx.matched_blocks(chain(3, seed=9), ["r0", "r1"]) == {"r0": 0, "r1": 0}
    assert len(idx) == 4 + 5 and idx.hashes_of("r1") == set(a) - {a[1]}


def test_cleared_replaces_the_view_and_register_replaces_it_too():
    idx = PrefixIndex(1000)
    a, b = chain(3), chain(3, seed=1)
    idx.replace("r0", H16, a)
    idx.apply("r0", stored=b, evicted=(), cleared=True)
    assert idx.hashes_of("r0") == set(b) and idx.matched_blocks(a, ["r0"]) == {"r0": 0}
    idx.replace("r0", H16, a[:1])   # a stream blip: the new snapshot is the truth
    assert idx.hashes_of("r0") == {a[0]} and len(idx) == 1


def test_events_of_a_replica_without_a_view_are_ignored():
    idx = PrefixIndex(10)
    idx.apply("ghost", stored=chain(2), evicted=(), cleared=False)
    assert len(idx) == 0 and "ghost" not in idx


def test_the_bound_evicts_the_least_recently_stored_of_any_replica():
    idx = PrefixIndex(5)
    a = chain(4)
    idx.replace("r0", H16, a[:3])          # stored first: the oldest
    idx.replace("r1", H16, a[:2])
    assert len(idx) == 5 and idx.evictions == 0
    idx.apply("r0", stored=[a[0]], evicted=(), cleared=False)   # stored again: now the newest
    idx.apply("r1", stored=[a[2]], evicted=(), cleared=False)   # 6 > 5: r0's a[1] goes
    assert len(idx) == 5 and idx.evictions == 1
    assert idx.hashes_of("r0") == {a[0], a[2]} and idx.hashes_of("r1") == set(a[:3])
    assert idx.matched_blocks(a, ["r0", "r1"]) == {"r0": 1, "r1": 3}
    idx.replace("r2", H16, chain(5, seed=3))   # a big snapshot pushes out older entries
    assert len(idx) == 5 and idx.size_of("r0") == 0 and idx.size_of("r1") == 0


def test_a_replica_that_leaves_for_good_loses_its_view_a_blip_keeps_it():
    idx = PrefixIndex(100)
    a = chain(3)
    for rid in ("r0", "r1", "r2"):
        idx.replace(rid, H16, a)
    idx.drop("r0")                         # dropped (fault, silence): at once
    idx.depart("r1", until=10.0)           # its stream broke: kept for a lease
    idx.depart("r2", until=10.0)
    assert idx.matched_blocks(a, ["r0", "r1", "r2"]) == {"r0": 0, "r1": 3, "r2": 3}
    idx.replace("r2", H16, a[:1])          # came back in time: its new snapshot
    assert idx.expire(9.9) == []
    assert idx.expire(10.0) == ["r1"]
    assert idx.hashes_of("r1") == set() and idx.hashes_of("r2") == {a[0]} and len(idx) == 1
    assert idx.expire(99.0) == []          # r2 re-registered: no longer departed


def test_replicas_must_address_blocks_alike():
    idx = PrefixIndex(100)
    idx.replace("r0", H16, chain(1))
    with pytest.raises(HasherMismatch, match="block size 32.*'r0' uses block size 16"):
        idx.check_hasher("r1", BlockHasher(32))
    with pytest.raises(HasherMismatch, match="salt"):
        idx.replace("r1", BlockHasher(16, b"tenant"), ())
    idx.check_hasher("r0", BlockHasher(32))   # itself only: a restart with a new block size
    idx.replace("r0", BlockHasher(32), ())
    idx.drop("r0")
    assert idx.hasher is None
    idx.replace("r1", BlockHasher(8), ())     # nobody left to disagree with


def test_request_hashes_are_what_the_engine_would_reuse():
    """The router's hashes equal the engine block manager's, and leave out the
    block holding the last token, which the engine always computes."""
    bm = BlockManager(64, 16)
    for n in (15, 16, 17, 32, 33, 50):
        prompt = list(range(3, 3 + n))
        seq = Sequence("s", prompt, SamplingParams())
        engine_reusable = (seq.num_tokens - 1) // 16
        expected = bm._hashes(seq, engine_reusable)[:engine_reusable]
        assert context_hashes(Arrival(prompt, 4), bm.hasher) == expected, n


def test_request_hashes_are_cached_and_extended_for_output_so_far():
    prompt = list(range(40))
    work = Arrival(prompt, 8)
    first = context_hashes(work, H16)
    assert first == H16.hashes(prompt)[:2] and work.block_hashes == first
    work.tokens = list(range(100, 130))    # a requeued request brings its output
    assert context_hashes(work, H16) == H16.hashes(prompt + work.tokens)[:4]
    assert context_hashes(work, BlockHasher(8)) == BlockHasher(8).hashes(prompt + work.tokens)[:8]


def test_matcher_counts_tokens_and_stays_idle_without_any_cache():
    idx = PrefixIndex(100)
    matcher = PrefixMatcher(idx)
    work = Arrival(list(range(16 * 4 + 5)), 4)
    assert matcher.cached_tokens(work, ["r0"]) == {"r0": 0}
    assert work.block_hashes == [], "nothing is hashed while no replica reports a cache"
    idx.replace("r0", H16, H16.hashes(work.prompt_ids)[:3])
    assert matcher.cached_tokens(work, ["r0", "r1"]) == {"r0": 48, "r1": 0}
