"""Prefix caching against transformers: with cache hits the engine's greedy
output equals transformers' token for token, under every scheduler, with
small chunks, preemption, eviction and resumed requests; the counters, the
per-request cached tokens and the KV events say exactly what was reused."""

from __future__ import annotations

import pytest

from common.block_hash import block_hashes
from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
BS = 8
SYSTEM = [(i * 31) % 500 + 3 for i in range(37)]  # 4 full blocks and 5 tokens into the 5th
USERS = [[401, 402, 403, 404, 405, 406], [17, 5, 240, 33, 90, 91, 92, 93, 94, 95, 96], [77, 78]]
SHARED = [SYSTEM + user for user in USERS]

CONFIGS = {
    "roomy": dict(block_size=BS, chunk_size=32, num_blocks=128, max_num_batched_tokens=128),
    "small-chunks": dict(block_size=4, chunk_size=6, num_blocks=128, max_num_batched_tokens=128),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model)


@pytest.fixture(scope="module")
def shared_reference(model):
    return hf_greedy(model, SHARED, MAX_NEW)


def cached_per_request(outs) -> list[int]:
    return [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_shared_system_prompt_hits_and_matches_transformers(model, shared_reference, scheduler, config):
    kwargs = CONFIGS[config]
    bs = kwargs["block_size"]
    llm = LLM(model, scheduler=scheduler, **kwargs)
    first = llm.generate(SHARED[:1], GREEDY)
    rest = llm.generate(SHARED[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == shared_reference
    # The shared prefix ends inside a block: only its full blocks are reused.
    shared_blocks = len(SYSTEM) // bs * bs
    assert cached_per_request(first + rest) == [0, shared_blocks, shared_blocks]
    stats = llm.engine.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (sum(map(len, SHARED)), 2 * shared_blocks)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"


def test_identical_and_fully_cached_prompts(model):
    prompt = [(i * 13) % 400 + 7 for i in range(41)]  # 5 full blocks and 1 token
    variants = [prompt, prompt, prompt[:40], prompt[:33]]
    reference = hf_greedy(model, variants, MAX_NEW)
    llm = LLM(model, block_size=BS, chunk_size=16)
    llm.generate([prompt], GREEDY)
    outs = llm.generate(variants, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # 41 tokens: all 5 blocks cached, one token computed. 40 (an exact multiple):
    # the block holding the last token is recomputed. 33: one token computed.
    assert cached_per_request(outs) == [40, 40, 32, 32]


def test_a_multi_turn_conversation_reuses_the_earlier_answer(model):
    llm = LLM(model, block_size=BS, chunk_size=16)
    conversation = [(i * 7) % 300 + 11 for i in range(30)]
    expected_cached = [0]
    for turn, user in enumerate([[], [450, 451, 452, 453, 454, 455, 456], [460, 461, 462, 463, 464]]):
        conversation = conversation + user
        ref = hf_greedy(model, [conversation], MAX_NEW)[0]
        out = llm.generate([conversation], GREEDY)[0]
        assert out.outputs[0].token_ids == ref, f"turn {turn} diverged"
        assert out.num_cached_tokens == expected_cached[turn]
        # Computed KV: the whole context but the last generated token; its full blocks stay cached.
        computed = len(conversation) + MAX_NEW - 1
        conversation = conversation + out.outputs[0].token_ids
        expected_cached.append(computed // BS * BS)
    assert expected_cached[1:3] == [40, 56]  # the answers' blocks were reused, not only the prompts'


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
def test_preemption_under_a_tight_cache_reuses_blocks(model, scheduler):
    prompts = [SYSTEM + [300 + i] * (3 + 2 * i) for i in range(7)]
    reference = hf_greedy(model, prompts, MAX_NEW)
    # 9 shared blocks and 4 to 6 more a request: the 6 requests need more than 24 blocks.
    llm = LLM(model, scheduler=scheduler, block_size=4, chunk_size=16, num_blocks=24, max_num_batched_tokens=96)
    warm = llm.generate(prompts[:1], GREEDY)
    outs = llm.generate(prompts[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in warm + outs] == reference
    assert all(o.num_cached_tokens == 36 for o in outs)
    if scheduler in ("sarathi", "vllm", "simple_chunking"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tight cache was meant to preempt"
        stats = llm.engine.prefix_cache_stats()
        assert stats.queries > sum(map(len, prompts)), "re-admissions after preemption query the cache too"
        assert stats.hits > sum(cached_per_request(outs)), "a recompute found nothing cached"
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and bm.pool.num_evictable == bm.pool.num_cached


def test_more_distinct_prefixes_than_blocks_evict_the_oldest(model):
    prompts = [[50 * i + t + 1 for t in range(12)] for i in range(10)]  # 3 blocks each, 30 in all
    reference = hf_greedy(model, prompts, 4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model, block_size=4, num_blocks=16, chunk_size=16)
    engine = llm.engine
    mirror: set[int] = set()
    evicted = 0
    for prompt, ref in zip(prompts, reference):
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == ref
        events = engine.take_kv_events()
        evicted += len(events.evicted)
        mirror = (mirror - set(events.evicted)) | set(events.stored)
    assert evicted > 0 and mirror == set(engine.cached_block_hashes())
    newest, oldest = llm.generate([prompts[-1]], params)[0], llm.generate([prompts[0]], params)[0]
    assert (newest.outputs[0].token_ids, oldest.outputs[0].token_ids) == (reference[-1], reference[0])
    assert (newest.num_cached_tokens, oldest.num_cached_tokens) == (8, 0)


def test_a_resumed_request_reuses_blocks_of_its_prompt_and_resumed_tokens(model):
    prompt = [(i * 17) % 450 + 20 for i in range(20)]
    reference = hf_greedy(model, [prompt], MAX_NEW)[0]
    llm = LLM(model, block_size=BS, chunk_size=16)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == reference
    engine = llm.engine
    seq = engine.add_request("moved", prompt, GREEDY, resume_token_ids=reference[:6])
    tokens = []
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens.extend(delta.new_token_ids)
    assert tokens == reference[6:]
    assert seq.num_cached_tokens == (len(prompt) + 6 - 1) // BS * BS == 24


def test_caching_off_gives_the_same_tokens_and_reuses_nothing(model, shared_reference):
    llm = LLM(model, enable_prefix_caching=False, **CONFIGS["roomy"])
    outs = llm.generate(SHARED[:1], GREEDY) + llm.generate(SHARED[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == shared_reference
    assert cached_per_request(outs) == [0, 0, 0]
    engine = llm.engine
    assert not engine.prefix_caching_enabled
    assert engine.prefix_cache_stats().queries == 0
    assert engine.take_kv_events().empty and engine.cached_block_hashes() == []


def test_reported_hashes_are_what_a_router_computes_from_the_tokens(model):
    llm = LLM(model, block_size=BS, chunk_size=16)
    engine = llm.engine
    out = llm.generate(SHARED[:1], GREEDY)[0]
    events = engine.take_kv_events()
    computed = (SHARED[0] + out.outputs[0].token_ids)[: len(SHARED[0]) + MAX_NEW - 1]
    hasher = engine.block_hasher
    assert (hasher.scheme, hasher.block_size, hasher.salt) == ("blake2b64-v1", BS, b"")
    assert set(events.stored) == set(block_hashes(computed, BS)) == set(engine.cached_block_hashes())
    assert events.evicted == () and not events.cleared
    router_side = hasher.hashes(SHARED[1])  # from the next request's prompt alone
    assert router_side[:4] == block_hashes(SYSTEM, BS) and set(router_side[:4]) <= set(events.stored)
    assert engine.take_kv_events().empty


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_a_sliding_window_model_hits_and_matches_transformers(tiny_model_factory, scheduler):
    path = str(tiny_model_factory("mistral", sliding_window=8))
    reference = hf_greedy(path, SHARED, MAX_NEW)
    llm = LLM(path, scheduler=scheduler, block_size=4, chunk_size=6, max_num_batched_tokens=128)
    assert llm.engine.runner.backend.sliding_window == 8
    outs = llm.generate(SHARED[:1], GREEDY) + llm.generate(SHARED[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert cached_per_request(outs) == [0, 36, 36]


def test_a_running_requests_blocks_serve_a_later_arrival(model, shared_reference):
    llm = LLM(model, block_size=BS, chunk_size=16)
    engine = llm.engine
    first = engine.add_request("first", SHARED[0], GREEDY)
    while first.num_output_tokens < 2:
        engine.step()
    stored = set(engine.take_kv_events().stored)  # reported while the request still runs
    assert set(block_hashes(SYSTEM, BS)) <= stored
    second = engine.add_request("second", SHARED[1], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert [first.output_token_ids, second.output_token_ids] == shared_reference[:2]
    assert second.num_cached_tokens == 32
