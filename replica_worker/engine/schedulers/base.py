"""The replica scheduler interface and the pieces every policy shares.

A step is "computed tokens catching up with known tokens": schedule() picks,
per sequence, how many of its uncomputed tokens to compute, and guarantees
each one's KV slots (len(seq.block_ids) * block_size >= num_computed_tokens +
num_tokens). The engine then advances num_computed_tokens, appends a
placeholder for the token sampled by chunks that reach the last known token,
and, once the sampled ids are back (with async scheduling, after the next
step was scheduled), fills it, calls cache_computed() (the step's full blocks
join the prefix cache) and free_finished(). A sequence's last known token may
thus be a placeholder when it is scheduled: only a decode reads it, and the
prefix cache never hashes a sequence's last token. A sequence admitted with a cached prefix starts with those
tokens computed, so its first chunk begins past them.

Ownership: a sequence is in exactly one of waiting / running from add_seq
until it finishes (free_finished, abort_seq, or ignored). Only running
sequences hold KV blocks. Preempted sequences stay here, back in waiting.

Ordering: sequences are ranked by add_seq order (FCFS). Admission is
head-of-line, so every waiting sequence that was never admitted ranks after
every running one; preempted ones are re-inserted by rank, i.e. at the front.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from replica_worker.engine.block_manager import BlockManager
from replica_worker.engine.config import CacheConfig, SchedulerConfig
from replica_worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the runner samples one more.
        Read it before the engine advances num_computed_tokens."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # prefills first, then decodes
    preempted: list[Sequence] = field(default_factory=list)  # recompute later; still owned
    ignored: list[Sequence] = field(default_factory=list)  # finished FINISHED_IGNORED, released

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.preempted or self.ignored)


# How many steps of prefill a replica takes in ahead. One is too few: the step that
# finishes the held work runs while the pull for the next request is still crossing
# the wire, so the following step has no prompt to chunk and its prefill budget goes
# unused. Two keeps the next step's prompt local while the refill is in flight, and
# binds work at most one step early.
ADMISSION_LOOKAHEAD_STEPS = 2


@dataclass(frozen=True)
class AdmissionCapacity:
    max_requests: int
    max_prompt_tokens: int


class _Step:
    """One step under construction; budget is the step's token limit."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens = 0
        self.prefills: list[ScheduledChunk] = []
        self.decodes: list[ScheduledChunk] = []
        self.preempted: list[Sequence] = []
        self.ignored: list[Sequence] = []
        self.scheduled: set[str] = set()
        # A running prompt's chunk found too few blocks: admission waits too, so
        # that later arrivals do not take the blocks it waits for.
        self.prefill_short_of_blocks = False

    @property
    def room(self) -> int:
        return self.budget - self.num_tokens

    def add(self, seq: Sequence, num_tokens: int) -> None:
        assert 0 < num_tokens <= min(self.room, seq.num_uncomputed_tokens), (seq, num_tokens, self.room)
        assert seq.seq_id not in self.scheduled, f"{seq} scheduled twice in a step"
        self.scheduled.add(seq.seq_id)
        chunk = ScheduledChunk(seq, num_tokens)
        (self.prefills if seq.in_prefill else self.decodes).append(chunk)
        self.num_tokens += num_tokens

    def output(self) -> SchedulerOutput:
        return SchedulerOutput(self.prefills + self.decodes, self.preempted, self.ignored)


class BaseScheduler:
    """Subclasses implement _schedule(step) from the helpers below."""

    # Whether the policy computes prompts in chunks (_admit_waiting and
    # _schedule_prefills with chunked=True). Then a windowed model's prompt takes
    # its blocks chunk by chunk (_grows_prefills): a prompt longer than the cache
    # runs in about its window's blocks.
    CHUNKS_PREFILLS = False

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
    ) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.sliding_window = sliding_window
        self.block_manager = self._make_block_manager(cache_config, num_blocks)
        self.budget = self._step_budget()
        self._grows_prefills = self.CHUNKS_PREFILLS and sliding_window is not None
        # Decodes cost a token each: capping concurrency at the budget keeps a
        # step of all decodes within it.
        self.max_num_seqs = min(scheduler_config.max_num_seqs, self._min_step_budget())
        # Longest context a single step may compute (vllm/orca/ft prefill whole).
        self.prompt_limit = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}
        self._rank: dict[str, int] = {}
        self._next_rank = 0

    # ---- subclass hooks ----
    def _make_block_manager(self, cache_config: CacheConfig, num_blocks: int) -> BlockManager:
        return BlockManager(num_blocks, cache_config.block_size, cache_config.watermark,
                            cache_config.enable_prefix_caching, sliding_window=self.sliding_window)

    def _step_budget(self) -> int:
        return self.config.max_num_batched_tokens or self.max_model_len

    def _min_step_budget(self) -> int:
        return self.budget

    def _schedule(self, step: _Step) -> None:
        raise NotImplementedError

    # ---- the interface ----
    def add_seq(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._seqs, f"duplicate seq_id {seq.seq_id!r}"
        assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq
        self._seqs[seq.seq_id] = seq
        self._rank[seq.seq_id] = self._next_rank
        self._next_rank += 1
        self.waiting.append(seq)

    def get_seq(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort_seq(self, seq_id: str) -> Sequence | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self._release(seq)
        if not seq.is_finished:
            seq.finish(SequenceStatus.FINISHED_ABORTED)
        return seq

    def cache_computed(self, seq: Sequence) -> None:
        """After the engine advanced seq.num_computed_tokens past written KV."""
        self.block_manager.cache_computed(seq)

    def free_finished(self, seq: Sequence) -> None:
        assert seq.is_finished, f"free_finished on an unfinished {seq}"
        if seq.seq_id in self._seqs:
            self._release(seq)

    def schedule(self) -> SchedulerOutput:
        if self.sliding_window is not None:
            # Before this step's admissions and growth, which may use what comes back.
            for seq in self.running:
                self.block_manager.release_out_of_window(seq)
        step = _Step(self.budget)
        self._schedule(step)
        for chunk in step.prefills + step.decodes:
            seq = chunk.seq
            assert len(seq.block_ids) * self.block_manager.block_size >= (
                seq.num_computed_tokens + chunk.num_tokens
            ), f"no KV slots for {chunk}"
            seq.mark_scheduled()
        return step.output()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """A sequence whose context reaches num_tokens can always be scheduled
        alone: admission skips the watermark when nothing else runs."""
        bm = self.block_manager
        return num_tokens <= self.prompt_limit and self._peak_blocks(num_tokens) <= bm.num_total_blocks

    def _peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence whose context reaches num_tokens holds at once.
        Growing chunk by chunk, it is bounded by its window (BlockManager.peak_blocks),
        at chunks of twice a step's budget: with async scheduling a step's full
        blocks are cached (and so can be given back) only after the next step is
        scheduled."""
        bm = self.block_manager
        if not self._grows_prefills:
            return bm.blocks_needed(num_tokens)
        return bm.peak_blocks(num_tokens, 2 * self.budget)

    def _admission_blocks(self, seq: Sequence) -> int:
        """Blocks seq takes when admitted (its first chunk's, when it grows)."""
        bm = self.block_manager
        whole = bm.initial_blocks(seq)
        return min(whole, bm.blocks_needed(self.budget) + 1) if self._grows_prefills else whole

    def admission_capacity(self) -> AdmissionCapacity:
        """What new requests could start now without queueing behind others:
        seats left, and cache tokens left after the watermark and after the
        blocks already-waiting sequences will take at admission.

        Tokens are also bounded by the prefill backlog, always: work that cannot
        start within ADMISSION_LOOKAHEAD_STEPS steps' token budgets would only
        wait here, bound too early, while another replica may be idle (late
        binding). A grant stays open at the router until it is used, so an
        unbounded grant made while idle would let the router pile later
        arrivals onto this replica however busy it had become. A prompt longer
        than the grant still comes: the router's last assignment of a grant
        may overrun its tokens (lua.POP).
        """
        bm = self.block_manager
        seats = self.max_num_seqs - len(self.running) - len(self.waiting)
        owed = sum(self._admission_blocks(seq) for seq in self.waiting)
        tokens = (bm.num_free_blocks - bm.watermark_blocks - owed) * bm.block_size
        tokens = min(tokens, max(seats, 0) * self.prompt_limit)
        tokens = min(tokens, ADMISSION_LOOKAHEAD_STEPS * self.budget - self.prefill_backlog())
        if seats <= 0 or tokens <= 0:
            return AdmissionCapacity(0, 0)
        return AdmissionCapacity(seats, tokens)

    def prefill_backlog(self) -> int:
        """Tokens still to prefill: waiting sequences and running ones mid-prompt."""
        return sum(s.num_uncomputed_tokens for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if s.in_prefill
        )

    # ---- helpers for policies ----
    def _rank_of(self, seq: Sequence) -> int:
        return self._rank[seq.seq_id]

    def _running_prefills(self) -> list[Sequence]:
        return sorted((s for s in self.running if s.in_prefill), key=self._rank_of)

    def _release(self, seq: Sequence) -> None:
        """Forget seq entirely: out of both queues, blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.block_manager.is_allocated(seq):
            self.block_manager.free(seq)
        del self._seqs[seq.seq_id]
        del self._rank[seq.seq_id]

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Recompute later: the sequence stays on this replica, ahead of new arrivals."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        bisect.insort(self.waiting, seq, key=self._rank_of)
        step.preempted.append(seq)

    def _never_fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        blocks = self._peak_blocks(seq.num_tokens) if self._grows_prefills else bm.initial_blocks(seq)
        return seq.num_tokens > self.prompt_limit or blocks > bm.num_total_blocks

    def _ignore_head(self, step: _Step) -> None:
        seq = self.waiting[0]
        self._release(seq)
        seq.finish(SequenceStatus.FINISHED_IGNORED)
        step.ignored.append(seq)

    def _schedule_decodes(self, step: _Step) -> list[Sequence]:
        """Gives every decoding running sequence one token, in rank order. When a
        decode cannot get a KV slot, the latest arrival not yet given one is
        preempted by recompute (possibly the decode itself).

        Sequences already in the step are left alone (neither decoded again
        nor preempted): a re-admission whose cached prefix leaves one token
        looks like a decode, and vllm and simple_chunking admit before decoding.

        A sequence whose last token is still in flight (async scheduling) is
        held as it is: it neither decodes nor is preempted.

        Returns the running sequences still in prefill (not scheduled here).
        Afterwards self.running holds the survivors, in rank order."""
        already = [s for s in self.running if s.seq_id in step.scheduled or s.last_token_in_flight]
        pending = sorted((s for s in self.running if s.seq_id not in step.scheduled and not s.last_token_in_flight),
                         key=self._rank_of)
        pending.reverse()  # pop() yields the earliest arrival; pending[0] is the tail
        kept: list[Sequence] = []
        prefilling: list[Sequence] = []
        while pending:
            seq = pending.pop()
            if seq.in_prefill:
                prefilling.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victims = pending if pending else prefilling
                if not victims:
                    break
                self._preempt(victims.pop(0) if victims is pending else victims.pop(), step)
            if not self.block_manager.can_append(seq):
                self._preempt(seq, step)
                continue
            kept.append(seq)
            if step.room >= 1:
                self.block_manager.append(seq)
                step.add(seq, 1)
        self.running = sorted(kept + prefilling + already, key=self._rank_of)
        return prefilling

    def _admit_waiting(self, step: _Step, chunked: bool) -> None:
        """Admits waiting sequences head-of-line while seats, budget and blocks
        allow, scheduling a prefill chunk (chunked) or the whole context of each."""
        bm = self.block_manager
        while self.waiting:
            seq = self.waiting[0]
            if self._never_fits(seq):
                self._ignore_head(step)
                continue
            if len(self.running) >= self.max_num_seqs:
                break
            if seq in step.preempted:  # its cached blocks must not bring it straight back
                break
            if step.prefill_short_of_blocks:  # head-of-line: the earlier prompt gets them first
                break
            # allocate() starts the sequence past its cached prefix.
            cached = bm.num_cached_prefix_tokens(seq)
            num_tokens = self._chunk(cached, seq.num_tokens, step) if chunked else seq.num_tokens - cached
            if num_tokens <= 0 or num_tokens > step.room:
                break
            first_chunk = num_tokens if self._grows_prefills else None
            if not bm.can_allocate(seq, use_watermark=bool(self.running), first_chunk=first_chunk):
                break
            self.waiting.pop(0)
            bm.allocate(seq, first_chunk)
            assert seq.num_computed_tokens == cached, (seq, cached)
            self.running.append(seq)
            step.add(seq, num_tokens)

    def _schedule_prefills(self, step: _Step, seqs: list[Sequence], chunked: bool) -> None:
        """Continues admitted prefills. Their blocks cover the whole context since
        allocate(), so no append is needed, except where prompts grow chunk by
        chunk (_grows_prefills): then each chunk's blocks are appended first."""
        for seq in seqs:
            if self._grows_prefills and seq not in self.running:
                continue  # preempted for an earlier sequence's chunk in this loop
            num_tokens = self._next_chunk(seq, step) if chunked else seq.num_uncomputed_tokens
            if not 0 < num_tokens <= step.room:
                continue
            if self._grows_prefills and not self._blocks_for_chunk(seq, num_tokens, step):
                step.prefill_short_of_blocks = True
                continue
            step.add(seq, num_tokens)

    def _blocks_for_chunk(self, seq: Sequence, num_tokens: int, step: _Step) -> bool:
        """Appends the blocks of seq's next chunk, preempting by recompute the
        latest arrivals after seq that this step has not scheduled (nor whose
        last token is in flight) while blocks are short. False: none to preempt,
        so seq's chunk waits for a later step (earlier sequences move on and give
        blocks back: their windows slide, or they finish)."""
        bm = self.block_manager
        while not bm.can_append(seq, num_tokens):
            victims = [s for s in self.running if s is not seq and s.seq_id not in step.scheduled
                       and not s.last_token_in_flight and self._rank_of(s) > self._rank_of(seq)]
            if not victims:
                return False
            victim = max(victims, key=self._rank_of)
            self.running.remove(victim)
            self._preempt(victim, step)
        bm.append(seq, num_tokens)
        return True

    def _next_chunk(self, seq: Sequence, step: _Step) -> int:
        return self._chunk(seq.num_computed_tokens, seq.num_tokens, step)

    def _chunk(self, num_computed: int, num_tokens: int, step: _Step) -> int:
        """The prefill chunk of a sequence with num_computed of num_tokens computed."""
        return min(num_tokens - num_computed, step.room)
