"""Replica failures: stream breaks, silence, protocol violations, drain, concurrency."""

import asyncio

import grpc
import pytest
import redis.asyncio

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from common.pb.quadriga.v1 import replica_pb2_grpc
from tests.router.test_scheduling import submit_in_order, wait_until
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens


@pytest.mark.parametrize("stream_interval", [0, 4096], ids=["streamed", "held_to_the_end"])
def test_replica_killed_mid_stream_loses_and_repeats_nothing(redis_url, tiny_model, arun,
                                                             stream_interval):
    """A replica dies mid-answer: its requests resume on another replica after
    the tokens the router has, and end exact. Streamed, the router has every
    token the doomed replica made; held to the end (a coalesced request, as an
    OpenAI call answered whole is), only its first, and the rest is made again."""

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            doomed = await reps.add("doomed", step_delay=0.01, fail_after_steps=4)
            async with client(app.address) as stub:
                prompts = [[i + 1, i + 2] for i in range(6)]
                tasks = [asyncio.create_task(collect(stub, request(p, 12, stream_interval=stream_interval)))
                         for p in prompts]
                await wait_until(lambda: doomed.steps >= 1)
                healthy = await reps.add("healthy", step_delay=0.005)
                results = await asyncio.gather(*tasks)
            for p, msgs in zip(prompts, results):
                assert tokens_of(msgs) == expected_tokens(p, 12, vocab)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.replica_id == "healthy"
                assert msgs[-1].timings.requeues >= 1
            resumed = [a for a in healthy.rec.assignments if a.resume_token_ids]
            assert resumed, "the healthy replica should continue from tokens already generated"
            for a in resumed:
                p = list(a.prompt_token_ids)
                assert list(a.resume_token_ids) == expected_tokens(p, len(a.resume_token_ids), vocab)
            if stream_interval:
                # The doomed replica computed 4 tokens of each but sent only the first.
                assert all(len(a.resume_token_ids) == 1 for a in healthy.rec.assignments)
            await reps.close()

    arun(scenario())


def test_silent_replica_loses_its_lease(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, lease_ttl=1.0, heartbeat_interval=0.25)
        async with running_router(cfg) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            silent = await reps.add("silent", stop_heartbeats=True, hold_on_finish=True)
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, request([7], 5)))
                await wait_until(lambda: silent.rec.assignments)
                await reps.add("alive")
                msgs = await task
            assert tokens_of(msgs) == expected_tokens([7], 5, vocab)
            assert msgs[-1].timings.replica_id == "alive"
            assert app.registry.get("silent") is None
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("garbage", ["bad_offset", "unowned", "empty", "register"])
def test_malformed_replica_is_dropped_and_its_work_requeued(redis_url, tiny_model, arun, garbage):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            bad = await reps.add("bad", step_delay=0.01, garbage=garbage, garbage_after_steps=2)
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, request([3, 3], 8)))
                await wait_until(lambda: bad.rec.errors)
                await reps.add("good")
                msgs = await task
                assert tokens_of(msgs) == expected_tokens([3, 3], 8, vocab)
                assert bad.rec.errors == [grpc.StatusCode.FAILED_PRECONDITION]
                # The router lives on.
                again = await collect(stub, request([1], 2))
                assert tokens_of(again) == expected_tokens([1], 2, vocab)
            assert app.metrics.replica_faults.value == 1
            await reps.close()

    arun(scenario())


def test_pull_before_register_is_rejected(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            async with grpc.aio.insecure_channel(app.address) as ch:
                stub = replica_pb2_grpc.ReplicaGatewayStub(ch)

                async def msgs():
                    yield rpb.ReplicaMessage(pull=rpb.Pull(max_requests=1))
                    await asyncio.sleep(5)

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Connect(msgs()):
                        pass
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "Register" in err.value.details()
            assert len(app.registry) == 0

    arun(scenario())


SERVED = object()  # stands for the router's served model name


@pytest.mark.parametrize("router_overrides, refused, welcome, code", [
    (dict(replica_token="s3cret"), dict(auth_token="wrong"), dict(auth_token="s3cret"),
     grpc.StatusCode.UNAUTHENTICATED),
    ({}, dict(model="some-other-model"), dict(model=SERVED), grpc.StatusCode.FAILED_PRECONDITION),
], ids=["wrong-token", "other-model"])
def test_router_refuses_replicas_it_must_not_trust(redis_url, tiny_model, arun,
                                                   router_overrides, refused, welcome, code):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, **router_overrides)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            stranger = await reps.add("stranger", wait=False, **refused)
            await asyncio.wait_for(reps.items["stranger"][1], 10)
            assert stranger.rec.errors == [code]
            assert len(app.registry) == 0
            served = app.config.served_model_name
            await reps.add("member", **{k: served if v is SERVED else v for k, v in welcome.items()})
            async with client(app.address) as stub:
                msgs = await collect(stub, request([1], 2))
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()

    arun(scenario())


def test_drain_hands_work_to_other_replicas(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            old = await reps.add("old", step_delay=0.02)
            async with client(app.address) as stub:
                tasks = [asyncio.create_task(collect(stub, request([i], 15))) for i in range(1, 4)]
                await wait_until(lambda: old.steps >= 2)
                await reps.add("new", step_delay=0.005)
                assert app.ops.drain("old")
                results = await asyncio.gather(*tasks)
            assert old.rec.drained
            for i, msgs in zip(range(1, 4), results):
                assert tokens_of(msgs) == expected_tokens([i], 15, vocab)
                assert msgs[-1].timings.replica_id == "new"
            await reps.close()

    arun(scenario())


def test_concurrent_pulls_never_share_a_request(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            for i in range(6):
                await reps.add(f"r{i}", capacity=3, tokens_per_step=2)
            async with client(app.address) as stub:
                prompts = [[i % 50 + 1, i // 50 + 1] for i in range(120)]
                results = await asyncio.gather(*(collect(stub, request(p, 4)) for p in prompts))
            for p, msgs in zip(prompts, results):
                assert tokens_of(msgs) == expected_tokens(p, 4, vocab)
            ids = [a.request_id for i in range(6) for a in reps[f"r{i}"].rec.assignments]
            assert len(ids) == len(set(ids)) == 120
            await reps.close()

    arun(scenario())


def test_a_request_moved_past_max_requeues_fails_with_a_clear_error(redis_url, tiny_model, arun):
    """Each replica that takes it breaks its stream: the first break requeues
    it (one requeue allowed), the second fails it, and the client is told why."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, max_requeues=1)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, request([3, 4], 50)))
                first = await reps.add("first", step_delay=0.01, fail_after_steps=3)
                await wait_until(lambda: first.steps >= 3)
                second = await reps.add("second", step_delay=0.01, fail_after_steps=3)
                msgs = await task
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_ERROR
            assert "moved between replicas 1 times" in msgs[-1].error
            assert [a.request_id for a in second.rec.assignments] == [msgs[-1].request_id]
            await reps.close()

    arun(scenario())


def test_a_request_swept_past_max_requeues_fails_at_its_next_pop(redis_url, tiny_model, arun):
    """The sweep of a dead router's leases counts a requeue in Redis without
    the limit; the router that pops the request next applies it."""
    async def scenario():
        config = make_config(redis_url, tiny_model, max_requeues=2)
        async with running_router(config) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            replica = await reps.add("r", step_delay=0.01, auto_pull=False)   # takes nothing yet
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, request([3, 4], 8, request_id="swept")))
                r = redis.asyncio.Redis.from_url(redis_url)
                key = f"{config.redis_prefix}req:swept"
                while not await r.exists(key):
                    await asyncio.sleep(0.02)
                await r.hset(key, "rq", 3)   # as three sweeps would have left it
                await r.aclose()
                replica.pull(1)
                msgs = await task
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_ERROR
            assert "moved between replicas 3 times" in msgs[-1].error
            assert tokens_of(msgs) == []
            await reps.close()

    arun(scenario())
