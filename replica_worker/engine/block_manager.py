"""Paged KV cache bookkeeping: which physical blocks each sequence holds.

Invariants:
- every block id is either on the free list or held by exactly one sequence;
- a holding sequence's block_ids cover its KV cache: len(block_ids) * block_size
  >= num_computed_tokens (and >= whatever the scheduler promised this step);
- free() returns every held block; freeing twice, or freeing blocks the manager
  did not hand out, is an AssertionError (it would corrupt another sequence's
  cache, so it must never pass silently).

Two variants, as in Sarathi-Serve's baselines:
- BlockManager allocates on demand: the current context at admission, then a
  block at a time as the sequence grows (vllm, sarathi, simple_chunking);
- ReservingBlockManager reserves the sequence's maximum length at admission
  (orca, faster_transformer), so a running sequence never needs a new block.
"""

from __future__ import annotations

from replica_worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        assert 0.0 <= watermark < 1.0, watermark
        self.block_size = block_size
        self._num_total_blocks = num_blocks
        # Headroom kept free when admitting, so that admitting a prompt does not
        # immediately force running sequences' next decodes into preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        # Popped from the end: a fresh manager hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._held: set[int] = set()
        self._holders: set[str] = set()

    # ---- sizes ----
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(num_tokens, 0) // self.block_size)

    def initial_num_tokens(self, seq: Sequence) -> int:
        """Tokens whose slots allocate() provides: the whole current context, so
        that every prefill chunk of it (including a recompute) needs no append."""
        return seq.num_tokens

    def initial_blocks(self, seq: Sequence) -> int:
        return self.blocks_needed(self.initial_num_tokens(seq))

    def is_allocated(self, seq: Sequence) -> bool:
        return seq.seq_id in self._holders

    # ---- admission ----
    def can_allocate(self, seq: Sequence, use_watermark: bool = True) -> bool:
        """use_watermark=False is for admitting into an otherwise idle cache,
        where there is no running sequence for the headroom to protect."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_blocks - self.initial_blocks(seq) >= reserve

    def allocate(self, seq: Sequence) -> None:
        assert not self.is_allocated(seq) and not seq.block_ids, f"{seq} already holds blocks"
        needed = self.initial_blocks(seq)
        assert needed <= self.num_free_blocks, f"allocate without can_allocate: {seq}"
        seq.block_ids = self._take(needed)
        self._holders.add(seq.seq_id)

    # ---- growth ----
    def _extra_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        target = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, target - len(seq.block_ids))

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self._extra_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Extends seq.block_ids to cover num_computed_tokens + num_new_tokens."""
        assert self.is_allocated(seq), f"append to a sequence without blocks: {seq}"
        extra = self._extra_blocks(seq, num_new_tokens)
        assert extra <= self.num_free_blocks, f"append without can_append: {seq}"
        seq.block_ids.extend(self._take(extra))

    # ---- release ----
    def free(self, seq: Sequence) -> None:
        assert self.is_allocated(seq), f"double free (or never allocated): {seq}"
        for block_id in seq.block_ids:
            assert block_id in self._held, f"block {block_id} of {seq} is not held"
            self._held.remove(block_id)
            self._free.append(block_id)
        self._holders.remove(seq.seq_id)
        seq.block_ids = []

    def _take(self, n: int) -> list[int]:
        taken = [self._free.pop() for _ in range(n)]
        self._held.update(taken)
        return taken


class ReservingBlockManager(BlockManager):
    """Reserves a sequence's maximum length (prompt + max_tokens, capped at
    max_model_len) at admission. Nothing grows on demand, so there is nothing
    for a watermark to protect: it is 0, as in Sarathi-Serve's Orca manager."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, watermark=0.0)
        self.max_model_len = max_model_len

    def initial_num_tokens(self, seq: Sequence) -> int:
        max_tokens = seq.sampling_params.max_tokens
        longest = self.max_model_len
        if max_tokens is not None:
            longest = min(longest, seq.num_prompt_tokens + max_tokens)
        # Never less than the context already known (a resumed sequence).
        return max(longest, seq.num_tokens)
