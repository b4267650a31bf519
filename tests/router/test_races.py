"""Races between client actions, replica messages and in-flight Redis calls."""

import asyncio

import pytest

from common.pb.quadriga.v1 import generation_pb2 as gpb
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router)


def hold_calls(obj, attr):
    """Wraps the coroutine method obj.attr so each call waits for `gate`;
    `entered` is set when a call is waiting."""
    original = getattr(obj, attr)
    gate, entered = asyncio.Event(), asyncio.Event()

    async def held(*args, **kwargs):
        entered.set()
        await gate.wait()
        return await original(*args, **kwargs)

    setattr(obj, attr, held)
    return gate, entered


async def keys_without_ttl(store) -> list[str]:
    out = []
    async for key in store.redis.scan_iter(match=f"{store.prefix}*"):
        name = key.decode()[len(store.prefix):]
        if name != "seq" and await store.redis.ttl(key) < 0:
            out.append(name)
    return out


def test_cancel_while_first_step_write_in_flight_leaks_no_key(redis_url, tiny_model, arun):
    """The first output of a request is being written when the client cancels:
    the output keys it creates still expire with the result."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            store = app.core.store
            gate, entered = hold_calls(store._steps, "_flush")
            reps = Replicas(app.address, app.core.limits.vocab_size)
            await reps.add("r", step_delay=0.05)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([3], 50, request_id="c")))
                await asyncio.wait_for(entered.wait(), 10)
                assert (await stub.Cancel(gpb.CancelRequest(request_id="c"))).cancelled
                gate.set()
                msgs = await t
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
            await reps.close()
            await asyncio.sleep(0.2)
            assert await keys_without_ttl(store) == []

    arun(scenario())


def test_replica_leaving_while_a_submit_to_its_queue_is_in_flight(redis_url, tiny_model, arun):
    """round_robin binds a request to r0's queue; r0 goes away before the submit
    script returns: the request must still run (on r1), not wait in r0's queue."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, policy="round_robin")) as app:
            core = app.core
            reps = Replicas(app.address, core.limits.vocab_size)
            await reps.add("r0")
            await reps.add("r1")
            gate, entered = hold_calls(core.store._submits, "_flush")
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([4], 5, request_id="s"), timeout=10))
                await asyncio.wait_for(entered.wait(), 10)
                assert core.requests["s"].queue == "r:r0"
                await reps.kill("r0")
                await wait_until(lambda: core.registry.get("r0") is None)
                gate.set()
                msgs = await t
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.replica_id == "r1"
            await reps.close()

    arun(scenario())


def fail_calls(obj, attr, which):
    """Makes the calls of obj.attr numbered in `which` (from 1) raise ConnectionError."""
    original = getattr(obj, attr)
    count = [0]

    async def flaky(*args, **kwargs):
        count[0] += 1
        if count[0] in which:
            raise ConnectionError("injected Redis failure")
        return await original(*args, **kwargs)

    setattr(obj, attr, flaky)
    return count


def test_redis_failure_while_requeueing_a_dead_replicas_work(redis_url, tiny_model, arun):
    """The requeue of a killed replica's work fails in Redis: the work is still
    rewritten and resumed elsewhere, exactly."""
    from tests.support.router_harness import tokens_of
    from tests.support.scripted_replica import expected_tokens

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            core = app.core
            vocab = core.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.05)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([5], 30, request_id="k"), timeout=20))
                await wait_until(lambda: "k" in core.requests and len(core.requests["k"].tokens) >= 3)
                fail_calls(core.store, "requeue", {1})
                await reps.kill("r0")
                await wait_until(lambda: core.requests["k"].owner is None)
                await reps.add("r1", step_delay=0.01)
                msgs = await t
                assert tokens_of(msgs) == expected_tokens([5], 30, vocab)
                assert msgs[-1].timings.replica_id == "r1"
            await reps.close()
            await asyncio.sleep(0.2)
            assert await keys_without_ttl(core.store) == []
            assert await core.store.redis.zcard(core.store.inflight_key) == 0

    arun(scenario())


@pytest.mark.parametrize("failing", [3, 5], ids=["mid-stream", "finishing-step"])
def test_redis_failure_of_a_step_write(redis_url, tiny_model, arun, failing):
    """A step write fails: the replica is dropped, the request's record is
    rewritten from memory, and the client still gets every token once; a
    re-attach afterwards replays the same output from Redis."""
    from tests.support.router_harness import tokens_of
    from tests.support.scripted_replica import expected_tokens

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            core = app.core
            vocab = core.limits.vocab_size
            fail_calls(core.store._steps, "_flush", {failing})
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.02, reconnect=True)
            async with client(app.address) as stub:
                req = request([6], 5, request_id="w")
                msgs = await collect(stub, req, timeout=20)
                assert tokens_of(msgs) == expected_tokens([6], 5, vocab)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                again = await collect(stub, req, timeout=20)
                assert tokens_of(again) == expected_tokens([6], 5, vocab)
            await reps.close()
            await asyncio.sleep(0.2)
            assert await keys_without_ttl(core.store) == []
            assert await core.store.redis.zcard(core.store.inflight_key) == 0

    arun(scenario())


def test_redis_failure_on_submit_is_a_clear_status(redis_url, tiny_model, arun):
    import grpc

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.core.limits.vocab_size)
            await reps.add("r0")
            fail_calls(app.core.store._submits, "_flush", {1})
            async with client(app.address) as stub:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([7], 3, request_id="x"), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Redis" in err.value.details()
                msgs = await collect(stub, request([7], 3, request_id="x"), timeout=10)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            assert app.core.queued_total == 0
            await reps.close()

    arun(scenario())
