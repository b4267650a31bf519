"""Redis faults under a live router: replies lost after Redis ran the command,
stalls, and writes held in flight. Faults are injected by a TCP proxy between
the router and a real Redis (tests/support/fault_proxy.py), so the router's
own code runs unchanged."""

import asyncio
import time

import grpc
import pytest
import redis

from common.pb.quadriga.v1 import generation_pb2 as gpb
from router.persistence import lua
from router.persistence.resp import Script
from tests.router.test_scheduling import wait_until
from tests.support.fault_proxy import FaultProxy
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens

SUBMIT, POP, STEP, REQUEUE = (Script(s).sha.encode() for s in (lua.SUBMIT, lua.POP, lua.STEP,
                                                               lua.REQUEUE))


@pytest.fixture
def direct(redis_server):
    """A client of the Redis behind the proxy, around the router's faults."""
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def proxy(redis_server):
    redis_server.flushall()
    p = FaultProxy(redis_server.port).start()
    yield p
    p.release()
    p.stop()


def permanent(name: str) -> bool:
    """Keys that live as long as the deployment: counters, the live set, router
    leases and each live router's event stream."""
    return name in ("seq", "ao", "live", "epoch", "routers") or name.startswith(("router:", "ev:"))


async def keys_without_ttl(store) -> list[str]:
    out = []
    async for key in store.redis.scan_iter(match=f"{store.prefix}*"):
        name = key.decode()[len(store.prefix):]
        if not permanent(name) and await store.redis.ttl(key) < 0:
            out.append(name)
    return out


async def assert_clean(app):
    """Every request finished: nothing queued, in flight or live; everything expires."""
    await app.writer.drain(5)
    assert await keys_without_ttl(app.store) == []
    assert await app.store.redis.zcard(app.store.inflight_key) == 0
    assert await app.store.live_ids() == []


def test_submit_whose_reply_is_lost_is_stored_once(proxy, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0")
            proxy.drop_reply_after(SUBMIT)
            async with client(app.address) as stub:
                msgs = await collect(stub, request([4], 6, request_id="s"))
            assert tokens_of(msgs) == expected_tokens([4], 6, vocab)
            assert proxy.dropped == 1
            assert app.metrics.accepted.value == 1
            assert len(reps["r0"].rec.assignments) == 1
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_submit_past_its_deadline_is_unavailable_and_a_retry_starts_afresh(proxy, tiny_model, arun):
    """Redis runs the submit but says nothing for longer than submit_timeout: the
    client is told UNAVAILABLE, and retrying the same request_id later works
    (no ghost record is left to block it)."""
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, redis_timeout=0.3, submit_timeout=0.8)
        async with running_router(cfg) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0")
            async with client(app.address) as stub:
                proxy.hold(SUBMIT)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([5], 4, request_id="g"), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Redis" in err.value.details() and "retry" in err.value.details()
                proxy.release()
                await wait_until(lambda: not app.table.withdrawing("g"), timeout=10)
                msgs = await collect(stub, request([5], 4, request_id="g"), timeout=10)
            assert tokens_of(msgs) == expected_tokens([5], 4, vocab)
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_pop_whose_reply_is_lost_still_assigns_once(proxy, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            rep = await reps.add("r0")
            proxy.drop_reply_after(POP)
            async with client(app.address) as stub:
                msgs = await collect(stub, request([6], 5, request_id="p"))
            assert tokens_of(msgs) == expected_tokens([6], 5, vocab)
            assert [a.request_id for a in rep.rec.assignments] == ["p"]
            assert msgs[-1].timings.requeues == 0
            await reps.close()
            await assert_clean(app)

    arun(scenario())


@pytest.mark.parametrize("lost_step", [1, 4], ids=["mid-stream", "finishing-step"])
def test_step_write_whose_reply_is_lost_drops_no_one(proxy, tiny_model, arun, lost_step):
    """The replica stays, nothing is requeued, the client gets every token once
    and the finish; a re-attach afterwards replays the same output from Redis."""
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            rep = await reps.add("r0", step_delay=0.05)
            session = app.registry.get("r0")
            proxy.drop_reply_after(STEP, skip=lost_step)
            async with client(app.address) as stub:
                req = request([7], 5, request_id="w")
                msgs = await collect(stub, req, timeout=20)
                assert tokens_of(msgs) == expected_tokens([7], 5, vocab)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.requeues == 0
                # Shown on arrival: the lost reply and its retry may come after the finish.
                await wait_until(lambda: proxy.dropped == 1)
                await app.writer.drain(5)
                again = await collect(stub, req, timeout=20)
                assert tokens_of(again) == expected_tokens([7], 5, vocab)
            assert app.registry.get("r0") is session and rep.rec.errors == []
            assert app.metrics.requeues.labels("replica_gone").value == 0
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_requeue_whose_reply_is_lost_resumes_exactly(proxy, tiny_model, arun):
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, lease_ttl=1.0, heartbeat_interval=0.25)
        async with running_router(cfg) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.05)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([5], 30, request_id="k"), timeout=20))
                await wait_until(lambda: "k" in app.table.requests
                                 and len(app.table.requests["k"].tokens) >= 3)
                proxy.drop_reply_after(REQUEUE)
                await reps.kill("r0")
                await reps.add("r1", step_delay=0.01)
                msgs = await t
            assert tokens_of(msgs) == expected_tokens([5], 30, vocab)
            assert msgs[-1].timings.replica_id == "r1" and msgs[-1].timings.requeues == 1
            assert proxy.dropped == 1
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_cancel_while_a_step_write_is_held_leaks_no_key(proxy, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r", step_delay=0.05)
            async with client(app.address) as stub:
                proxy.hold(STEP)
                t = asyncio.create_task(collect(stub, request([3], 50, request_id="c")))
                await asyncio.to_thread(proxy.held.wait, 10)
                assert (await stub.Cancel(gpb.CancelRequest(request_id="c"))).cancelled
                proxy.release()
                msgs = await t
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
            await reps.close()
            await assert_clean(app)

    arun(scenario())


@pytest.mark.parametrize("take_at_arrival", [0, 1])
def test_replica_leaving_while_a_submit_to_its_queue_is_in_flight(proxy, tiny_model, arun,
                                                                  take_at_arrival):
    """round_robin binds a request to r0 (its queue; or, taken at arrival, r0
    itself, the Assign held for the submit's reply); r0 goes away before the
    submit is durable: the request still runs (on r1), not left with r0."""
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, policy="round_robin",
                          take_at_arrival=take_at_arrival)
        async with running_router(cfg) as app:
            await wait_until(lambda: app.lease.alone)
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0")
            await reps.add("r1")
            for name in ("r0", "r1"):
                await wait_until(lambda: app.scheduler.credit_of(name).wants_work(0))
            await asyncio.sleep(0.3)   # each replica's first pop (of its own queue) is back
            proxy.hold(SUBMIT)
            async with client(app.address) as stub:
                t = asyncio.create_task(collect(stub, request([4], 5, request_id="s"), timeout=10))
                await asyncio.to_thread(proxy.held.wait, 10)
                held = app.table.requests["s"]
                if take_at_arrival:
                    assert (held.queue, held.owner) == ("", "r0")
                else:
                    assert held.queue == "r:r0"
                await reps.kill("r0")
                await wait_until(lambda: app.registry.get("r0") is None)
                proxy.release()
                msgs = await t
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.replica_id == "r1"
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_redis_stall_pauses_nothing_shown_and_turns_new_work_away(proxy, tiny_model, arun):
    """Redis stops answering for 2 s mid-stream: streams go on from memory (no
    client waits more than the stall threshold plus a step), new requests get
    UNAVAILABLE once a whole deadline has passed, and everything lands once
    Redis is back."""
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, redis_timeout=0.5, submit_timeout=0.5,
                          stall_after=0.3)
        async with running_router(cfg) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.02, capacity=8)
            gaps: dict[str, float] = {}

            async def follow(stub, rid, prompt):
                msgs, last = [], time.monotonic()
                async for m in stub.Generate(request(prompt, 150, request_id=rid), timeout=30):
                    now = time.monotonic()
                    gaps[rid] = max(gaps.get(rid, 0.0), now - last)
                    last = now
                    msgs.append(m)
                return msgs

            async with client(app.address) as stub:
                prompts = {f"s{i}": [i + 1] for i in range(4)}
                tasks = [asyncio.create_task(follow(stub, rid, p)) for rid, p in prompts.items()]
                await wait_until(lambda: all(rid in app.table.requests and
                                             len(app.table.requests[rid].tokens) > 5 for rid in prompts))
                proxy.hold()
                await asyncio.sleep(1.0)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([9], 3, request_id="late"), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(1.0)
                proxy.release()
                results = await asyncio.gather(*tasks)
                for (rid, p), msgs in zip(prompts.items(), results):
                    assert tokens_of(msgs) == expected_tokens(p, 150, vocab), rid
                    again = await collect(stub, request(p, 150, request_id=rid))
                    assert tokens_of(again) == expected_tokens(p, 150, vocab), rid
                late = await collect(stub, request([9], 3, request_id="late"))
                assert tokens_of(late) == expected_tokens([9], 3, vocab)
            # Served from memory during the stall: no stream waited for Redis.
            assert max(gaps.values()) < 1.0, gaps
            assert app.registry.get("r0") is not None
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def held_writes_config(proxy, model, show_output: str):
    """Deadlines long enough that writes the proxy holds for a second or two are
    neither retried nor a stall: only show_output decides what clients see."""
    return make_config(proxy.url, model, redis_timeout=5.0, submit_timeout=5.0, stall_after=5.0,
                       show_output=show_output)


@pytest.mark.parametrize("show_output", ["first_and_finish", "on_arrival", "once_durable"])
def test_mid_stream_output_waits_for_redis_unless_shown_on_arrival(proxy, direct, tiny_model,
                                                                   arun, show_output):
    """Step writes held mid-stream (Redis slower than a step, not yet stalled):
    on_arrival streams on from memory, ahead of what Redis holds; the other two
    show nothing new until Redis has it. Either way the output is exact and lands."""
    async def scenario():
        async with running_router(held_writes_config(proxy, tiny_model, show_output)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.02)
            seen: list[int] = [0]

            async def follow(stub):
                msgs = []
                async for m in stub.Generate(request([3], 200, request_id="a"), timeout=30):
                    msgs.append(m)
                    seen[0] = len(tokens_of(msgs))
                return msgs

            async with client(app.address) as stub:
                task = asyncio.create_task(follow(stub))
                await wait_until(lambda: seen[0] > 5)
                proxy.hold(STEP)
                await wait_until(proxy.held.is_set)
                await asyncio.sleep(0.1)
                at_hold = seen[0]
                await asyncio.sleep(1.0)
                recorded = direct.strlen(app.store.out_key("a")) // 4
                if show_output == "on_arrival":
                    assert seen[0] >= at_hold + 20 and seen[0] > recorded, (at_hold, seen[0], recorded)
                else:
                    assert seen[0] == at_hold <= recorded, (at_hold, seen[0], recorded)
                proxy.release()
                msgs = await task
                assert tokens_of(msgs) == expected_tokens([3], 200, vocab)
                assert msgs[-1].timings.requeues == 0
                again = await collect(stub, request([3], 200, request_id="a"))
                assert tokens_of(again) == expected_tokens([3], 200, vocab)
            await reps.close()
            await assert_clean(app)

    arun(scenario())


@pytest.mark.parametrize("show_output", ["first_and_finish", "once_durable"])
def test_first_token_and_finish_are_shown_before_redis_holds_them(proxy, direct, tiny_model,
                                                                 arun, show_output):
    """Every step write held from the first token on: first_and_finish (the
    default) shows the first token, then the rest with the finish, while Redis
    holds none of it; once_durable shows nothing until Redis has it."""
    async def scenario():
        async with running_router(held_writes_config(proxy, tiny_model, show_output)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.3)
            arrivals: list[tuple[float, int, bool]] = []

            async def follow(stub):
                msgs = []
                async for m in stub.Generate(request([5], 4, request_id="e"), timeout=30):
                    msgs.append(m)
                    arrivals.append((time.monotonic(), len(tokens_of(msgs)), m.HasField("timings")))
                return msgs

            proxy.hold(STEP)
            async with client(app.address) as stub:
                task = asyncio.create_task(follow(stub))
                await wait_until(proxy.held.is_set)
                held_at = time.monotonic()
                if show_output == "first_and_finish":
                    await wait_until(lambda: arrivals and arrivals[-1][2])
                    first, last = arrivals[0], arrivals[-1]
                    assert first[1] == 1 and first[0] - held_at < 0.25, arrivals  # before step 2
                    assert last[1] == 4 and direct.strlen(app.store.out_key("e")) == 0, arrivals
                else:
                    await asyncio.sleep(1.5)   # past every step
                    assert arrivals == []
                proxy.release()
                msgs = await task
                assert tokens_of(msgs) == expected_tokens([5], 4, vocab)
            await app.writer.drain(5)
            [rec] = await app.store.load_requests(["e"])
            assert rec["tokens"] == expected_tokens([5], 4, vocab) and rec["st"] == b"f"
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_output_redis_lost_after_acknowledging_it_is_written_again(proxy, direct,
                                                                   tiny_model, arun):
    """Redis drops output it had acknowledged (as a restart from an AOF fsynced
    once a second may): the next step finds the hole and the router writes the
    request's output again from memory, so the record holds the exact output,
    not zeros where the lost tokens were."""
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.02)
            out_key, txt_key = app.store.out_key("h"), app.store.txt_key("h")
            async with client(app.address) as stub:
                task = asyncio.create_task(collect(stub, request([4], 120, request_id="h")))
                await wait_until(lambda: direct.strlen(out_key) >= 4 * 30)
                direct.set(out_key, direct.getrange(out_key, 0, 4 * 5 - 1))
                direct.delete(txt_key)
                msgs = await task
                assert tokens_of(msgs) == expected_tokens([4], 120, vocab)
                await app.writer.drain(5)
                [rec] = await app.store.load_requests(["h"])
                assert rec["tokens"] == expected_tokens([4], 120, vocab)
                assert rec["st"] == b"f"
                assert app.metrics.lost_writes.labels("output").value >= 1
                again = await collect(stub, request([4], 120, request_id="h"))
                assert tokens_of(again) == expected_tokens([4], 120, vocab)
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_queued_requests_redis_lost_are_stored_again_once_it_answers(proxy, direct,
                                                                     tiny_model, arun):
    """Redis comes back without queued requests it had stored (acknowledged
    writes lost): once the router's writes reconnect it stores them again, with
    their arrival, and they run exactly."""
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            await reps.add("r0", step_delay=0.4, capacity=1)
            prompts = {"blocker": [1], **{f"q{i}": [i + 2] for i in range(3)}}
            async with client(app.address) as stub:
                tasks = {}
                for rid, p in prompts.items():   # the blocker takes the one seat
                    tasks[rid] = asyncio.create_task(collect(stub, request(p, 3, request_id=rid),
                                                             timeout=30))
                    await wait_until(lambda: rid in app.table.requests)
                queued = [rid for rid in prompts if rid != "blocker"]
                await wait_until(lambda: all(app.table.requests[rid].confirmed for rid in queued))
                assert all(app.table.requests[rid].phase.value == "queued" for rid in queued)
                direct.delete(*(app.store.req_key(rid) for rid in queued))
                for key in direct.scan_iter(match=app.store.queue_key("*")):
                    direct.delete(key)
                proxy.reset()   # Redis "restarted": the next write reconnects
                await wait_until(lambda: app.metrics.lost_writes.labels("submit").value == 3)
                for rid, p in prompts.items():
                    msgs = await tasks[rid]
                    assert tokens_of(msgs) == expected_tokens(p, 3, vocab), rid
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_a_running_request_whose_record_redis_lost_is_stored_again_and_finishes(
        proxy, direct, tiny_model, arun):
    """Redis lost a running request's whole record (a restart from an AOF fsynced
    once a second drops the writes that stored and leased a request that had
    just started): the router that runs and fronts it stores it again from
    memory, and it finishes exactly, in Redis too, with nothing recomputed; the
    others run on."""
    async def scenario():
        async with running_router(make_config(proxy.url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            rep = await reps.add("r0", step_delay=0.02)
            async with client(app.address) as stub:
                gone = asyncio.create_task(collect(stub, request([3], 200, request_id="gone"),
                                                   timeout=30))
                other = asyncio.create_task(collect(stub, request([4], 50, request_id="kept"),
                                                    timeout=30))
                await wait_until(lambda: direct.strlen(app.store.out_key("gone")) >= 4 * 5)
                direct.delete(app.store.req_key("gone"), app.store.out_key("gone"),
                              app.store.txt_key("gone"))
                direct.zrem(app.store.inflight_key, "gone")
                direct.srem(app.store.live_key, "gone")
                msgs = await gone
                assert tokens_of(msgs) == expected_tokens([3], 200, vocab)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.requeues == 0
                kept = await other
                assert tokens_of(kept) == expected_tokens([4], 50, vocab)
                await app.writer.drain(5)
                [rec] = await app.store.load_requests(["gone"])
                assert rec["tokens"] == expected_tokens([3], 200, vocab) and rec["st"] == b"f"
                again = await collect(stub, request([3], 200, request_id="gone"))
                assert tokens_of(again) == expected_tokens([3], 200, vocab)
            assert app.metrics.lost_writes.labels("record").value >= 1
            assert len(rep.rec.assignments) == 2 and not rep.rec.cancels
            await reps.close()
            await assert_clean(app)

    arun(scenario())
