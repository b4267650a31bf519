"""BlockManager with prefix caching: refcounts, reuse of the longest cached
chain, the last token always computed, LRU eviction of unreferenced blocks,
free-block accounting that counts evictable blocks, events, no leaks."""

from __future__ import annotations

import pytest

from common.block_hash import block_hashes
from replica_worker.engine.block_manager import BlockManager, ReservingBlockManager
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence

BS = 4


def seq_of(seq_id: str, tokens: list[int], max_tokens: int | None = 8, resume: list[int] | None = None) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens), resume_token_ids=resume)


def run(bm: BlockManager, seq: Sequence) -> Sequence:
    """Admits seq and computes its whole context, as the engine would."""
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed(seq)
    return seq


def assert_no_leak(bm: BlockManager) -> None:
    pool = bm.pool
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(pool.refcount(b) == 0 for b in range(bm.num_total_blocks))
    assert pool.num_evictable == pool.num_cached  # every cached block is unreferenced


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks of 4, then 2


def test_a_finished_sequences_full_blocks_stay_cached_and_are_reused():
    bm = BlockManager(16, BS, 0.0)
    a = run(bm, seq_of("a", PROMPT))
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.pool.num_cached == 3 and bm.pool.num_evictable == 3
    assert bm.num_free_blocks == 16, "evictable blocks count as available"
    b = seq_of("b", PROMPT[:12] + [7, 7, 7])
    assert bm.num_cached_prefix_tokens(b) == 12
    bm.allocate(b)
    assert b.block_ids[:3] == a_blocks[:3] and b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert len(b.block_ids) == 4 and b.block_ids[3] not in a_blocks[:3]
    assert [bm.pool.refcount(x) for x in b.block_ids] == [1, 1, 1, 1]
    stats = bm.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (14 + 15, 12)
    bm.free(b)
    assert_no_leak(bm)


def test_running_sequences_share_blocks_with_refcounts():
    bm = BlockManager(16, BS, 0.0)
    a = run(bm, seq_of("a", PROMPT))
    b = seq_of("b", PROMPT[:8] + [1, 2, 3])
    bm.allocate(b)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [bm.pool.refcount(x) for x in a.block_ids] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 16 - 4 - 1  # b took one new block only
    bm.free(a)
    assert [bm.pool.refcount(x) for x in b.block_ids] == [1, 1, 1]
    assert bm.pool.num_evictable == 1  # a's third block; its shared ones are still b's
    bm.free(b)
    assert_no_leak(bm)


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, BS, 0.0)
    bm.free(run(bm, seq_of("a", list(range(12)) + [50])))  # caches 3 blocks
    exact = seq_of("exact", list(range(12)))  # 3 full blocks, all cached
    # Reusing the third would rewrite its last slot, which other sequences may read.
    assert bm.num_cached_prefix_tokens(exact) == 8
    one_more = seq_of("one", list(range(13)))
    assert bm.num_cached_prefix_tokens(one_more) == 12  # one token left to compute
    single = seq_of("single", [0])
    assert bm.num_cached_prefix_tokens(single) == 0


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(16, BS, 0.0)
    a = seq_of("a", PROMPT)
    bm.allocate(a)
    a.num_computed_tokens = 7
    bm.cache_computed(a)
    assert bm.pool.num_cached == 1  # block 1 is not full of computed tokens yet
    a.num_computed_tokens = 14
    bm.cache_computed(a)
    assert bm.pool.num_cached == 3  # the trailing 2 tokens are no full block
    assert bm.cached_block_hashes() == block_hashes(PROMPT, BS)
    bm.free(a)
    assert_no_leak(bm)


def test_generated_tokens_fill_blocks_that_become_cached():
    bm = BlockManager(16, BS, 0.0)
    a = run(bm, seq_of("a", PROMPT[:6]))
    for token in (61, 62, 63):
        a.append_token(token)
        bm.append(a, 1)
        a.num_computed_tokens += 1
        bm.cache_computed(a)
    assert a.num_computed_tokens == 9
    assert bm.cached_block_hashes() == block_hashes(PROMPT[:6] + [61, 62], BS)
    bm.free(a)
    turn2 = seq_of("t2", PROMPT[:6] + [61, 62, 63, 9, 9])
    assert bm.num_cached_prefix_tokens(turn2) == 8


def test_lru_eviction_takes_the_least_recently_released_and_free_blocks_first():
    bm = BlockManager(6, BS, 0.0)
    old = run(bm, seq_of("old", [1] * 4 + [2]))  # 1 cached block + a partial one
    new = run(bm, seq_of("new", [3] * 4 + [4]))
    bm.free(old)
    bm.free(new)
    assert bm.pool.num_cached == 2 and bm.num_free_blocks == 6
    bm.take_kv_events()
    # 4 never-cached blocks go first; then the oldest release.
    big = run(bm, seq_of("big", [9] * 20))
    assert bm.num_cached_prefix_tokens(seq_of("x", [3] * 4 + [0])) == 4
    assert bm.num_cached_prefix_tokens(seq_of("y", [1] * 4 + [0])) == 0
    events = bm.take_kv_events()
    assert events.evicted == tuple(block_hashes([1] * 4, BS))
    assert set(events.stored) == set(block_hashes([9] * 20, BS)) - set(block_hashes([1] * 4, BS))
    bm.free(big)
    assert_no_leak(bm)


def test_a_chains_tail_is_evicted_before_its_head():
    bm = BlockManager(5, BS, 0.0)
    bm.free(run(bm, seq_of("a", list(range(16)) + [0])))  # 4 cached blocks and a free one
    bm.allocate(seq_of("b", [7] * 5))  # two blocks: the free one, then the chain's last
    assert bm.num_cached_prefix_tokens(seq_of("c", list(range(16)) + [1])) == 12


def test_a_hit_on_an_evictable_block_uses_up_availability():
    bm = BlockManager(5, BS, 0.0)
    bm.free(run(bm, seq_of("a", list(range(8)) + [0])))  # 2 evictable, 3 free
    again = seq_of("again", list(range(8)) + [5] * 9)  # 5 blocks, 2 of them hits
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert bm.num_free_blocks == 0 and again.num_computed_tokens == 8
    too_many = seq_of("more", list(range(8)) + [5] * 13)  # 6 blocks
    bm.free(again)
    assert not bm.can_allocate(too_many)


def test_shared_hits_need_fewer_free_blocks_and_the_watermark_still_holds():
    bm = BlockManager(10, BS, 0.2)  # 2 blocks of headroom
    a = run(bm, seq_of("a", list(range(16)) + [0]))  # 5 blocks, 4 cached and held
    b = seq_of("b", list(range(16)) + [1, 2, 3, 4, 5])  # 6 blocks, 4 held hits: 2 new
    assert bm.can_allocate(b)  # 5 available - 2 new >= 2 reserved
    c = seq_of("c", [9] * 13)  # 4 new blocks
    assert not bm.can_allocate(c) and bm.can_allocate(c, use_watermark=False)
    bm.allocate(b)
    assert bm.num_free_blocks == 3
    bm.free(a)
    bm.free(b)
    assert_no_leak(bm)


def test_duplicate_content_stays_uncached_and_is_freed():
    bm = BlockManager(8, BS, 0.0)
    a, b = seq_of("a", PROMPT[:8]), seq_of("b", PROMPT[:8])
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: both compute the same blocks
    for s in (a, b):
        s.num_computed_tokens = 8
        bm.cache_computed(s)
    assert bm.pool.num_cached == 2
    assert bm.cached_block_hashes() == block_hashes(PROMPT[:8], BS)
    bm.free(a)
    bm.free(b)
    assert bm.pool.num_evictable == 2 and bm.num_free_blocks == 8
    assert_no_leak(bm)


def test_preempted_and_resumed_sequences_reuse_prompt_and_output_blocks():
    bm = BlockManager(16, BS, 0.0)
    a = run(bm, seq_of("a", PROMPT[:6], resume=[70, 71, 72]))  # 9 known tokens
    bm.free(a)
    a.reset_for_recompute()
    bm.allocate(a)
    assert a.num_computed_tokens == 8 and a.num_cached_tokens == 0, "first admission's hits only"
    bm.free(a)
    migrated = seq_of("m", PROMPT[:6], resume=[70, 71, 72, 73])
    bm.allocate(migrated)
    assert migrated.num_computed_tokens == 8 == migrated.num_cached_tokens
    bm.free(migrated)
    assert_no_leak(bm)


def test_reserving_manager_reuses_the_prefix_and_reserves_the_rest():
    bm = ReservingBlockManager(16, BS, max_model_len=64)
    bm.free(run(bm, seq_of("a", PROMPT, max_tokens=2)))  # reserves 4 blocks, caches 3
    b = seq_of("b", PROMPT[:12] + [1], max_tokens=6)  # 19 tokens at most: 5 blocks
    bm.allocate(b)
    assert len(b.block_ids) == 5 and b.num_computed_tokens == 12
    assert bm.num_free_blocks == 16 - 5
    bm.free(b)
    assert_no_leak(bm)


def test_caching_off_reuses_nothing_and_reports_nothing():
    bm = BlockManager(16, BS, 0.0, enable_prefix_caching=False)
    bm.free(run(bm, seq_of("a", PROMPT)))
    b = seq_of("b", PROMPT)
    assert bm.num_cached_prefix_tokens(b) == 0
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.pool.num_cached == 0
    assert bm.prefix_cache_stats().queries == 0 and bm.take_kv_events().empty
    bm.free(b)
    assert_no_leak(bm)


def test_double_free_and_forged_tables_still_assert_with_shared_blocks():
    bm = BlockManager(8, BS, 0.0)
    a = run(bm, seq_of("a", PROMPT[:9]))
    b = seq_of("b", PROMPT[:9])
    bm.allocate(b)  # shares a's 2 cached blocks
    b.block_ids = list(b.block_ids)
    with pytest.raises(AssertionError):
        bm.free(b)
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(a)
