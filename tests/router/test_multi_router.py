"""Two routers in one event loop on one Redis and key prefix, with scripted
replicas: the cross-router paths one by one (lazy adoption by a pop, output
delivered through the front's event stream, re-attach at another router,
cancel across routers, a replica moving between routers, missed events,
pull affinity with work another router submitted)."""

import asyncio
import contextlib
import time
import uuid

from common.pb.quadriga.v1 import generation_pb2 as gpb
from router.server import RouterApp
from tests.router.test_prefix_policies import H16, HITS_DECIDE, SHARED, with_shared
from tests.router.test_scheduling import assigned_ids, submit_in_order, wait_until
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens


def configs(redis_url, model, count=2, **kw):
    prefix = f"multi{uuid.uuid4().hex[:6]}:"
    return [make_config(redis_url, model, redis_prefix=prefix, **kw) for _ in range(count)]


@contextlib.asynccontextmanager
async def two_routers(redis_url, model, **kw):
    first, second = configs(redis_url, model, **kw)
    async with running_router(first) as a, running_router(second) as b:
        yield a, b


async def wait_for_remote_replicas(app, n=1):
    await wait_until(lambda: app.lease.remote_replicas >= n)


async def far_replica(front, back, **kw):
    """A scripted replica "far" on router `back`, once `front` counts it:
    (vocab, its Replicas group, the replica)."""
    vocab = front.limits.vocab_size
    reps = Replicas(back.address, vocab)
    rep = await reps.add("far", **kw)
    await wait_for_remote_replicas(front)
    return vocab, reps, rep


def test_a_request_accepted_by_one_router_runs_on_a_replica_of_another(redis_url, tiny_model, arun):
    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab, reps, rep = await far_replica(a, b, step_delay=0.005)
            prompts = [[i + 3, 5] for i in range(6)]
            async with client(a.address) as stub:
                results = await asyncio.gather(*(collect(stub, request(p, 20)) for p in prompts))
            for p, msgs in zip(prompts, results):
                assert tokens_of(msgs) == expected_tokens(p, 20, vocab)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                assert msgs[-1].timings.replica_id == "far"
                assert msgs[-1].timings.requeues == 0
            assert len(rep.rec.assignments) == len(prompts) and not rep.rec.cancels
            await wait_until(lambda: not a.table.requests and not b.table.requests)
            assert a.events.applied > 0
            await reps.close()

    arun(scenario())


def test_reattach_at_another_router_mid_stream(redis_url, tiny_model, arun):
    """A second stream of the same request at the other router replays from
    token 0 and follows it live; both streams get every token once."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab = a.limits.vocab_size
            reps = Replicas(a.address, vocab)
            await reps.add("near", step_delay=0.02)
            req = request([9, 4], 60, request_id="twice")
            async with client(a.address) as stub_a, client(b.address) as stub_b:
                first = asyncio.create_task(collect(stub_a, req))
                await wait_until(lambda: a.table.get("twice") and len(a.table.get("twice").tokens) >= 5)
                second = await collect(stub_b, req)
                assert tokens_of(second) == expected_tokens([9, 4], 60, vocab)
                assert tokens_of(await first) == expected_tokens([9, 4], 60, vocab)
            await reps.close()

    arun(scenario())


def test_cancel_at_the_front_cancels_on_the_other_routers_replica(redis_url, tiny_model, arun):
    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab, reps, rep = await far_replica(a, b, hold_on_finish=True)
            async with client(a.address) as stub:
                task = asyncio.create_task(collect(stub, request([2], 5, request_id="doomed")))
                await wait_until(lambda: rep.rec.assignments)
                assert (await stub.Cancel(gpb.CancelRequest(request_id="doomed"))).cancelled
                msgs = await task
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
            await wait_until(lambda: rep.rec.cancels == ["doomed"])
            await wait_until(lambda: b.table.get("doomed") is None)
            await reps.close()

    arun(scenario())


def test_a_replica_moving_to_another_router_keeps_its_work(redis_url, tiny_model, arun):
    """The replica's router stops; the replica registers with the other one,
    which adopts what it runs: the clients there see no break and every token
    once. (A scripted replica does not resend deltas the stopped router never
    read, so a request whose last deltas were in flight then resumes from what
    Redis recorded; the real worker resends them: tests/e2e/test_multi_router.py.)"""

    async def scenario():
        first, second = configs(redis_url, tiny_model, lease_ttl=10.0)
        a = RouterApp(first)
        await a.start()
        a_address = f"127.0.0.1:{a.port}"
        async with running_router(second) as b:
            vocab = b.limits.vocab_size
            reps = Replicas(f"{a_address},{b.address}", vocab)
            rep = await reps.add("mover", step_delay=0.03, reconnect=True, capacity=4)
            await wait_for_remote_replicas(b)
            prompts = [[i + 1, 8] for i in range(6)]
            async with client(b.address) as stub:
                tasks = [asyncio.create_task(collect(stub, request(p, 40))) for p in prompts]
                await wait_until(lambda: len(rep.running) == 4 and rep.steps >= 5)
                await a.stop(grace=0.2)
                results = await asyncio.gather(*tasks)
            for p, msgs in zip(prompts, results):
                assert tokens_of(msgs) == expected_tokens(p, 40, vocab)
                assert msgs[-1].timings.replica_id == "mover"
            assert len(rep.rec.registered) == 2
            assert len(rep.rec.registered[1].keep_request_ids) == 4, "B adopts all four"
            requeued = {x.labels["reason"] for x in b.metrics.requeues.collect()[0].samples
                        if x.name.endswith("_total") and x.value}
            assert requeued <= {"diverged"}
            await reps.close()

    arun(scenario())


def test_missed_events_are_read_back_from_redis(redis_url, tiny_model, arun):
    """The front loses every other output event (as when its stream was trimmed
    past what it had read): each gap makes it reload the request, and its
    clients still get every token, and its text, once."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab = a.limits.vocab_size
            apply, seen = a.events.apply, [0]

            def lossy(fields):
                seen[0] += 1
                if fields.get("k") == b"d" and seen[0] % 2:
                    return
                apply(fields)

            a.events.apply = lossy
            reps = Replicas(b.address, vocab)
            await reps.add("far", step_delay=0.01)
            await wait_for_remote_replicas(a)
            prompts = [[i + 7, 1] for i in range(4)]
            async with client(a.address) as stub:
                results = await asyncio.gather(*(collect(stub, request(p, 30)) for p in prompts))
            for p, msgs in zip(prompts, results):
                want = expected_tokens(p, 30, vocab)
                assert tokens_of(msgs) == want
                assert "".join(m.text for m in msgs) == "".join(f"<{t}>" for t in want)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()

    arun(scenario())


def test_per_replica_policies_balance_per_router_and_share_the_queue(redis_url, tiny_model, arun):
    """round_robin with two routers: router A rotates its arrivals over its own
    two replicas; router B has no replica, so its arrivals wait in the shared
    queue and A's replicas take them once their own queues are empty."""

    async def scenario():
        async with two_routers(redis_url, tiny_model, policy="round_robin") as (a, b):
            vocab = a.limits.vocab_size
            reps = Replicas(a.address, vocab)
            r0 = await reps.add("r0", step_delay=0.005)
            r1 = await reps.add("r1", step_delay=0.005)
            await wait_for_remote_replicas(b, 2)
            prompts = [[i + 2, 3] for i in range(8)]
            async with client(a.address) as stub_a, client(b.address) as stub_b:
                results = await asyncio.gather(*(collect(stub_a if i < 4 else stub_b, request(p, 10))
                                                 for i, p in enumerate(prompts)))
            for p, msgs in zip(prompts, results):
                assert tokens_of(msgs) == expected_tokens(p, 10, vocab)
            assert {m[-1].timings.replica_id for m in results[:4]} == {"r0", "r1"}
            assert len(r0.rec.assignments) + len(r1.rec.assignments) == len(prompts)
            await reps.close()

    arun(scenario())


def test_pull_affinity_takes_the_head_another_router_submitted(redis_url, tiny_model, arun):
    """B's replica holds the prefix of B's newest request; an older request
    accepted by A (which has no replica) leads the shared queue. B's policy sees
    only B's requests, so its named pop takes from the head instead: A's request
    first (adopted from its record), then B's by cache, ahead of B's older one."""

    async def scenario():
        async with two_routers(redis_url, tiny_model, pull_affinity_wait_weight=0.0) as (a, b):
            vocab = b.limits.vocab_size
            reps = Replicas(b.address, vocab)
            r1 = await reps.add("r1", auto_pull=False, prefix_cache=True, cached=tuple(H16.hashes(SHARED)))
            await wait_for_remote_replicas(a)
            async with client(a.address) as stub_a, client(b.address) as stub_b:
                tasks = await submit_in_order(a, stub_a, [request([7] * 30, 4, request_id="theirs")])
                tasks += await submit_in_order(b, stub_b, [
                    request([6] * 30, 4, request_id="cold_mine"),
                    request(with_shared([9]), 4, request_id="warm_mine")])
                for n in range(1, 4):
                    r1.pull(1)
                    await wait_until(lambda: len(assigned_ids(r1)) == n)
                results = await asyncio.gather(*tasks)
            assert assigned_ids(r1) == ["theirs", "warm_mine", "cold_mine"]
            assert tokens_of(results[0]) == expected_tokens([7] * 30, 4, vocab)
            assert b.metrics.registry.get_sample_value("quadriga_pull_picks_total",
                                                       {"reason": "affinity"}) == 1
            await reps.close()

    arun(scenario())


def test_a_resend_whose_submit_is_overtaken_by_a_pop_of_the_stored_request(redis_url, tiny_model, arun):
    """A client re-sends its request, by id, to another router (its own died)
    while it is still queued in Redis. That router's copy is admitted, and its
    pop takes the stored request before the submit's reply (id taken) is back:
    the pop adopts the stored request, the submit's copy goes, and the client
    streams the run like the first one."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab = a.limits.vocab_size
            reps = Replicas(b.address, vocab)
            rep = await reps.add("late", auto_pull=False)
            await wait_for_remote_replicas(a)
            req = request([6, 2], 12, request_id="raced")
            async with client(a.address) as stub_a, client(b.address) as stub_b:
                first = asyncio.create_task(collect(stub_a, req))
                await wait_until(lambda: a.table.get("raced") is not None and a.table.get("raced").confirmed)
                gate, admit = asyncio.Event(), b.table.admit

                def admit_with_a_late_reply(*args, **kwargs):
                    copy, stored = admit(*args, **kwargs)

                    async def late():
                        result = await stored
                        await gate.wait()
                        return result

                    return copy, asyncio.ensure_future(late())

                b.table.admit = admit_with_a_late_reply
                second = asyncio.create_task(collect(stub_b, req))
                await wait_until(lambda: b.table.get("raced") is not None)
                submitted = b.table.get("raced")
                assert not submitted.confirmed
                rep.pull(1)
                await wait_until(lambda: rep.rec.assignments)
                assert b.table.get("raced") is not submitted  # the stored request, adopted
                gate.set()
                for msgs in (await second, await first):
                    assert tokens_of(msgs) == expected_tokens([6, 2], 12, vocab)
                    assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
            await reps.close()

    arun(scenario())


async def kicks_heard(app) -> int:
    """'q' events (the shared queue has work) in this router's event stream."""
    entries = await app.store.redis.xrange(app.store.events_key(app.lease.router_id))
    return sum(1 for _, fields in entries if fields.get(b"k") == b"q")


def test_an_arrival_a_local_replica_can_take_wakes_no_other_router(redis_url, tiny_model, arun):
    """Both routers' replicas have seats; every request A accepts (ids A made
    and clients' ids) runs on A's replica, and B is never told of them: a kick
    would have it race A for each request, and run the ones it won for A's
    clients through A's event stream."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab = a.limits.vocab_size
            reps_a, reps_b = Replicas(a.address, vocab), Replicas(b.address, vocab)
            near = await reps_a.add("near", capacity=4, step_delay=0.002)
            far = await reps_b.add("far", capacity=4, step_delay=0.002)
            await wait_for_remote_replicas(a)
            await wait_for_remote_replicas(b)
            # B's probe (a pop each reaper tick while its replica idles) may take
            # a request in the moment between A's submit and A's pop; only a
            # kick is under test here (the probe: the last test of this file).
            b.scheduler.probe_shared_queue = lambda: None
            def seats_at_a() -> int:
                credit = a.scheduler.credit_of("near")
                return credit.seats(a.table.owned_count("near")) if credit else 0

            async with client(a.address) as stub:
                for k in range(4):
                    # Each arrival has a seat waiting (else a kick is right).
                    await wait_until(lambda: seats_at_a() >= 3)
                    batch = [request([k + 2, i + 1], 6, **({"request_id": f"c{k}-{i}"} if i % 2 else {}))
                             for i in range(3)]
                    results = await asyncio.gather(*(collect(stub, r) for r in batch))
                    for r, msgs in zip(batch, results):
                        assert tokens_of(msgs) == expected_tokens(list(r.prompt_token_ids), 6, vocab)
            assert len(near.rec.assignments) == 12 and not far.rec.assignments
            assert await kicks_heard(b) == 0
            await reps_a.close()
            await reps_b.close()

    arun(scenario())


def test_an_arrival_left_queued_by_its_router_is_announced_at_once(redis_url, tiny_model, arun):
    """A's free replica had a seat when the request came (so no kick went with
    its submit), but A's policy leaves it for A's busy replica, which holds its
    prefix: the round that left it tells B at once, and B's free replica takes
    it, instead of after B's next probe (the reaper's tick, 2 s here)."""

    async def scenario():
        async with two_routers(redis_url, tiny_model, heartbeat_interval=2.0, lease_ttl=6.0,
                               pull_affinity_max_wait=30.0, **HITS_DECIDE) as (a, b):
            vocab = a.limits.vocab_size
            reps_a, reps_b = Replicas(a.address, vocab), Replicas(b.address, vocab)
            await reps_a.add("holder", auto_pull=False, prefix_cache=True, cached=tuple(H16.hashes(SHARED)))
            cold = await reps_a.add("cold", auto_pull=False, prefix_cache=True)
            cold.pull(1)
            await wait_until(lambda: a.scheduler.credit_of("cold").requests == 1)
            far = await reps_b.add("far", step_delay=0.002)
            await wait_for_remote_replicas(b, 2)
            async with client(a.address) as stub:
                task = asyncio.create_task(collect(stub, request(with_shared([5]), 6)))
                await asyncio.wait_for(wait_until(lambda: len(far.rec.assignments) == 1), 1.0)
                msgs = await task
            assert tokens_of(msgs) == expected_tokens(with_shared([5]), 6, vocab)
            assert not cold.rec.assignments
            await reps_a.close()
            await reps_b.close()

    arun(scenario())


def test_a_request_no_router_was_told_of_is_found_by_the_probe(redis_url, tiny_model, arun):
    """A request stored in the shared queue without a kick whose router never
    popped it (as when that router is killed between the two): B's replica
    has a seat and B thinks the queue empty; its reaper's probe pops it."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            vocab = b.limits.vocab_size
            reps = Replicas(b.address, vocab)
            far = await reps.add("far", step_delay=0.002)
            await wait_for_remote_replicas(a)
            await wait_until(lambda: not b.scheduler._shared_work)
            await a.writer.call(a.store.submit("orphan", "tok", "d", "{}", [3, 4], 5, 0, time.time(), 1,
                                               "pending", tell_others=False))
            assert await kicks_heard(b) == 0
            await wait_until(lambda: assigned_ids(far) == ["orphan"])
            await reps.close()

    arun(scenario())


def test_a_request_whose_record_redis_lost_while_another_router_ran_it_is_stored_again_and_finishes(
        redis_url, tiny_model, arun):
    """Redis lost the record of a request that router B runs for router A's
    client. B's next step finds no record and no tombstone (nothing removed it
    on purpose), so B stores it again, naming no front, and runs on; A, hearing
    nothing of it for two leases, reads it back with an ATTACH, which names A a
    front again, and its client gets the exact output. Another request runs on."""

    async def scenario():
        async with two_routers(redis_url, tiny_model, lease_ttl=1.0) as (a, b):
            vocab, reps, rep = await far_replica(a, b, step_delay=0.02)
            r = a.store.redis
            record_key = a.store.req_key("lost")
            async with client(a.address) as stub:
                lost = asyncio.create_task(collect(stub, request([3], 300, request_id="lost"),
                                                   timeout=60))
                kept = asyncio.create_task(collect(stub, request([4], 50, request_id="kept"),
                                                   timeout=60))
                await wait_until(lambda: a.table.get("lost") and len(a.table.get("lost").tokens) >= 5)
                await r.delete(record_key, a.store.out_key("lost"), a.store.txt_key("lost"))
                await wait_until(lambda: b.metrics.lost_writes.labels("record").value >= 1)
                for _ in range(500):   # A's read-back names it a front again
                    if await r.hget(record_key, "fe") == a.lease.router_id.encode():
                        break
                    await asyncio.sleep(0.02)
                assert await r.hget(record_key, "fe") == a.lease.router_id.encode()
                assert tokens_of(await lost) == expected_tokens([3], 300, vocab)
                assert tokens_of(await kept) == expected_tokens([4], 50, vocab)
            assert "lost" not in rep.rec.cancels
            await wait_until(lambda: not a.table.requests and not b.table.requests)
            await reps.close()

    arun(scenario())


def test_a_request_its_front_abandoned_is_not_stored_again_by_the_router_running_it(
        redis_url, tiny_model, arun):
    """A request router B runs is abandoned (lua.ABANDON, as its front does
    after a submit that timed out): its record is gone as a lost one would be.
    The abandon is run here under B's own fence, so no cancel event reaches B
    (as when that event is late): B learns of it only from its next step's
    "no record", and the tombstone makes its RESTORE refuse. B stops it on its
    replica, stores nothing and counts no lost record."""

    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            _vocab, reps, rep = await far_replica(a, b, step_delay=0.02)
            async with client(a.address) as stub:
                task = asyncio.create_task(collect(stub, request([3], 400, request_id="x"),
                                                   timeout=60))
                await wait_until(lambda: a.table.get("x") and len(a.table.get("x").tokens) >= 5)
                await b.writer.call(b.store.abandon("x", a.table.get("x").submit_token))
                await wait_until(lambda: "x" in rep.rec.cancels)
                await wait_until(lambda: "x" not in b.table.requests)
                await asyncio.sleep(0.3)   # a step that was in flight has been answered
                assert not await a.store.redis.exists(a.store.req_key("x"))
                assert b.metrics.lost_writes.labels("record").value == 0
                task.cancel()
            await reps.close()

    arun(scenario())


def test_a_front_left_out_of_a_restored_record_attaches_again_and_streams_on(
        redis_url, tiny_model, arun):
    """Router B runs a request for clients on both routers (A submitted it, a
    second stream re-attached at B). Redis loses its record; B, a front and
    its back router, stores it again naming only itself a front, so A hears
    nothing more of it. A, silent for two leases, reads it back with an
    ATTACH, which names A a front again: the rest of the output reaches A's
    stream as events, and both streams end with the exact output."""

    async def scenario():
        async with two_routers(redis_url, tiny_model, lease_ttl=1.0) as (a, b):
            vocab, reps, _rep = await far_replica(a, b, step_delay=0.02)
            req = request([3], 300, request_id="kept")
            record_key = a.store.req_key("kept")
            r = a.store.redis
            both = {a.lease.router_id, b.lease.router_id}

            async def fronts() -> set:
                return set((await r.hget(record_key, "fe") or b"").decode().split())

            async with client(a.address) as stub_a, client(b.address) as stub_b:
                at_a = asyncio.create_task(collect(stub_a, req, timeout=60))
                await wait_until(lambda: a.table.get("kept") and len(a.table.get("kept").tokens) >= 5)
                at_b = asyncio.create_task(collect(stub_b, req, timeout=60))
                for _ in range(500):   # B's ATTACH names both routers
                    if await fronts() == both:
                        break
                    await asyncio.sleep(0.02)
                await r.delete(record_key, a.store.out_key("kept"), a.store.txt_key("kept"))
                restored_alone = False
                for _ in range(500):   # B's restore names only B, until A attaches again
                    names = await fronts()
                    restored_alone |= names == {b.lease.router_id}
                    if restored_alone and names == both:
                        break
                    await asyncio.sleep(0.02)
                assert restored_alone and await fronts() == both
                expected = expected_tokens([3], 300, vocab)
                assert tokens_of(await at_b) == expected
                assert tokens_of(await at_a) == expected
            await reps.close()

    arun(scenario())


class _SlowReplies:
    """A router's writer as its admission sees it: each write goes to Redis as
    usual, its reply reaches the caller a second later (a slow round trip)."""

    def __init__(self, writer):
        self._writer = writer

    def __getattr__(self, name):
        return getattr(self._writer, name)

    def call(self, write):
        reply = self._writer.call(write)

        async def later():
            result = await reply
            await asyncio.sleep(1.0)
            return result
        return asyncio.ensure_future(later())


def test_a_client_that_leaves_while_its_reattach_is_on_the_way_strands_nothing(redis_url, tiny_model, arun):
    """Router B's ATTACH names it a front in Redis whether or not the client waits
    for the reply: B takes the request in when the reply comes, then ends it as a
    disconnect does, so nothing is left leased to a replica that never got it and
    the first client, on router A, hears the end."""
    async def scenario():
        async with two_routers(redis_url, tiny_model) as (a, b):
            near = Replicas(a.address, a.limits.vocab_size)
            await near.add("ra", step_delay=0.2)
            req = request([9, 4], 40, request_id="x")
            async with client(a.address) as sa, client(b.address) as sb:
                first = asyncio.create_task(collect(sa, req, timeout=60))
                await wait_until(lambda: a.table.get("x") and len(a.table.get("x").tokens) >= 2)
                b.admission.writer = _SlowReplies(b.admission.writer)
                again = asyncio.create_task(collect(sb, req, timeout=60))
                await asyncio.sleep(0.4)
                again.cancel()                       # the re-attaching client gives up
                await asyncio.gather(again, return_exceptions=True)
                await wait_until(lambda: not b.table._attaching, timeout=10)
                msgs = await asyncio.wait_for(first, 20)
                assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
            await near.close()

    arun(scenario(), timeout=90)
