"""Simulated replicas (the real ReplicaWorker around SimulatedEngine) behind a real
router and Redis: they register, pull, stream tokens that follow the rule, honour
max_tokens, stop strings and EOS, and drain."""

from __future__ import annotations

import asyncio

from common.pb.quadriga.v1 import generation_pb2 as gpb
from replica_worker.sim.config import parse_args
from replica_worker.sim.replicas import build_workers, run_workers
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import client, collect, make_config, running_router, tokens_of
from tests.support.scripted_replica import expected_tokens


def sim_config(address: str, model, *extra: str):
    return parse_args(["--router", address, "--model", str(model), "--profile", "cpu-tiny",
                       "--replica-id", "sim", *extra])


def generate(prompt, max_tokens: int, **sampling) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(prompt_token_ids=prompt,
                               sampling=gpb.SamplingParams(max_tokens=max_tokens, **sampling))


def text_of(messages) -> str:
    return "".join(m.text for m in messages)


def test_simulated_replicas_serve_rule_tokens_through_a_real_router(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab, eos = app.limits.vocab_size, 2  # the tiny model's </s>
            # One seat each: four requests at once must use both replicas.
            workers = build_workers(sim_config(app.address, tiny_model, "-k", "2", "--max-num-seqs", "1"))
            assert [w.config.replica_id for w in workers] == ["sim-0", "sim-1"]
            task = asyncio.create_task(run_workers(workers))
            await wait_until(lambda: len(app.registry) == 2, timeout=20)
            plain = [[10, 20, 30], [40, 50, 60, 70], [5] * 60, [99, 1]]
            stop_prompt = [11, 12]  # its third token's text is the stop string
            stop_at = f"<{expected_tokens(stop_prompt, 3, vocab)[2]}>"
            eos_prompt = [vocab - 1]  # (vocab - 1 + 3) % vocab == 2: EOS is its fourth token
            async with client(app.address) as stub:
                results = await asyncio.gather(
                    *(collect(stub, generate(p, 24, ignore_eos=True)) for p in plain),
                    collect(stub, generate(stop_prompt, 24, stop=[stop_at], ignore_eos=True)),
                    collect(stub, generate(eos_prompt, 24)))
            for w in workers:
                w.begin_drain()
            await asyncio.wait_for(task, 20)
            return vocab, eos, plain, stop_prompt, eos_prompt, results

    vocab, eos, plain, stop_prompt, eos_prompt, results = arun(scenario(), timeout=90)
    *plain_results, stop_result, eos_result = results
    for prompt, messages in zip(plain, plain_results):
        tokens = expected_tokens(prompt, 24, vocab)
        assert tokens_of(messages) == tokens
        assert text_of(messages) == "".join(f"<{t}>" for t in tokens)
        assert messages[-1].finish_reason == gpb.FINISH_REASON_LENGTH
    served_by = {m[-1].timings.replica_id for m in results}
    assert served_by == {"sim-0", "sim-1"}

    stop_tokens = expected_tokens(stop_prompt, 3, vocab)
    assert tokens_of(stop_result) == stop_tokens
    assert text_of(stop_result) == "".join(f"<{t}>" for t in stop_tokens[:2])
    assert stop_result[-1].finish_reason == gpb.FINISH_REASON_STOP

    assert tokens_of(eos_result) == expected_tokens(eos_prompt, 4, vocab)
    assert tokens_of(eos_result)[-1] == eos
    assert eos_result[-1].finish_reason == gpb.FINISH_REASON_STOP


def test_simulated_replicas_report_their_prefix_cache_to_the_router(redis_url, tiny_model, arun):
    """The simulated engine keeps the real block manager's prefix cache, so its
    worker registers it and reports each step's changes as a real replica does:
    the router's view equals the engine's cached hashes. With --no-prefix-caching
    it registers no cache and the router keeps no view of it. Its prefill-heavy
    steps (a 67-token prompt at once) give the router its prefill rate."""
    shared = [7 + j % 200 for j in range(64)]   # four full blocks of 16

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            caching, = build_workers(sim_config(app.address, tiny_model, "--replica-id", "cache"))
            task = asyncio.create_task(run_workers([caching]))
            await wait_until(lambda: len(app.registry) == 1, timeout=20)
            async with client(app.address) as stub:
                for tail in ([1, 2, 3], [4, 5]):
                    await collect(stub, generate(shared + tail, 4, ignore_eos=True))
            cached = set(caching.engine_loop._engine.cached_block_hashes())
            await wait_until(lambda: app.prefix_index.hashes_of("cache") == cached)
            plain, = build_workers(sim_config(app.address, tiny_model, "--replica-id", "plain",
                                              "--no-prefix-caching"))
            plain_task = asyncio.create_task(run_workers([plain]))
            await wait_until(lambda: len(app.registry) == 2, timeout=20)
            views = ("cache" in app.prefix_index, "plain" in app.prefix_index)
            rate = app.registry.get("cache").prefill_tokens_per_s
            gauge = app.metrics.registry.get_sample_value("quadriga_replica_prefill_tokens_per_second",
                                                          {"replica": "cache"})
            for w in (caching, plain):
                w.begin_drain()
            # Past the drain timeout (30 s): a drain that waits for an Ack still ends.
            await asyncio.wait_for(asyncio.gather(task, plain_task), 45)
            return cached, views, rate, gauge

    cached, views, rate, gauge = arun(scenario(), timeout=120)
    assert rate is not None and rate > 0 and gauge == rate
    assert len(cached) >= 4, "the shared 64 tokens and more are cached"
    assert views == (True, False)
