"""BlockManager: allocation covers the context, growth at block boundaries,
watermark on admission, no leaks, loud double frees."""

from __future__ import annotations

import pytest

from replica_worker.engine.block_manager import BlockManager, ReservingBlockManager
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence


def seq_of(seq_id: str, num_tokens: int, max_tokens: int | None = 16, resume: int = 0) -> Sequence:
    return Sequence(
        seq_id, list(range(num_tokens)), SamplingParams(max_tokens=max_tokens),
        resume_token_ids=[1] * resume,
    )


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, 4, 0.0)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_covers_whole_context_and_free_returns_every_block():
    bm = BlockManager(10, 4, 0.0)
    seq = seq_of("a", 9, resume=2)  # 11 known tokens
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_ids) == 3 and len(set(seq.block_ids)) == 3
    assert bm.num_free_blocks == 7 and bm.num_total_blocks == 10
    bm.free(seq)
    assert seq.block_ids == [] and bm.num_free_blocks == 10
    assert not bm.is_allocated(seq)


def test_append_adds_a_block_only_at_a_boundary():
    bm = BlockManager(4, 4, 0.0)
    seq = seq_of("a", 4)
    bm.allocate(seq)
    seq.num_computed_tokens = 3
    bm.append(seq, 1)  # slot 3 is inside block 0
    assert len(seq.block_ids) == 1
    seq.num_computed_tokens = 4
    assert bm.can_append(seq, 1)
    bm.append(seq, 1)  # slot 4 opens block 1
    assert len(seq.block_ids) == 2
    bm.append(seq, 5)  # slots 4..8 need 3 blocks in all
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 1
    assert bm.can_append(seq, 9)  # slots 4..12: one more block, the last free one
    assert not bm.can_append(seq, 13)  # slots 4..16: two more blocks
    bm.free(seq)
    assert bm.num_free_blocks == 4


def test_physical_ids_are_distinct_across_sequences():
    bm = BlockManager(6, 2, 0.0)
    seqs = [seq_of(str(i), 4) for i in range(3)]
    for s in seqs:
        bm.allocate(s)
    ids = [b for s in seqs for b in s.block_ids]
    assert sorted(ids) == list(range(6))
    assert not bm.can_allocate(seq_of("x", 1))


def test_watermark_holds_back_admission_but_not_growth():
    bm = BlockManager(100, 1, 0.1)  # 10 blocks of headroom
    assert bm.watermark_blocks == 10
    big = seq_of("big", 91)
    assert not bm.can_allocate(big)
    assert bm.can_allocate(big, use_watermark=False)
    fits = seq_of("fits", 90)
    assert bm.can_allocate(fits)
    bm.allocate(fits)
    fits.num_computed_tokens = 90
    assert bm.can_append(fits, 10)  # running sequences may use the headroom
    bm.append(fits, 10)
    assert bm.num_free_blocks == 0
    bm.free(fits)
    assert bm.num_free_blocks == 100


def test_double_free_and_double_allocate_are_assertion_errors():
    bm = BlockManager(4, 4, 0.0)
    seq = seq_of("a", 5)
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)
    bm.free(seq)
    with pytest.raises(AssertionError):
        bm.free(seq)
    with pytest.raises(AssertionError):
        bm.free(seq_of("never", 3))
    assert bm.num_free_blocks == 4


def test_freeing_a_forged_block_table_is_caught():
    bm = BlockManager(4, 4, 0.0)
    a, b = seq_of("a", 4), seq_of("b", 4)
    bm.allocate(a)
    bm.allocate(b)
    b.block_ids = list(a.block_ids)
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(b)


def test_allocate_or_append_beyond_free_blocks_asserts():
    bm = BlockManager(2, 4, 0.0)
    with pytest.raises(AssertionError):
        bm.allocate(seq_of("a", 9))
    seq = seq_of("b", 8)
    bm.allocate(seq)
    seq.num_computed_tokens = 8
    with pytest.raises(AssertionError):
        bm.append(seq, 1)


def test_reserving_manager_reserves_maximum_length_without_watermark():
    bm = ReservingBlockManager(64, 4, max_model_len=100)
    assert bm.watermark_blocks == 0
    short = seq_of("a", 10, max_tokens=6)  # 16 tokens at most
    assert bm.initial_blocks(short) == 4
    unbounded = seq_of("b", 10, max_tokens=None)  # max_model_len
    assert bm.initial_blocks(unbounded) == 25
    capped = seq_of("c", 90, max_tokens=50)  # capped at max_model_len
    assert bm.initial_blocks(capped) == 25
    bm.allocate(short)
    short.num_computed_tokens = 15
    bm.append(short, 1)  # within the reservation: no new block
    assert len(short.block_ids) == 4 and bm.num_free_blocks == 60
    bm.free(short)
    assert bm.num_free_blocks == 64


# ---- sliding windows: blocks no later query can see go back ----
def _advance(bm: BlockManager, seq: Sequence, tokens: int) -> None:
    """As the engine does: slots first, then the tokens computed and cached."""
    bm.append(seq, tokens)
    seq.num_computed_tokens += tokens
    bm.cache_computed(seq)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_window_gives_back_blocks_before_the_next_chunks_first_visible_key(prefix_caching):
    # Window 8, blocks of 4: a chunk starting at p sees keys from p - 7 on.
    bm = BlockManager(12, 4, 0.0, enable_prefix_caching=prefix_caching, sliding_window=8)
    assert bm.num_total_blocks == 11 and bm.num_free_blocks == 11  # the null block is nobody's
    seq = seq_of("a", 12)
    bm.allocate(seq)
    _advance(bm, seq, 12)
    # Next chunk at 12 sees 5..: block 0 (keys 0-3) is past, block 1 (4-7) is not.
    assert bm.release_out_of_window(seq) == 1
    null = seq.block_ids[0]
    assert bm.num_held_blocks(seq) == 2 and bm.num_free_blocks == 11 - 2
    assert bm.release_out_of_window(seq) == 0  # nothing more until the chunk start moves
    for _ in range(5):
        _advance(bm, seq, 1)  # decodes to 17: sees 10.., so block 1 goes too
    assert bm.release_out_of_window(seq) == 1
    assert seq.block_ids[:2] == [null, null] and bm.num_held_blocks(seq) == 3
    assert null not in seq.block_ids[2:]
    bm.free(seq)
    assert bm.num_free_blocks == 11 and seq.block_ids == []


def test_window_gives_back_only_cached_blocks_and_they_serve_later_hits():
    bm = BlockManager(12, 4, 0.0, sliding_window=4)
    seq = seq_of("a", 16)
    bm.allocate(seq)
    seq.num_computed_tokens = 16  # computed, but cache_computed has not run yet
    assert bm.release_out_of_window(seq) == 0, "an uncached block went back before it was hashed"
    bm.cache_computed(seq)
    assert bm.release_out_of_window(seq) == 3  # the chunk at 16 sees 13..
    assert bm.pool.num_evictable == 3  # still cached, held by nobody
    twin = seq_of("b", 16)
    assert bm.num_cached_prefix_tokens(twin) == 12  # the whole chain up to the last block
    bm.free(seq)
    bm.allocate(twin)
    assert twin.num_computed_tokens == 12
    bm.free(twin)
    assert bm.num_free_blocks == 11


def test_no_window_takes_no_null_block():
    bm = BlockManager(4, 4, 0.0)
    seq = seq_of("a", 16)
    bm.allocate(seq)
    seq.num_computed_tokens = 16
    bm.cache_computed(seq)
    assert bm.num_total_blocks == 4 and bm.release_out_of_window(seq) == 0 and bm.num_held_blocks(seq) == 4
