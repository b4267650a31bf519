"""Client API: cancellation, bad input, backpressure, re-attach, health, metrics."""

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.quadriga.v1 import generation_pb2 as gpb
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, collect, free_port, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens


async def expect_error(stub, req, code):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, req, timeout=20)
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    return err.value.details()


def test_cancel_rpc_queued_and_running(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r", auto_pull=False, hold_on_finish=True)
            async with client(app.address) as stub:
                queued = asyncio.create_task(collect(stub, request([1], 5, request_id="queued")))
                await wait_until(lambda: app.table.queued_total == 1)
                assert (await stub.Cancel(gpb.CancelRequest(request_id="queued"))).cancelled
                msgs = await queued
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
                assert app.table.queued_total == 0
                assert await app.store.redis.zcard(app.store.queue_key("pending")) == 0
                assert not (await stub.Cancel(gpb.CancelRequest(request_id="queued"))).cancelled

                running = asyncio.create_task(collect(stub, request([2], 5, request_id="running")))
                rep.pull(1)
                await wait_until(lambda: rep.rec.assignments)
                assert (await stub.Cancel(gpb.CancelRequest(request_id="running"))).cancelled
                msgs = await running
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
                await wait_until(lambda: rep.rec.cancels == ["running"])
                assert await app.store.redis.zcard(app.store.inflight_key) == 0
                assert not (await stub.Cancel(gpb.CancelRequest(request_id="nope"))).cancelled
            await reps.close()

    arun(scenario())


def test_client_disconnect_cancels(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r", auto_pull=False, hold_on_finish=True)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([1], 5, request_id="q")))
                # Confirmed: its submit is durable and its stream open. A client gone
                # before that withdraws the request, which no metric counts as a cancel.
                await wait_until(lambda: app.table.queued_total == 1 and app.table.requests["q"].confirmed)
                t.cancel()
                await wait_until(lambda: "q" not in app.table.requests)
                assert app.table.queued_total == 0
                t = asyncio.create_task(collect(stub, request([1], 5, request_id="run")))
                rep.pull(1)
                await wait_until(lambda: rep.rec.assignments)
                t.cancel()
                await wait_until(lambda: rep.rec.cancels == ["run"])
                # counted when the handler's cancellation is handled, which may trail the Cancel
                disconnects = app.metrics.cancellations.labels("disconnect")
                await wait_until(lambda: disconnects.value == 2)
            await reps.close()

    arun(scenario())


BAD = [
    (gpb.GenerateRequest(), "empty prompt"),
    (gpb.GenerateRequest(prompt="hi", prompt_token_ids=[1]), "not both"),
    (gpb.GenerateRequest(prompt_token_ids=[1] * 2000), "leaving no room"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(max_tokens=0)), "max_tokens is 0"),
    (gpb.GenerateRequest(prompt_token_ids=[1] * 10, sampling=gpb.SamplingParams(max_tokens=1020)), "more than"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(temperature=-0.5)), "temperature"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(top_p=0)), "top_p"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(top_p=1.5)), "top_p"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(top_k=-2)), "top_k"),
    (gpb.GenerateRequest(prompt_token_ids=[1, 10**6]), "prompt_token_ids[1]"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(stop=["ok", ""])), "stop[1]"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(stop_token_ids=[10**6])),
     "stop_token_ids[0]"),
    (gpb.GenerateRequest(prompt_token_ids=[1], stream_interval=10**6), "stream_interval"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(logit_bias={10**6: 1.0})),
     "logit_bias token 1000000"),
    (gpb.GenerateRequest(prompt_token_ids=[1], sampling=gpb.SamplingParams(logit_bias={3: -250.0})),
     "logit_bias[3] = -250.0"),
]


def test_bad_input_is_rejected_without_disturbing_others(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r", step_delay=0.01)
            async with client(app.address) as stub:
                good = asyncio.create_task(collect(stub, request([4, 2], 40)))
                for bad, words in BAD:
                    details = await expect_error(stub, bad, grpc.StatusCode.INVALID_ARGUMENT)
                    assert words in details, (words, details)
                msgs = await good
            assert tokens_of(msgs) == expected_tokens([4, 2], 40, vocab)
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()

    arun(scenario())


def test_queue_limit_and_no_replica(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, queue_limit=2, no_replica_timeout=0.5)
        async with running_router(cfg) as app:
            async with client(app.address) as stub:
                details = await expect_error(stub, request([1], 2), grpc.StatusCode.UNAVAILABLE)
                assert "no replica" in details
                reps = Replicas(app.address, app.limits.vocab_size)
                rep = await reps.add("r", auto_pull=False)
                waiting = [asyncio.create_task(collect(stub, request([i], 2))) for i in (1, 2)]
                await wait_until(lambda: app.table.queued_total == 2)
                details = await expect_error(stub, request([3], 2), grpc.StatusCode.RESOURCE_EXHAUSTED)
                assert "queue is full" in details
                rep.pull(5)
                for t in waiting:
                    assert (await t)[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                await reps.close()
            rejected = app.metrics.rejections
            assert rejected.labels("queue_full").value == 1
            assert rejected.labels("no_replica").value == 1

    arun(scenario())


def test_reattach_live_finished_and_conflicting(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            rep = await reps.add("r", step_delay=0.01)
            want = expected_tokens([8, 9], 20, vocab)
            async with client(app.address) as stub:
                r = request([8, 9], 20, request_id="same")
                first = asyncio.create_task(collect(stub, r))
                await wait_until(lambda: rep.steps >= 5)
                second = await collect(stub, r)
                assert tokens_of(second) == want
                assert tokens_of(await first) == want
                assert len(rep.rec.assignments) == 1  # not run twice
                replay = await collect(stub, r)  # after the finish: from Redis
                assert tokens_of(replay) == want
                assert replay[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert "".join(m.text for m in replay) == "".join(f"<{t}>" for t in want)
                details = await expect_error(stub, request([1], 20, request_id="same"),
                                             grpc.StatusCode.ALREADY_EXISTS)
                assert "different request" in details
            await reps.close()

    arun(scenario())


def test_health_reflection_and_metrics(redis_url, tiny_model, arun):
    async def scenario():
        port = free_port()
        cfg = make_config(redis_url, tiny_model, metrics_port=port)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r")
            async with grpc.aio.insecure_channel(app.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for service in ("", "quadriga.v1.Generation"):
                    resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING
            async with client(app.address) as stub:
                await collect(stub, request([1, 2], 3))
            app.metrics.sync_round_trips(app.writer.round_trips)
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(
                None, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
            for name in ("quadriga_queue_depth", "quadriga_ttft_seconds_bucket", "quadriga_e2e_seconds",
                         "quadriga_replicas_connected 1.0", "quadriga_messages_in_total",
                         "quadriga_requests_total", "quadriga_redis_round_trips_total",
                         "quadriga_inflight_requests", "quadriga_tbt_seconds",
                         "quadriga_prompt_tokens_total 2.0", "quadriga_generation_tokens_total 3.0"):
                assert name in text, name
            await reps.close()

    arun(scenario())


def test_logit_bias_reaches_the_replica_and_follows_a_requeue(redis_url, tiny_model, arun):
    """The map travels in the Assign, and a request requeued from a dead replica
    carries it to the next one."""
    bias = {7: 2.5, 9: -1.0}

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            first = await reps.add("a", step_delay=0.05)
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, gpb.GenerateRequest(
                    prompt_token_ids=[3, 4], sampling=gpb.SamplingParams(max_tokens=30, logit_bias=bias))))
                await wait_until(lambda: first.rec.assignments)
                second = await reps.add("b")
                await reps.kill("a")
                msgs = await task
            assert len(tokens_of(msgs)) == 30
            for replica in (first, second):
                assert dict(replica.rec.assignments[0].sampling.logit_bias) == bias
            await reps.close()

    arun(scenario(), timeout=60)


def test_a_specs_sampling_survives_its_json_in_redis():
    """What a restarted or adopting router reads back (record.py) is the spec it stored."""
    import json

    from router.requests.spec import Sampling, sampling_from_fields

    s = Sampling(max_tokens=5, temperature=0.5, stop=("a", "b"), stop_token_ids=(3,), logprobs=2,
                 logit_bias=((4, -1.5), (9, 2.0)))
    assert sampling_from_fields(json.loads(s.set_fields_json)) == s


def test_a_request_the_router_cannot_store_gets_unavailable(redis_url, tiny_model, arun):
    """A submit Redis refuses for good (this router was fenced: its lease lapsed)
    is UNAVAILABLE with a message, so the client retries elsewhere, not UNKNOWN."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0")
            app.writer.fenced = True   # as after a FENCED reply: every write fails at once
            async with client(app.address) as stub:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([1, 2], 3))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "could not store the request" in err.value.details()
            app.writer.fenced = False
            await reps.close()

    arun(scenario())
