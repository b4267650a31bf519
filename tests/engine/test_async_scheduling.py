"""Async scheduling (core.py): the next step is scheduled and launched before the
sampled ids of the one in flight are read, its placeholders filled on the device.

On the CPU the "device" runs each step as it is launched, but the bookkeeping is
the same as on CUDA: placeholders, resolution one step late, sequences that
stop while a step past their end is in flight, held last tokens. Outputs must
equal transformers' (greedy) and the engine's own synchronous outputs (every
other setting), token for token, text and finish reason included.
"""

from __future__ import annotations

import pytest

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_engine_equivalence import CONFIGS, GREEDY, MAX_NEW, PROMPTS


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return str(tiny_model_factory("llama3"))


@pytest.fixture(scope="module")
def reference(path):
    return hf_greedy(path, PROMPTS, MAX_NEW)


def _count_filled_launches(llm) -> list[int]:
    """Wraps the runner's launch: counts launches whose tokens include a placeholder."""
    runner, filled = llm.engine.runner, [0]
    launch = runner.launch

    def counting(chunks, previous=None):
        if any(t < 0 for c in chunks for t in c.seq.token_ids):
            assert previous is not None, "a placeholder with no step in flight to fill it from"
            filled[0] += 1
        return launch(chunks, previous)

    runner.launch = counting
    return filled


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_equals_transformers(path, reference, scheduler, config_name):
    kwargs, expect_preemption = CONFIGS[config_name]
    llm = LLM(path, scheduler=scheduler, async_scheduling=True, **kwargs)
    assert llm.engine.async_scheduling
    filled = _count_filled_launches(llm)
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, GREEDY)]
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref, f"{scheduler}: prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    assert filled[0] > 0, "no step read its tokens from the step in flight"
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished()
    if expect_preemption and scheduler in ("sarathi", "vllm", "simple_chunking"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tight cache was meant to force preemption"


def _pair(path, **kwargs):
    return (LLM(path, async_scheduling=False, **kwargs), LLM(path, async_scheduling=True, **kwargs))


def _same(sync_outs, async_outs):
    for s, a in zip(sync_outs, async_outs):
        s, a = s.outputs[0], a.outputs[0]
        assert a.token_ids == s.token_ids
        assert a.text == s.text
        assert a.finish_reason == s.finish_reason
        assert (a.logprobs is None) == (s.logprobs is None)
        if s.logprobs is not None:
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in s.logprobs]


@pytest.mark.parametrize("cache", [dict(num_blocks=256), dict(num_blocks=50, block_size=4)])
def test_stops_end_a_request_at_the_same_token(tiny_model, cache):
    """A stop token, a stop string, max_tokens, min_tokens: the step launched past
    the stop is dropped, and the output is the synchronous one. In the small cache
    a stopped sequence's blocks go to others while its last step is in flight."""
    sync, overlapped = _pair(str(tiny_model), chunk_size=16, **cache)
    free = sync.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stop_ids = [o.outputs[0].token_ids[5] for o in free]
    stop_text = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in free]
    cases = [
        [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[t]) for t in stop_ids],
        [SamplingParams(temperature=0.0, max_tokens=24, stop=[s] if s.strip() else None) for s in stop_text],
        [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 3, 7)],
        [SamplingParams(temperature=0.0, max_tokens=24, min_tokens=8, stop_token_ids=[t]) for t in stop_ids],
    ]
    for params in cases:
        sync_outs = sync.generate(PROMPTS, params)
        _same(sync_outs, overlapped.generate(PROMPTS, params))
    assert any(o.outputs[0].finish_reason == "stop" for o in sync.generate(PROMPTS, cases[0]))
    bm = overlapped.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def _computed_tokens(llm, prompts, params) -> tuple[list, int]:
    """Outputs, and the tokens the engine's steps computed in all."""
    engine, step, total = llm.engine, llm.engine.step, [0]

    def counted():
        result = step()
        total[0] += result.num_tokens
        return result

    engine.step = counted
    try:
        return llm.generate(prompts, params), total[0]
    finally:
        del engine.step


def test_a_request_whose_last_token_is_in_flight_is_not_stepped_again(tiny_model):
    """max_tokens and the model's length are known before the token: no step runs
    past them, so the engine computes exactly the synchronous number of tokens."""
    sync, overlapped = _pair(str(tiny_model), chunk_size=16, num_blocks=64, max_model_len=64)
    prompts = [list(range(3, 60)), list(range(5, 20)), [7, 8, 9]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in (200, 200, 9)]
    sync_outs, sync_tokens = _computed_tokens(sync, prompts, params)
    async_outs, async_tokens = _computed_tokens(overlapped, prompts, params)
    _same(sync_outs, async_outs)
    assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in sync_outs] == [64, 64, 12]
    assert async_tokens == sync_tokens


def test_placeholders_resolve_in_order_and_drop_at_the_end():
    from replica_worker.engine.sequence import Sequence

    seq = Sequence("s", [1, 2, 3], GREEDY)
    seq.append_placeholder(4)
    seq.append_placeholder(0)
    assert seq.token_ids == [1, 2, 3, -5, -1] and seq.num_output_tokens == 2 and seq.output_token_ids == []
    seq.resolve_placeholder(42)
    assert seq.token_ids == [1, 2, 3, 42, -1] and seq.output_token_ids == [42]
    seq.num_computed_tokens = 5
    seq.drop_placeholders()
    assert seq.token_ids == [1, 2, 3, 42] and seq.num_output_tokens == 1 and seq.num_computed_tokens == 4
    with pytest.raises(AssertionError):
        seq.resolve_placeholder(7)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, min_tokens=4),
    # Penalties read earlier tokens on the host: steps resolve before the next is scheduled.
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5),
])
def test_sampling_settings_give_the_synchronous_output(tiny_model, params):
    sync, overlapped = _pair(str(tiny_model), chunk_size=16, num_blocks=256)
    _same(sync.generate(PROMPTS, params), overlapped.generate(PROMPTS, params))


def test_prefix_cache_hits_are_the_same(tiny_model):
    sync, overlapped = _pair(str(tiny_model), chunk_size=16, num_blocks=256)
    shared = list(range(100, 164))
    prompts = [shared + [1, 2], shared + [3]]
    for llm in (sync, overlapped):
        llm.generate(prompts[:1], GREEDY)
    outs = [llm.generate(prompts, GREEDY) for llm in (sync, overlapped)]
    _same(*outs)
    assert [o.num_cached_tokens for o in outs[1]] == [o.num_cached_tokens for o in outs[0]]
    assert outs[1][0].num_cached_tokens >= 64


def test_an_abort_while_its_step_is_in_flight_frees_everything(tiny_model):
    llm = LLM(str(tiny_model), chunk_size=16, num_blocks=128, async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    seen: dict[str, list[int]] = {}
    while len(seen.get("r1", [])) < 2:  # r1 decodes: a step of it is in flight now
        for d in engine.step().deltas:
            seen.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert engine.scheduler.get_seq("r1").num_placeholders == 1
    assert engine.abort_request("r1")
    after_abort = len(seen.get("r1", []))
    while engine.has_unfinished():
        for d in engine.step().deltas:
            seen.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert len(seen.get("r1", [])) == after_abort, "tokens of an aborted request came after the abort"
    expected = LLM(str(tiny_model), chunk_size=16, num_blocks=128).generate(PROMPTS, GREEDY)
    for i in (0, 2, 3):
        assert seen[f"r{i}"] == expected[i].outputs[0].token_ids
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_off_by_default_on_the_cpu_and_refused_with_tensor_parallelism(tiny_model):
    from replica_worker.engine.config import engine_config

    assert not LLM(str(tiny_model)).engine.async_scheduling
    with pytest.raises(ValueError, match="async scheduling needs tensor_parallel_size 1"):
        engine_config(str(tiny_model), async_scheduling=True, tensor_parallel_size=2)


def test_a_failed_launch_undoes_the_step_in_flight_and_the_engine_goes_on(tiny_model):
    """A step that raises (say, out of memory) while another is in flight: that one's
    tokens were never read, so it is undone and computed again; outputs are exact."""
    llm = LLM(str(tiny_model), chunk_size=16, num_blocks=128, async_scheduling=True)
    engine, runner = llm.engine, llm.engine.runner
    launch, calls = runner.launch, [0]

    def failing_once(chunks, previous=None):
        calls[0] += 1
        if calls[0] == 12:
            raise RuntimeError("out of memory")
        return launch(chunks, previous)

    runner.launch = failing_once
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    seen: dict[str, list[int]] = {}
    failed = 0
    while engine.has_unfinished():
        try:
            deltas = engine.step().deltas
        except RuntimeError:
            failed += 1
            continue
        for d in deltas:
            seen.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert failed == 1
    expected = LLM(str(tiny_model), chunk_size=16, num_blocks=128).generate(PROMPTS, GREEDY)
    assert [seen[f"r{i}"] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in expected]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
