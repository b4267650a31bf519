"""Schedulers with the prefix cache, over the simulated engine loop: a cached
prefix is skipped, the step's budget only pays for the rest, and preemption,
resumption and admission capacity see the cache."""

from __future__ import annotations

import pytest

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from tests.engine.test_schedulers import ALL, ON_DEMAND, Trace, assert_drained, sched_of, simulate
from tests.engine.test_schedulers_policies import run_steps


def seq_of(seq_id: str, tokens: list[int], max_tokens: int = 4, resume: list[int] | None = None) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens), resume_token_ids=resume)


PROMPT = list(range(10, 50))  # 40 tokens: 10 blocks of 4


def chunks_of(trace: Trace, seq_id: str) -> list[int]:
    return [n for step in trace.steps for sid, n, _ in step if sid == seq_id]


@pytest.mark.parametrize("name", ALL)
def test_a_repeated_prompt_computes_only_past_its_cached_blocks(name):
    sched = sched_of(name, chunk_size=32)
    simulate(sched, {0: [seq_of("a", PROMPT)]})
    b = seq_of("b", PROMPT)
    trace = simulate(sched, {0: [b]})
    # 9 blocks reused; the 10th holds the last token, which is always computed.
    assert chunks_of(trace, "b") == [4, 1, 1, 1]
    assert b.num_cached_tokens == 36
    stats = sched.block_manager.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (80, 36)
    assert_drained(sched)


def test_sarathi_chunks_the_uncached_rest_of_a_shared_prefix():
    sched = sched_of("sarathi", chunk_size=16)
    simulate(sched, {0: [seq_of("a", PROMPT[:20])]})
    b = seq_of("b", PROMPT[:20] + [7] * 30)  # 5 cached blocks, 30 tokens to go
    trace = simulate(sched, {0: [b]})
    assert b.num_cached_tokens == 20
    assert chunks_of(trace, "b") == [16, 14, 1, 1, 1]


def test_unchunked_schedulers_fit_a_prompt_whose_uncached_part_fits_the_step():
    sched = sched_of("vllm", max_num_batched_tokens=48)
    simulate(sched, {0: [seq_of("a", PROMPT)]})
    b, c = seq_of("b", PROMPT + [1, 2]), seq_of("c", PROMPT + [3, 4])
    trace = simulate(sched, {0: [b, c]})
    assert trace.steps[0] == [("b", 2, True), ("c", 2, True)]  # 84 tokens known, 4 computed


@pytest.mark.parametrize("name", ON_DEMAND)
def test_a_preempted_sequence_recomputes_only_what_was_evicted(name):
    # Distinct prompts: every hit is a sequence finding its own blocks again.
    seqs = [seq_of(f"p{i}", [100 * i + t for t in range(12)], max_tokens=24) for i in range(4)]
    sched = sched_of(name, num_blocks=12)
    trace = simulate(sched, {0: seqs})
    assert trace.num_preempted > 0
    stats = sched.block_manager.prefix_cache_stats()
    assert stats.hits > 0, "a re-admission found none of its blocks"
    assert all(s.num_cached_tokens == 0 for s in seqs)  # first admissions found nothing
    assert_drained(sched)


@pytest.mark.parametrize("name", ["vllm", "simple_chunking"])
def test_a_readmission_with_one_token_left_is_scheduled_once(name):
    """Admission before decoding (vllm, simple_chunking's yielding prefill turn):
    a resumed context cached but for its last token looks like a decode."""
    sched = sched_of(name)
    simulate(sched, {0: [seq_of("a", PROMPT[:8], max_tokens=3)]})
    d = seq_of("d", [5] * 3, max_tokens=20)
    sched.add_seq(d)
    trace = run_steps(sched, 2)  # d's prefill, then a decode
    sched.add_seq(seq_of("r", PROMPT[:8], max_tokens=3, resume=[77]))
    trace = run_steps(sched, 1, trace)
    assert sorted(trace.steps[-1]) == [("d", 1, False), ("r", 1, False)]


def test_a_resumed_request_reuses_blocks_of_prompt_and_resumed_output():
    sched = sched_of("sarathi")
    a = seq_of("a", PROMPT[:10], max_tokens=12)
    simulate(sched, {0: [a]})
    moved = seq_of("m", PROMPT[:10], max_tokens=12, resume=a.output_token_ids[:7])  # 17 tokens known
    trace = simulate(sched, {0: [moved]})
    assert moved.num_cached_tokens == 16 and chunks_of(trace, "m")[0] == 1


@pytest.mark.parametrize("name", ALL)
def test_admission_capacity_counts_evictable_blocks_as_free(name):
    sched = sched_of(name, num_blocks=40)
    fresh = sched.admission_capacity()
    simulate(sched, {0: [seq_of("a", PROMPT)]})
    assert sched.block_manager.pool.num_evictable > 0
    assert sched.admission_capacity() == fresh
