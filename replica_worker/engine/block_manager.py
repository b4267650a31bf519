"""Paged KV cache bookkeeping: which physical blocks each sequence holds.

Invariants:
- every block is free, evictable (cached, held by nobody) or referenced
  (block_pool.py); free + evictable is what admission counts as available;
- a holding sequence's block_ids cover its KV cache: len(block_ids) * block_size
  >= num_computed_tokens (and >= whatever the scheduler promised this step);
- a block shared by several sequences is a full cached block that none of
  them writes: a sequence only ever writes tokens at or past the
  num_computed_tokens it was admitted with, and its shared blocks all lie before;
- free() returns every held reference; freeing twice, or freeing a block
  table the manager did not hand out, is an AssertionError (it would corrupt
  another sequence's cache, so it must never pass silently).

Prefix caching (on unless disabled): once a full block's tokens are computed
the block gets its content hash and stays cached after its sequences are
done, until its memory is needed (least recently released first). A newly
admitted sequence (a preempted or resumed one too) starts from its longest
chain of cached full blocks, num_computed_tokens = the cached tokens. Its last
known token is always computed, so that the step has logits to sample from;
a cached block holding that token is not reused, since its slot would be
written again while other sequences may read it (a context of an exact
multiple of the block size recomputes its last block).

Sliding windows (a model whose query at p sees only keys > p - W): a block
every later query of a sequence is past is given back while the sequence
runs (release_out_of_window), so a long sequence holds about W tokens of KV,
not its whole context. Its table entry then names the manager's null block, a
block taken once and never written (its KV stays zeros), so the attention
backends, which mask keys outside the window, never read another sequence's
live block through it. With prefix caching only blocks already cached are
given back; they stay cached (evictable) for later hits. A chunking scheduler
admits a windowed prompt with its first chunk's blocks only (allocate's
first_chunk) and appends each later chunk's, so a prompt longer than the cache
runs in about its window's blocks (peak_blocks).

Two variants, as in Sarathi-Serve's baselines:
- BlockManager allocates on demand: the current context at admission, then a
  block at a time as the sequence grows (vllm, sarathi, simple_chunking);
- ReservingBlockManager reserves the sequence's maximum length at admission
  (orca, faster_transformer), so a running sequence never needs a new block.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.block_hash import BlockHasher
from replica_worker.engine.block_pool import BlockPool
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.sequence import Sequence


@dataclass
class _Holding:
    block_ids: list[int]  # the very list handed to the sequence as seq.block_ids
    num_cached: int  # leading blocks already in the cache (hits, or cached once computed)
    num_released: int = 0  # leading blocks given back past the window (entries: the null block)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01,
        enable_prefix_caching: bool = True, hash_salt: bytes = b"", sliding_window: int | None = None,
    ) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        assert 0.0 <= watermark < 1.0, watermark
        assert sliding_window is None or sliding_window > 0, sliding_window
        assert sliding_window is None or num_blocks > 1, "a windowed cache needs a block besides the null block"
        self.block_size = block_size
        self._num_total_blocks = num_blocks - (1 if sliding_window else 0)  # the null block left out
        # Headroom kept free when admitting, so that admitting a prompt does not
        # immediately force running sequences' next decodes into preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(block_size, hash_salt)
        self._pool = BlockPool(num_blocks)
        self.sliding_window = sliding_window
        # Held for good (never freed, never cached, never written): what a
        # given-back entry of a block table names.
        self._null_block = self._pool.take(1)[0] if sliding_window else None
        self._holdings: dict[str, _Holding] = {}
        self._queries = 0
        self._hits = 0

    # ---- sizes ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks admission and growth may take: free ones and evictable cached ones."""
        return self._pool.num_available

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    @property
    def pool(self) -> BlockPool:
        """Read-only by convention: refcounts and cache state, for reports and tests."""
        return self._pool

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(num_tokens, 0) // self.block_size)

    def initial_num_tokens(self, seq: Sequence) -> int:
        """Tokens whose slots allocate() provides: the whole current context, so
        that every prefill chunk of it (including a recompute) needs no append."""
        return seq.num_tokens

    def initial_blocks(self, seq: Sequence) -> int:
        return self.blocks_needed(self.initial_num_tokens(seq))

    def is_allocated(self, seq: Sequence) -> bool:
        return seq.seq_id in self._holdings

    # ---- the prefix cache ----
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks allocate() would reuse for seq now: its longest
        cached chain of full blocks that ends before its last known token."""
        if not self.enable_prefix_caching:
            return []
        reusable = (seq.num_tokens - 1) // self.block_size
        return self._pool.lookup(self._hashes(seq, reusable)[:reusable])

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """What allocate() would set num_computed_tokens to, were seq admitted now."""
        return len(self.cached_prefix(seq)) * self.block_size

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes, extended to at least num_blocks full blocks. Tokens
        are only ever appended, so hashes once computed stay valid."""
        known = seq.block_hashes
        if len(known) < num_blocks:
            start = len(known) * self.block_size
            tokens = seq.token_ids[start : num_blocks * self.block_size]
            known.extend(self.hasher.hashes(tokens, parent=known[-1] if known else None))
        return known

    def cache_computed(self, seq: Sequence) -> None:
        """Gives seq's newly full, computed blocks their content addresses, so
        that later sequences (and this one after a preemption) can reuse them.
        The engine calls it once the step's KV is written."""
        holding = self._holdings.get(seq.seq_id)
        if not self.enable_prefix_caching or holding is None:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= holding.num_cached:
            return
        hashes = self._hashes(seq, full)
        for i in range(holding.num_cached, full):
            self._pool.cache(holding.block_ids[i], hashes[i])
        holding.num_cached = full

    # ---- admission ----
    def _admitted_blocks(self, seq: Sequence, hits: list[int], first_chunk: int | None) -> int:
        """Blocks seq holds once admitted: its whole initial context, or (first_chunk
        given) its cached prefix and that many tokens past it."""
        if first_chunk is None:
            return self.initial_blocks(seq)
        return max(len(hits), self.blocks_needed(len(hits) * self.block_size + first_chunk))

    def _out_of_window_hits(self, hits: list[int]) -> int:
        """Leading cached hits that no query of seq's first chunk can see (it starts
        after the hits; a query at p sees keys > p - W): with a window they are not
        taken back at all (their table entries name the null block, as
        release_out_of_window would make them). Taking them would hold a long
        cached chain that the window never needs, past what can_ever_fit planned
        for (peak_blocks), and a follow-up turn of a conversation would wait for
        ever on an idle engine."""
        if self.sliding_window is None or not hits:
            return 0
        return max(0, len(hits) * self.block_size - self.sliding_window + 1) // self.block_size

    def _blocks_taken(self, seq: Sequence, hits: list[int], first_chunk: int | None = None) -> int:
        """Available blocks that admitting seq uses up: new ones, and cached
        hits it holds that nobody held (they stop being evictable)."""
        held = hits[self._out_of_window_hits(hits):]
        evictable_hits = sum(1 for b in held if self._pool.is_evictable(b))
        return self._admitted_blocks(seq, hits, first_chunk) - len(hits) + evictable_hits

    def can_allocate(self, seq: Sequence, use_watermark: bool = True, first_chunk: int | None = None) -> bool:
        """use_watermark=False is for admitting into an otherwise idle cache,
        where there is no running sequence for the headroom to protect."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_blocks - self._blocks_taken(seq, self.cached_prefix(seq), first_chunk) >= reserve

    def allocate(self, seq: Sequence, first_chunk: int | None = None) -> None:
        """Blocks for seq's whole initial context, or (first_chunk given: a windowed
        prompt taken chunk by chunk, the scheduler appending before each later
        chunk) for its cached prefix and its first chunk. The cached prefix is
        reused and counts as computed."""
        assert not self.is_allocated(seq) and not seq.block_ids, f"{seq} already holds blocks"
        assert seq.num_computed_tokens == 0, f"allocate for a sequence with KV already: {seq}"
        hits = self.cached_prefix(seq)
        assert self._blocks_taken(seq, hits, first_chunk) <= self.num_free_blocks, \
            f"allocate without can_allocate: {seq}"
        skip = self._out_of_window_hits(hits)
        held = hits[skip:]
        for block_id in held:  # before take(), which could evict them otherwise
            self._pool.ref(block_id)
        seq.block_ids = [self._null_block] * skip + held + \
            self._pool.take(self._admitted_blocks(seq, hits, first_chunk) - len(hits))
        self._holdings[seq.seq_id] = _Holding(seq.block_ids, len(hits), num_released=skip)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self._queries += seq.num_tokens
            self._hits += seq.num_computed_tokens

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
        seq.block_ids.extend(self._pool.take(extra))

    # ---- release ----
    def release_out_of_window(self, seq: Sequence) -> int:
        """Gives back seq's leading blocks that no query from its next chunk on
        can see: that chunk starts at num_computed_tokens, and a query at p sees
        keys > p - W, so every block wholly before num_computed_tokens - W + 1.
        Call it when scheduling, before the step's inputs are built: steps
        launched before it read the blocks first (one stream runs steps in
        order), and a block taken by another sequence is written only after.
        Returns the number of blocks given back."""
        holding = self._holdings.get(seq.seq_id)
        if self.sliding_window is None or holding is None:
            return 0
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        until = max(0, first_visible) // self.block_size
        if self.enable_prefix_caching:
            until = min(until, holding.num_cached)  # cache_computed still hashes the rest
        start = holding.num_released
        if until <= start:
            return 0
        for i in range(start, until):
            self._pool.unref(holding.block_ids[i])
            holding.block_ids[i] = self._null_block
        holding.num_released = until
        return until - start

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence whose context reaches num_tokens holds at
        once, computed in chunks of at most max_chunk tokens. With a window, a
        chunk's queries see at most W - 1 keys before it, and blocks before those
        are given back (release_out_of_window), so a long context holds about W +
        max_chunk tokens, plus a partly visible block at each end. (Decodes are
        chunks of one.) With prefix caching only cached blocks go back, and a step's
        blocks are cached once it is done, a step late under async scheduling: the
        scheduler passes twice its step budget for that (BaseScheduler._peak_blocks)."""
        whole = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return whole
        return min(whole, self.blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks seq holds now (given-back entries left out)."""
        holding = self._holdings.get(seq.seq_id)
        return 0 if holding is None else len(holding.block_ids) - holding.num_released

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks; its computed full blocks stay cached. The
        tail goes first, so that eviction takes a chain's end before its start
        (a block is only reachable through its whole prefix)."""
        holding = self._holdings.get(seq.seq_id)
        assert holding is not None, f"double free (or never allocated): {seq}"
        assert seq.block_ids is holding.block_ids, f"{seq} holds a block table the manager did not hand out"
        self.cache_computed(seq)
        for block_id in reversed(holding.block_ids[holding.num_released:]):
            self._pool.unref(block_id)
        del self._holdings[seq.seq_id]
        seq.block_ids = []

    # ---- reports ----
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._pool.num_cached)

    def take_kv_events(self) -> KVCacheEvents:
        return self._pool.events.take()

    def cached_block_hashes(self) -> list[int]:
        return self._pool.cached_hashes()


class ReservingBlockManager(BlockManager):
    """Reserves a sequence's maximum length (prompt + max_tokens, capped at
    max_model_len) at admission. Nothing grows on demand, so there is nothing
    for a watermark to protect: it is 0, as in Sarathi-Serve's Orca manager."""

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int,
        enable_prefix_caching: bool = True, hash_salt: bytes = b"", sliding_window: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, 0.0, enable_prefix_caching, hash_salt, sliding_window)
        self.max_model_len = max_model_len

    def initial_num_tokens(self, seq: Sequence) -> int:
        max_tokens = seq.sampling_params.max_tokens
        longest = self.max_model_len
        if max_tokens is not None:
            longest = min(longest, seq.num_prompt_tokens + max_tokens)
        # Never less than the context already known (a resumed sequence).
        return max(longest, seq.num_tokens)
