"""The router's smaller lifecycle promises: malformed bytes, bounded memory,
what is counted against the queue limit, declared capacity, queue-wait
metrics and a record that lost its lease entry."""

import asyncio
import logging
import urllib.request

import grpc
import pytest

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.replicas import registry as registry_module
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, collect, free_port, make_config,
                                          request, running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens

GARBAGE = b"\x0a\xff\xff\xff"   # field 1, a length that runs past the end


async def raw_unary_stream(address, method, payload):
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
        return [m async for m in call(payload, timeout=10)]


async def raw_unary(address, method, payload):
    async with grpc.aio.insecure_channel(address) as ch:
        return await ch.unary_unary(method, request_serializer=None,
                                    response_deserializer=None)(payload, timeout=10)


async def raw_stream_stream(address, method, payloads):
    async with grpc.aio.insecure_channel(address) as ch:
        async def gen():
            for p in payloads:
                yield p
            await asyncio.sleep(5)
        call = ch.stream_stream(method, request_serializer=None, response_deserializer=None)
        return [m async for m in call(gen(), timeout=10)]


CALLS = {
    "Generate": (raw_unary_stream, "/quadriga.v1.Generation/Generate", GARBAGE),
    "Cancel": (raw_unary, "/quadriga.v1.Generation/Cancel", GARBAGE),
    "Connect": (raw_stream_stream, "/quadriga.v1.ReplicaGateway/Connect", [GARBAGE]),
    "Health": (raw_unary, "/grpc.health.v1.Health/Check", GARBAGE),
}


@pytest.mark.parametrize("name", CALLS)
def test_malformed_bytes_get_invalid_argument_and_one_log_line(redis_url, tiny_model, arun,
                                                               caplog, name):
    call, method, payload = CALLS[name]

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            caplog.clear()
            with caplog.at_level(logging.INFO):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(app.address, method, payload)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "not a valid protobuf message" in err.value.details()
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(lines) == 1 and "malformed" in lines[0].getMessage(), \
                [r.getMessage() for r in lines]
            assert all(r.exc_info is None for r in caplog.records)
            # Everyone else is undisturbed.
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0")
            async with client(app.address) as stub:
                msgs = await collect(stub, request([2], 3))
            assert tokens_of(msgs) == expected_tokens([2], 3, app.limits.vocab_size)
            await reps.close()

    arun(scenario())


def test_malformed_message_mid_stream_drops_that_replica_and_requeues_its_work(
        redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            good = await reps.add("good", auto_pull=False)
            async with grpc.aio.insecure_channel(app.address) as ch:
                q: asyncio.Queue = asyncio.Queue()
                register = rpb.ReplicaMessage(register=rpb.Register(replica_id="bad"))
                await q.put(register.SerializeToString())
                await q.put(rpb.ReplicaMessage(pull=rpb.Pull(max_requests=1)).SerializeToString())

                async def gen():
                    while (item := await q.get()) is not None:
                        yield item

                call = ch.stream_stream("/quadriga.v1.ReplicaGateway/Connect",
                                        request_serializer=None, response_deserializer=None)(gen())
                async with client(app.address) as stub:
                    t = asyncio.create_task(collect(stub, request([3], 4, request_id="m")))
                    async for raw in call:
                        if rpb.RouterMessage.FromString(raw).WhichOneof("kind") == "assign":
                            break
                    await q.put(GARBAGE)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in call:
                            pass
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    good.pull(4)
                    msgs = await t
            assert tokens_of(msgs) == expected_tokens([3], 4, vocab)
            assert msgs[-1].timings.replica_id == "good" and msgs[-1].timings.requeues == 1
            await reps.close()

    arun(scenario())


def test_a_replica_that_never_reads_is_cut_off_not_buffered_forever(redis_url, tiny_model, arun,
                                                                    monkeypatch):
    monkeypatch.setattr(registry_module, "OUTBOX_LIMIT", 5)

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0", auto_pull=False)
            session = app.registry.get("r0")
            session.outbox.get = asyncio.Event().wait  # the stream's writer never takes a message
            for i in range(10):
                session.send_cancel([f"x{i}"])
            assert session.closed and session.close_status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            await reps.close()

    arun(scenario())


def test_acks_are_coalesced_and_the_last_covers_every_step(redis_url, tiny_model, arun):
    """An Ack per writer flush cost the router an outgoing message per step; one
    per ACK_INTERVAL_S carries the highest step durable, and the replica's replay
    history is still emptied."""
    interval = registry_module.ACK_INTERVAL_S

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0", step_delay=0.002)
            async with client(app.address) as stub:
                started = asyncio.get_running_loop().time()
                msgs = await asyncio.gather(*(collect(stub, request([i + 1], 60)) for i in range(4)))
                took = asyncio.get_running_loop().time() - started
            assert all(len(tokens_of(m)) == 60 for m in msgs)
            last_step = rep.steps - 1                  # step ids count from 0
            await wait_until(lambda: rep.rec.acks and rep.rec.acks[-1][1] == last_step)
            steps, acks = rep.steps, rep.rec.acks
            assert steps >= 60
            assert len(acks) <= took / interval + 3 < steps, (len(acks), steps, took)
            gaps = [b[0] - a[0] for a, b in zip(acks, acks[1:])]
            assert all(g >= 0.8 * interval for g in gaps), gaps
            assert [s for _, s in acks] == sorted(s for _, s in acks)
            await reps.close()

    arun(scenario())


def test_table_gauges_scrape_under_load_and_return_to_zero(redis_url, tiny_model, arun):
    """The queue-depth and in-flight gauges are read from the request table on
    the metrics server's thread while the loop serves 200 requests: every
    scrape succeeds and shows both, and both read zero once all is done."""
    import re
    import threading

    async def scenario():
        port = free_port()
        async with running_router(make_config(redis_url, tiny_model, metrics_port=port)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0")
            await reps.add("r1")
            url = f"http://127.0.0.1:{port}/metrics"
            failures, scrapes, stop = [], [0], threading.Event()

            def scrape_loop():
                while not stop.is_set():
                    try:
                        text = urllib.request.urlopen(url, timeout=5).read().decode()
                        assert "quadriga_queue_depth " in text, "no queue depth"
                        assert "quadriga_inflight_requests" in text, "no in-flight gauge"
                        scrapes[0] += 1
                    except Exception as exc:  # recorded: the test fails on any
                        failures.append(repr(exc))

            scraper = threading.Thread(target=scrape_loop, daemon=True)
            scraper.start()
            try:
                async with client(app.address) as stub:
                    await asyncio.gather(*(collect(stub, request([1 + i % 7], 3)) for i in range(200)))
            finally:
                stop.set()
                await asyncio.get_running_loop().run_in_executor(None, scraper.join, 10)
            assert not failures, failures[:3]
            assert scrapes[0] > 0, "no scrape ran while requests were served"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            assert re.search(r"^quadriga_queue_depth 0\.0$", text, re.M), text
            assert re.findall(r'^quadriga_inflight_requests\{replica="r[01]"\} 0\.0$', text, re.M)
            await reps.close()

    arun(scenario())


def test_a_departed_replicas_metric_series_are_removed(redis_url, tiny_model, arun):
    async def scenario():
        port = free_port()
        async with running_router(make_config(redis_url, tiny_model, metrics_port=port)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("passing")
            async with client(app.address) as stub:
                await collect(stub, request([1], 2))

            def scrape():
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()

            assert 'replica="passing"' in scrape()
            await reps.kill("passing")
            await wait_until(lambda: app.registry.get("passing") is None)
            assert 'replica="passing"' not in scrape()

    arun(scenario())


def test_requests_waiting_for_a_first_replica_count_against_the_queue_limit(redis_url, tiny_model,
                                                                            arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, queue_limit=2, no_replica_timeout=20)
        async with running_router(cfg) as app:
            async with client(app.address) as stub:
                waiting = [asyncio.create_task(collect(stub, request([i + 1], 2))) for i in range(2)]
                await wait_until(lambda: app.admission.waiting_for_replica == 2)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([9], 2))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                reps = Replicas(app.address, app.limits.vocab_size)
                await reps.add("r0")
                for t in waiting:
                    assert (await t)[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()

    arun(scenario())


def test_declared_seats_cap_what_a_replica_is_bound(redis_url, tiny_model, arun):
    """A replica that over-grants (a bug, or a grant crossing an Assign) is never
    bound more than its declared max_num_seqs (+ prefetch)."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0", auto_pull=False, capacity=2, hold_on_finish=True)
            async with client(app.address) as stub:
                tasks = [asyncio.create_task(collect(stub, request([i + 1], 2))) for i in range(5)]
                await wait_until(lambda: app.table.queued_total == 5)
                rep.pull(50)
                await wait_until(lambda: len(rep.rec.assignments) == 2)
                await asyncio.sleep(0.3)
                assert len(rep.rec.assignments) == 2 and app.table.queued_total == 3
                for t in tasks:
                    t.cancel()
            await reps.close()

    arun(scenario())


def test_queue_wait_is_observed_once_per_request_even_when_requeued(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            first = await reps.add("first", auto_pull=False, hold_on_finish=True)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([4], 3, request_id="q")))
                await wait_until(lambda: app.table.queued_total == 1)
                first.pull(1)
                await wait_until(lambda: first.rec.assignments)
                first.hand_back(["q"])
                await reps.add("second")
                msgs = await t
            assert msgs[-1].timings.requeues == 1
            samples = {s.name: s.value for s in app.metrics.queue_wait.collect()[0].samples}
            assert samples["quadriga_queue_wait_seconds_count"] == 1
            await reps.close()

    arun(scenario())


def test_a_running_record_missing_from_the_lease_set_is_requeued_on_attach(redis_url, tiny_model,
                                                                            arun):
    """A record in state running with no in-flight entry (its lease lost) gets
    one that has lapsed when a client re-attaches, so it is swept back to the
    queue and finished by a fresh replica."""
    from router.server import RouterApp

    async def scenario():
        cfg = make_config(redis_url, tiny_model, lease_ttl=1.0, heartbeat_interval=0.25)
        app = RouterApp(cfg)
        await app.start()
        address = f"127.0.0.1:{app.port}"
        reps = Replicas(address, app.limits.vocab_size)
        rep = await reps.add("gone", hold_on_finish=True)
        async with client(address) as stub:
            t = asyncio.create_task(collect(stub, request([6], 3, request_id="orphan")))
            await wait_until(lambda: rep.rec.assignments)
            await app.writer.drain(5)
            await app.store.redis.zrem(app.store.inflight_key, "orphan")
            await app.stop(grace=0.2)  # a graceful stop leaves it running
            with pytest.raises(grpc.aio.AioRpcError):
                await t
        await reps.close()
        again = make_config(redis_url, tiny_model, redis_prefix=cfg.redis_prefix, lease_ttl=1.0,
                            heartbeat_interval=0.25)
        async with running_router(again) as app2:
            assert app2.table.get("orphan") is None   # nothing is loaded at start
            reps2 = Replicas(app2.address, app2.limits.vocab_size)
            await reps2.add("fresh")
            async with client(app2.address) as stub:
                msgs = await collect(stub, request([6], 3, request_id="orphan"))
            assert tokens_of(msgs) == expected_tokens([6], 3, app2.limits.vocab_size)
            assert msgs[-1].timings.replica_id == "fresh"
            await reps2.close()

    arun(scenario())


def test_a_stop_step_that_hangs_is_named_and_the_stop_goes_on(redis_url, tiny_model, arun, caplog,
                                                             monkeypatch):
    """A SIGTERM must end the router: a step of the stop that never returns (here the
    event reader's) is cut off at its deadline and logged by name, and the steps
    after it still run (the lease is given up)."""
    from router import server as server_module
    from router.server import RouterApp

    monkeypatch.setattr(server_module, "STEP_DEADLINE", 0.3)

    async def scenario():
        app = RouterApp(make_config(redis_url, tiny_model))
        await app.start()
        released = []
        real_release = app.lease.release

        async def never_stops():
            await asyncio.Event().wait()

        async def release():
            released.append(1)
            await real_release()

        app._stop_events = never_stops
        app.lease.release = release
        with caplog.at_level(logging.ERROR, logger="router.server"):
            await asyncio.wait_for(app.stop(grace=0.1), 10)
        assert released
        assert "the event reader did not stop within 0.3 s" in caplog.text

    arun(scenario())


def test_a_hung_teardown_after_the_stop_still_ends_the_process(tmp_path):
    """After a finished stop, a process whose teardown never ends exits anyway, with 0."""
    import subprocess
    import sys
    import time

    script = ("import threading\n"
              "from router import server\n"
              "server.exit_if_teardown_hangs(0.3)\n"
              "threading.Event().wait()\n")   # a teardown that never ends
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert "teardown took over 0.3 s after the stop; exiting" in done.stderr
