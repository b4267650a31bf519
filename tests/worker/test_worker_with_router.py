"""A real replica worker (real engine, tiny model) against a real router in the
same event loop: acknowledged output is forgotten, and a recoverable engine
error hands the step's requests back to be resumed, exactly."""

import asyncio

import torch

from replica_worker.worker.app import build_worker
from replica_worker.worker.config import parse_args
from tests.engine.hf_reference import hf_greedy
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (client, collect, free_port, make_config, running_router,
                                          tokens_of)

PROMPTS = [[3, 14, 15, 92], [6, 53, 58], [97, 93, 23, 84, 62], [64, 33]]



async def run_worker(address: str, model: str, *args: str, engine_thread: bool = True):
    """engine_thread: the engine steps on a thread of this process, where a test can
    reach into it (worker.engine_loop._engine); else in a process of its own."""
    args = ("--engine-thread", *args) if engine_thread else args
    # Built off the loop: loading the model takes seconds, and a router on this loop
    # must keep renewing its lease meanwhile.
    worker = await asyncio.to_thread(build_worker, parse_args([
        "--router", address, "--model", str(model), "--replica-id", "w0", "--threads", "1", *args]))
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker._outbox is not None, timeout=30)
    return worker, task


def requests(n_tokens: int):
    from common.pb.quadriga.v1 import generation_pb2 as gpb

    return [gpb.GenerateRequest(prompt_token_ids=p, sampling=gpb.SamplingParams(
        max_tokens=n_tokens, temperature=0.0, ignore_eos=True)) for p in PROMPTS]


def test_the_worker_keeps_only_what_the_router_has_not_acknowledged(redis_url, tiny_model, arun):
    n = 100

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            worker, task = await run_worker(app.address, tiny_model)
            peak = [0]

            async def watch():
                while True:
                    peak[0] = max(peak[0], worker.book.unacknowledged())
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            async with client(app.address) as stub:
                results = await asyncio.gather(*(collect(stub, r, timeout=60) for r in requests(n)))
            await wait_until(lambda: not worker.book.live)
            watcher.cancel()
            worker.begin_drain()
            await asyncio.wait_for(task, 10)
            return results, peak[0]

    results, peak = arun(scenario(), timeout=120)
    expected = hf_greedy(str(tiny_model), PROMPTS, n)
    assert [tokens_of(m) for m in results] == expected
    # Without acknowledgements every delta of a request stays until it finishes
    # (4 x 100 here); with them, what the steps of one acknowledgement's round trip
    # made. In steps that round trip depends on how fast the engine steps: on a
    # 2-core box the peak was 84-104 of the 400, so the bound is half of them.
    assert 0 < peak <= len(PROMPTS) * n // 2, peak


def test_a_recoverable_engine_error_hands_the_step_back_and_nothing_is_failed(
        redis_url, tiny_model, arun):
    n = 30

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            worker, task = await run_worker(app.address, tiny_model)
            runner = worker.engine_loop._engine.runner
            real_launch, calls = runner.launch, [0]

            def launch(chunks, previous=None):
                calls[0] += 1
                if calls[0] == 8:  # mid-decode: every request has some output
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return real_launch(chunks, previous)

            runner.launch = launch
            async with client(app.address) as stub:
                results = await asyncio.gather(*(collect(stub, r, timeout=60) for r in requests(n)))
            worker.begin_drain()
            await asyncio.wait_for(task, 10)
            return results, app.metrics.requeues.labels("hand_back").value

    results, handed_back = arun(scenario(), timeout=120)
    expected = hf_greedy(str(tiny_model), PROMPTS, n)
    assert [tokens_of(m) for m in results] == expected
    assert all(m[-1].finish_reason == 2 for m in results)  # LENGTH, none failed
    assert handed_back >= 1 and sum(m[-1].timings.requeues for m in results) == handed_back


def test_the_router_sees_the_engine_cache_through_evictions_and_a_restart(redis_url, tiny_model, arun):
    """Six requests of 5 full blocks each through a 24-block cache: blocks are
    evicted, and the router's view still equals the engine's cache; a new router
    has it exactly from the re-registration."""
    from common.pb.quadriga.v1 import generation_pb2 as gpb

    prompts = [[3 + (11 * i + j) % 250 for j in range(70)] for i in range(6)]

    async def scenario():
        cfg = make_config(redis_url, tiny_model, port=free_port())
        async with running_router(cfg) as app:
            worker, task = await run_worker(app.address, tiny_model, "--num-blocks", "24")
            engine = worker.engine_loop._engine
            async with client(app.address) as stub:
                for p in prompts:   # one at a time: each finishes before the next evicts
                    await collect(stub, gpb.GenerateRequest(prompt_token_ids=p, sampling=gpb.SamplingParams(
                        max_tokens=20, temperature=0.0, ignore_eos=True)))
            cached = set(engine.cached_block_hashes())
            assert 0 < len(cached) <= 24 < 6 * 5, "the cache should have evicted"
            await wait_until(lambda: app.prefix_index.hashes_of("w0") == cached)
        async with running_router(cfg) as app:
            await wait_until(lambda: app.registry.get("w0") is not None, timeout=30)
            assert app.prefix_index.hashes_of("w0") == set(engine.cached_block_hashes()) == cached
            worker.begin_drain()
            await asyncio.wait_for(task, 30)

    arun(scenario(), timeout=120)


def test_async_scheduling_through_the_worker_gives_the_reference_tokens(redis_url, tiny_model, arun):
    n = 40

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            worker, task = await run_worker(app.address, tiny_model, "--async-scheduling", "on")
            assert worker.engine_loop._engine.async_scheduling
            async with client(app.address) as stub:
                results = await asyncio.gather(*(collect(stub, r, timeout=60) for r in requests(n)))
            worker.begin_drain()
            await asyncio.wait_for(task, 10)
            return results

    results = arun(scenario(), timeout=120)
    assert [tokens_of(m) for m in results] == hf_greedy(str(tiny_model), PROMPTS, n)
    assert all(m[-1].finish_reason == 2 for m in results)  # LENGTH
