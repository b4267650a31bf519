"""What distinguishes each replica scheduler, step by step."""

from __future__ import annotations

import pytest

from replica_worker.engine.config import CacheConfig, SchedulerConfig
from replica_worker.engine.schedulers import make_scheduler
from replica_worker.engine.schedulers.sarathi import SarathiScheduler, chunk_size_schedule
from tests.engine.test_schedulers import (
    MAX_MODEL_LEN,
    Trace,
    advance,
    assert_drained,
    check_invariants,
    seq_of,
    simulate,
)
from tests.engine.test_schedulers import sched_of as _sched_of


def sched_of(name: str, **kw):
    """Policies compared without cache hits (every test prompt is the same
    tokens); tests/engine/test_prefix_cache_scheduling.py covers hits."""
    return _sched_of(name, prefix_caching=False, **kw)


def run_steps(sched, n: int, trace: Trace | None = None) -> Trace:
    trace = trace or Trace()
    for _ in range(n):
        out = sched.schedule()
        check_invariants(sched, out)
        advance(sched, out, trace)
    return trace


def kinds(step: list[tuple[str, int, bool]]) -> set[str]:
    return {"prefill" if prefill else "decode" for _, _, prefill in step}


# ---- sarathi ----
def test_sarathi_splits_a_long_prompt_into_chunks():
    sched = sched_of("sarathi", chunk_size=32)
    seq = seq_of("long", 100, max_tokens=3)
    trace = simulate(sched, {0: [seq]})
    assert [n for step in trace.steps for _, n, _ in step] == [32, 32, 32, 4, 1, 1]
    assert seq.times.first_token is not None and seq.num_output_tokens == 3
    assert_drained(sched)


def test_sarathi_schedules_decodes_first_and_fills_the_rest_with_a_chunk():
    sched = sched_of("sarathi", chunk_size=32)
    decoders = [seq_of(f"d{i}", 4, max_tokens=20) for i in range(3)]
    for seq in decoders:
        sched.add_seq(seq)
    trace = run_steps(sched, 1)  # all three prefilled together (12 tokens)
    assert all(not s.in_prefill for s in decoders)
    late = seq_of("late", 100, max_tokens=2)
    sched.add_seq(late)
    trace = run_steps(sched, 3, trace)
    for step in trace.steps[1:]:
        decodes = [n for _, n, prefill in step if not prefill]
        prefills = [(sid, n) for sid, n, prefill in step if prefill]
        assert decodes == [1, 1, 1], "no decode stalls while a long prompt prefills"
        assert prefills == [("late", 29)], "the chunk takes what the decodes leave"
        assert step[0][2], "prefills come first in the batch"


def test_sarathi_continues_running_prefills_before_admitting():
    sched = sched_of("sarathi", chunk_size=32)
    a, b = seq_of("a", 50, max_tokens=1), seq_of("b", 50, max_tokens=1)
    sched.add_seq(a)
    sched.add_seq(b)
    trace = run_steps(sched, 2)
    assert trace.steps[0] == [("a", 32, True)]
    assert trace.steps[1] == [("a", 18, True), ("b", 14, True)]


def test_dynamic_chunk_schedule_shrinks_chunks_as_prefill_grows():
    assert chunk_size_schedule(32, 128, 4) == [128, 96, 64, 32]
    sched = make_scheduler(
        SchedulerConfig(
            name="sarathi", enable_dynamic_chunking_schedule=True, low_chunk_size=32,
            high_chunk_size=128, chunk_schedule_max_tokens=512, chunk_schedule_stages=4,
        ),
        CacheConfig(block_size=4, watermark=0.0), 1024, 2048,
    )
    assert isinstance(sched, SarathiScheduler) and sched.budget == 128
    assert sched.max_num_seqs == 32  # a step of all decodes fits the smallest stage
    seq = seq_of("long", 1000, max_tokens=1)
    trace = simulate(sched, {0: [seq]})
    chunks = [n for step in trace.steps for _, n, _ in step]
    # Stage = computed // 128: 0 -> 128 | 128, 224 -> 96 | 320 -> 64 | 384.. -> 32
    assert chunks[:5] == [128, 96, 96, 64, 32]
    assert set(chunks[5:-1]) == {32} and sum(chunks) == 1000
    assert chunks == sorted(chunks, reverse=True)


# ---- vllm ----
def test_vllm_never_mixes_prefills_and_decodes_and_prioritises_prefills():
    sched = sched_of("vllm", max_num_batched_tokens=64)
    arrivals = {0: [seq_of("a", 10, max_tokens=10)], 3: [seq_of("b", 40, max_tokens=10)],
                4: [seq_of("c", 30, max_tokens=10), seq_of("d", 40, max_tokens=10)]}
    trace = simulate(sched, arrivals)
    assert all(len(kinds(step)) == 1 for step in trace.steps)
    assert trace.steps[3] == [("b", 40, True)]  # decodes of "a" wait a step
    assert trace.steps[4] == [("c", 30, True)]  # "d" would exceed 64 tokens
    assert trace.steps[5] == [("d", 40, True)]
    assert_drained(sched)


def test_vllm_schedules_whole_prompts_only():
    sched = sched_of("vllm", max_num_batched_tokens=128)
    seq = seq_of("a", 100, max_tokens=2)
    trace = simulate(sched, {0: [seq]})
    assert trace.steps[0] == [("a", 100, True)]


# ---- orca ----
def test_orca_mixes_whole_prefills_with_decodes():
    sched = sched_of("orca", max_num_batched_tokens=64)
    a, b = seq_of("a", 10, max_tokens=10), seq_of("b", 20, max_tokens=10)
    trace = simulate(sched, {0: [a], 2: [b]})
    assert trace.steps[2] == [("b", 20, True), ("a", 1, False)]
    assert_drained(sched)


def test_orca_reserves_maximum_length_so_small_caches_never_preempt():
    sched = sched_of("orca", num_blocks=12)
    seqs = [seq_of(f"o{i}", 12, max_tokens=24) for i in range(4)]  # 9 blocks each, reserved
    trace = simulate(sched, {0: seqs})
    assert trace.num_preempted == 0
    assert max(len(step) for step in trace.steps) == 1  # one reservation fits at a time
    assert_drained(sched)


# ---- faster_transformer ----
def test_faster_transformer_admits_a_new_batch_only_when_nothing_runs():
    sched = sched_of("faster_transformer", max_num_seqs=8)
    first = [seq_of("a", 10, max_tokens=3), seq_of("b", 10, max_tokens=6)]
    late = seq_of("late", 10, max_tokens=2)
    trace = simulate(sched, {0: first, 1: [late]})
    assert trace.steps[0] == [("a", 10, True), ("b", 10, True)]
    late_step = next(i for i, step in enumerate(trace.steps) if ("late", 10, True) in step)
    last_b = max(i for i, step in enumerate(trace.steps) if any(sid == "b" for sid, _, _ in step))
    assert late_step == last_b + 1
    assert_drained(sched)


# ---- simple_chunking ----
def test_simple_chunking_alternates_prefill_and_decode_turns():
    sched = sched_of("simple_chunking", chunk_size=32)
    a = seq_of("a", 8, max_tokens=30)
    sched.add_seq(a)
    trace = run_steps(sched, 2)  # a's prefill, then its decode
    b = seq_of("b", 70, max_tokens=2)
    sched.add_seq(b)
    trace = run_steps(sched, 6, trace)
    assert all(len(kinds(step)) == 1 for step in trace.steps)
    assert [kinds(step).pop() for step in trace.steps[2:8]] == [
        "prefill", "decode", "prefill", "decode", "prefill", "decode",
    ]
    assert [n for sid, n, _ in trace.steps[2] + trace.steps[4] + trace.steps[6]] == [32, 32, 6]


def test_simple_chunking_never_idles_when_only_one_kind_of_work_exists():
    sched = sched_of("simple_chunking", chunk_size=32)
    trace = simulate(sched, {0: [seq_of("a", 8, max_tokens=5)]})
    assert all(step for step in trace.steps)
    assert len(trace.steps) == 5  # one prefill, four decodes


# ---- shared limits ----
@pytest.mark.parametrize("name", ["sarathi", "vllm", "orca", "faster_transformer", "simple_chunking"])
def test_max_num_seqs_bounds_running(name):
    sched = sched_of(name, max_num_seqs=3)
    seqs = [seq_of(f"m{i}", 5, max_tokens=4) for i in range(7)]
    trace = simulate(sched, {0: seqs})
    assert max(len({sid for sid, _, _ in step}) for step in trace.steps) <= 3
    assert_drained(sched)


def test_resumed_sequence_prefills_its_whole_context():
    sched = sched_of("sarathi", chunk_size=64)
    seq = seq_of("r", 20, max_tokens=8, resume=5)
    trace = simulate(sched, {0: [seq]})
    assert trace.steps[0] == [("r", 25, True)]
    assert seq.num_output_tokens == 8 and seq.num_new_output_tokens == 3


def test_sequence_growing_to_max_model_len_finishes():
    sched = sched_of("sarathi", num_blocks=MAX_MODEL_LEN // 4)
    seq = seq_of("g", MAX_MODEL_LEN - 3, max_tokens=None)
    simulate(sched, {0: [seq]})
    assert seq.num_tokens == MAX_MODEL_LEN and seq.num_output_tokens == 3
    assert_drained(sched)
