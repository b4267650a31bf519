"""Replica schedulers against a simulated engine loop (no model).

The loop does what the engine core does after the runner: advance
num_computed_tokens by each chunk, append a fake token when the chunk
reaches the last known token, finish at max_tokens / max_model_len and call
free_finished. Every step is checked against the scheduler's invariants.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from replica_worker.engine.config import CacheConfig, SchedulerConfig
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers import SCHEDULERS, AdmissionCapacity, make_scheduler
from replica_worker.engine.schedulers.base import ADMISSION_LOOKAHEAD_STEPS, BaseScheduler, SchedulerOutput
from replica_worker.engine.sequence import Sequence, SequenceStatus

ALL = sorted(SCHEDULERS)
ON_DEMAND = ["sarathi", "simple_chunking", "vllm"]  # can preempt; orca/ft reserve
MAX_MODEL_LEN = 256
BLOCK = 4


def seq_of(seq_id: str, prompt_len: int, max_tokens: int | None = 8, resume: int = 0) -> Sequence:
    return Sequence(
        seq_id, [3] * prompt_len, SamplingParams(max_tokens=max_tokens), resume_token_ids=[5] * resume
    )


def sched_of(name: str, num_blocks: int = 256, watermark: float = 0.0, prefix_caching: bool = True,
             **kw) -> BaseScheduler:
    kw.setdefault("chunk_size", 32)
    kw.setdefault("max_num_batched_tokens", 128)
    kw.setdefault("max_num_seqs", 8)
    return make_scheduler(
        SchedulerConfig(name=name, **kw),
        CacheConfig(block_size=BLOCK, watermark=watermark, enable_prefix_caching=prefix_caching),
        num_blocks,
        MAX_MODEL_LEN,
    )


@dataclass
class Trace:
    outputs: list[SchedulerOutput] = field(default_factory=list)
    # per step: (seq_id, num_tokens, was_prefill) as scheduled
    steps: list[list[tuple[str, int, bool]]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_preempted(self) -> int:
        return sum(len(o.preempted) for o in self.outputs)


def check_invariants(sched: BaseScheduler, out: SchedulerOutput) -> None:
    bm = sched.block_manager
    seen = set()
    prefill_done = False
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.seq_id not in seen, "a sequence twice in one step"
        seen.add(seq.seq_id)
        assert 0 < chunk.num_tokens <= seq.num_uncomputed_tokens
        assert len(seq.block_ids) * bm.block_size >= seq.num_computed_tokens + chunk.num_tokens
        written = seq.block_ids[seq.num_computed_tokens // bm.block_size:
                                bm.blocks_needed(seq.num_computed_tokens + chunk.num_tokens)]
        for block_id in written:
            assert bm.pool.refcount(block_id) == 1 and not bm.pool.is_cached(block_id), "writes a shared block"
        assert seq.status is SequenceStatus.RUNNING and seq in sched.running
        if seq.in_prefill:
            assert not prefill_done, "prefill chunk after a decode"
        else:
            prefill_done = True
    assert not seen & {s.seq_id for s in out.preempted}, "preempted and scheduled in one step"
    assert out.num_batched_tokens <= sched.budget
    assert len(sched.running) <= sched.max_num_seqs
    for seq in sched.waiting:
        assert seq.block_ids == [] and seq.num_computed_tokens == 0
    for seq in out.ignored:
        assert seq.status is SequenceStatus.FINISHED_IGNORED and sched.get_seq(seq.seq_id) is None
    holders: dict[int, int] = {}
    for seq in sched.running:
        for block_id in seq.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    assert len(holders) + bm.num_free_blocks == bm.num_total_blocks, "leaked or double-counted blocks"
    for block_id, n in holders.items():
        assert bm.pool.refcount(block_id) == n, f"block {block_id}: refcount is not its holders"
    cap = sched.admission_capacity()
    assert cap.max_requests >= 0 and cap.max_prompt_tokens >= 0


def advance(sched: BaseScheduler, out: SchedulerOutput, trace: Trace) -> None:
    """What the engine core does with a step's results."""
    trace.steps.append([(c.seq.seq_id, c.num_tokens, c.seq.in_prefill) for c in out.chunks])
    trace.outputs.append(out)
    for chunk in out.chunks:
        seq = chunk.seq
        samples = chunk.samples
        seq.num_computed_tokens += chunk.num_tokens
        sched.cache_computed(seq)
        if not samples:
            continue
        seq.append_token(7)
        max_tokens = seq.sampling_params.max_tokens
        if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= MAX_MODEL_LEN:
            seq.finish(SequenceStatus.FINISHED_LENGTH)
            sched.free_finished(seq)
            trace.finished.append(seq)


def simulate(
    sched: BaseScheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 5000, trace: Trace | None = None
) -> Trace:
    trace = trace or Trace()
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            sched.add_seq(seq)
        if not sched.has_unfinished and step > max(arrivals, default=0):
            return trace
        out = sched.schedule()
        check_invariants(sched, out)
        advance(sched, out, trace)
    raise AssertionError(f"did not finish in {max_steps} steps: {sched.running} {sched.waiting}")


def assert_drained(sched: BaseScheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished and sched.num_running == 0 and sched.num_waiting == 0
    assert bm.num_free_blocks == bm.num_total_blocks


def random_workload(rng: random.Random, n: int, max_prompt: int = 90) -> dict[int, list[Sequence]]:
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(n):
        resume = rng.choice([0, 0, 0, 3])  # migrated requests arrive with output
        seq = seq_of(f"r{i}", rng.randint(1, max_prompt), max_tokens=rng.randint(resume + 1, 24), resume=resume)
        arrivals.setdefault(rng.randint(0, 40), []).append(seq)
    return arrivals


# ---- every scheduler ----
# Every test prompt is the same token repeated, so with the prefix cache on
# most admissions hit (and share blocks) while the cache is under pressure.
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("num_blocks", [256, 40])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_random_workload_completes_without_leaks(name, num_blocks, prefix_caching):
    rng = random.Random(1234)
    arrivals = random_workload(rng, 40)
    seqs = [s for batch in arrivals.values() for s in batch]
    sched = sched_of(name, num_blocks=num_blocks, watermark=0.05, prefix_caching=prefix_caching)
    trace = simulate(sched, arrivals)
    assert_drained(sched)
    assert sorted(s.seq_id for s in trace.finished) == sorted(s.seq_id for s in seqs)
    for seq in seqs:
        assert seq.num_output_tokens == seq.sampling_params.max_tokens
        assert seq.num_new_output_tokens == seq.sampling_params.max_tokens - seq.num_resumed_tokens
        assert seq.status is SequenceStatus.FINISHED_LENGTH


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_randomized_configs_with_aborts_never_leak_or_stall(name, prefix_caching):
    rng = random.Random(99)
    for _ in range(15):
        sched = sched_of(
            name, num_blocks=rng.choice([24, 40, 256]), watermark=rng.choice([0.0, 0.1]),
            chunk_size=rng.choice([8, 32]), max_num_seqs=rng.choice([1, 4, 16]), prefix_caching=prefix_caching,
        )
        arrivals = random_workload(rng, rng.randint(1, 25), max_prompt=rng.choice([20, 90]))
        trace = Trace()
        for step in range(5000):
            for seq in arrivals.get(step, []):
                sched.add_seq(seq)
            if rng.random() < 0.02 and sched.has_unfinished:
                victim = rng.choice(sched.running + sched.waiting)
                assert sched.abort_seq(victim.seq_id) is victim and victim.block_ids == []
            if not sched.has_unfinished and step > max(arrivals):
                break
            out = sched.schedule()
            check_invariants(sched, out)
            advance(sched, out, trace)
        assert_drained(sched)
        for seq in (s for batch in arrivals.values() for s in batch):
            if seq.status is SequenceStatus.FINISHED_IGNORED:  # only what the engine would refuse
                longest = min(MAX_MODEL_LEN, seq.num_prompt_tokens + seq.sampling_params.max_tokens)
                assert not sched.can_ever_fit(longest)
            else:
                assert seq.status in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("name", ALL)
def test_first_scheduled_in_arrival_order(name):
    seqs = [seq_of(f"s{i}", 20 + 7 * (i % 3), max_tokens=4) for i in range(12)]
    sched = sched_of(name, num_blocks=64)
    trace = simulate(sched, {0: seqs})
    first_step = {}
    for i, step in enumerate(trace.steps):
        for seq_id, _, _ in step:
            first_step.setdefault(seq_id, i)
    order = [first_step[s.seq_id] for s in seqs]
    assert order == sorted(order)
    assert_drained(sched)


@pytest.mark.parametrize("name", ON_DEMAND)
def test_small_cache_preempts_and_preempted_sequences_complete(name):
    # 12 blocks of 4 tokens; four sequences that each grow to 9 blocks.
    seqs = [seq_of(f"p{i}", 12, max_tokens=24) for i in range(4)]
    sched = sched_of(name, num_blocks=12)
    trace = simulate(sched, {0: seqs})
    assert trace.num_preempted > 0
    assert_drained(sched)
    assert all(s.num_output_tokens == 24 for s in seqs)
    preempted = {s.seq_id for o in trace.outputs for s in o.preempted}
    # Preempted from the tail: the first arrival is never the victim.
    assert "p0" not in preempted
    assert all(s.num_preemptions > 0 for s in seqs if s.seq_id in preempted)


@pytest.mark.parametrize("name", ON_DEMAND)
def test_preempted_sequence_stays_local_and_keeps_first_scheduled_time(name):
    seqs = [seq_of(f"p{i}", 12, max_tokens=24) for i in range(3)]
    sched = sched_of(name, num_blocks=10)
    trace = Trace()
    for seq in seqs:
        sched.add_seq(seq)
    victim = None
    for _ in range(200):
        out = sched.schedule()
        check_invariants(sched, out)
        if out.preempted:
            victim = out.preempted[0]
            break
        advance(sched, out, trace)
    assert victim is not None
    first = victim.times.first_scheduled
    assert sched.get_seq(victim.seq_id) is victim and victim in sched.waiting
    assert sched.waiting[0] is victim, "preempted sequences go to the front of waiting"
    assert victim.status is SequenceStatus.WAITING and victim.block_ids == []
    advance(sched, out, trace)
    simulate(sched, {}, trace=trace)
    assert victim.times.first_scheduled == first
    assert victim.num_output_tokens == 24
    assert_drained(sched)


@pytest.mark.parametrize("name", ALL)
def test_abort_mid_generation_frees_blocks(name):
    a, b = seq_of("a", 30, max_tokens=50), seq_of("b", 10, max_tokens=50)
    sched = sched_of(name, num_blocks=64)
    sched.add_seq(a)
    sched.add_seq(b)
    trace = Trace()
    for _ in range(6):
        out = sched.schedule()
        check_invariants(sched, out)
        advance(sched, out, trace)
    assert a.num_output_tokens > 0 and a.block_ids
    assert sched.abort_seq("a") is a
    assert a.status is SequenceStatus.FINISHED_ABORTED and a.block_ids == []
    assert sched.get_seq("a") is None and sched.abort_seq("a") is None
    assert sched.abort_seq("nobody") is None
    # A waiting one too.
    c = seq_of("c", 5)
    sched.add_seq(c)
    assert sched.abort_seq("c") is c and c.status is SequenceStatus.FINISHED_ABORTED
    simulate(sched, {}, trace=trace)
    assert b.num_output_tokens == 50
    assert_drained(sched)


@pytest.mark.parametrize("name", ALL)
def test_sequences_that_can_never_run_are_ignored(name):
    too_long = seq_of("long", MAX_MODEL_LEN + 1)
    too_big = seq_of("big", 100, max_tokens=4)  # 25+ blocks of a 20-block cache
    ok = seq_of("ok", 10, max_tokens=4)
    sched = sched_of(name, num_blocks=20, max_num_batched_tokens=MAX_MODEL_LEN)
    assert not sched.can_ever_fit(MAX_MODEL_LEN + 1)
    assert not sched.can_ever_fit(81) and sched.can_ever_fit(80)
    trace = simulate(sched, {0: [too_long, too_big, ok]})
    ignored = [s.seq_id for o in trace.outputs for s in o.ignored]
    assert ignored == ["long", "big"]
    assert too_long.status is SequenceStatus.FINISHED_IGNORED and too_big.block_ids == []
    assert ok.num_output_tokens == 4
    assert_drained(sched)


@pytest.mark.parametrize("name", ALL)
def test_admission_capacity_reaches_zero_and_recovers(name):
    sched = sched_of(name, num_blocks=32, max_num_seqs=4, chunk_size=128)
    assert sched.admission_capacity() == AdmissionCapacity(4, 32 * BLOCK)
    seqs = [seq_of(f"c{i}", 20, max_tokens=6) for i in range(4)]
    for seq in seqs[:2]:
        sched.add_seq(seq)
    cap = sched.admission_capacity()
    owed = sum(sched.block_manager.initial_blocks(s) for s in seqs[:2])
    backlog = 40  # two waiting prompts of 20 tokens
    assert cap == AdmissionCapacity(2, min((32 - owed) * BLOCK, ADMISSION_LOOKAHEAD_STEPS * sched.budget - backlog))
    for seq in seqs[2:]:
        sched.add_seq(seq)
    assert sched.admission_capacity() == AdmissionCapacity(0, 0)  # no seats
    trace = simulate(sched, {})
    assert_drained(sched)
    assert sched.admission_capacity() == AdmissionCapacity(4, 32 * BLOCK)
    assert len(trace.finished) == 4


@pytest.mark.parametrize("name", ALL)
def test_admission_capacity_is_bounded_by_the_prefill_backlog(name):
    sched = sched_of(name, num_blocks=512, max_num_seqs=8)
    idle = sched.admission_capacity()
    # Even idle, the grant is a few steps of prefill (the router may overrun it by one prompt).
    assert idle.max_prompt_tokens == ADMISSION_LOOKAHEAD_STEPS * sched.budget
    sched.add_seq(seq_of("long", sched.budget, max_tokens=4))
    if ADMISSION_LOOKAHEAD_STEPS > 1:
        assert sched.admission_capacity().max_prompt_tokens == (ADMISSION_LOOKAHEAD_STEPS - 1) * sched.budget
    sched.add_seq(seq_of("long2", (ADMISSION_LOOKAHEAD_STEPS - 1) * sched.budget, max_tokens=4))
    assert sched.admission_capacity() == AdmissionCapacity(0, 0), "the lookahead's steps of prefill wait"
    simulate(sched, {})
    assert sched.admission_capacity() == idle


def test_admission_capacity_is_zero_when_the_cache_is_full():
    sched = sched_of("sarathi", num_blocks=16, watermark=0.25, max_num_seqs=8)  # 4 blocks headroom
    sched.add_seq(seq_of("big", 48, max_tokens=4))  # 12 blocks owed
    assert sched.admission_capacity() == AdmissionCapacity(0, 0)
    sched.schedule()  # admitted: blocks held rather than owed
    assert sched.admission_capacity() == AdmissionCapacity(0, 0)
