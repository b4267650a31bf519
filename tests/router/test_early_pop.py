"""How soon a request reaches its replica. A request arriving while a replica
has a seat and nothing else waits is taken at arrival: stored leased to that
replica (table.admit, pull.py take_at_arrival). If the router made its id, the
Assign goes out while its submit is on the way to Redis, and the client is
answered once the submit is durable. A client's id may be taken in Redis, so
that request's Assign is held until the submit's reply says it was stored.
Otherwise (--take-at-arrival 0, or work waiting) a router-made id is poppable
from admission (its pop rides in its submit's round trip), and a client's id
is popped only once its submit is durable."""

import asyncio
import contextlib

import grpc
import pytest

from common.pb.quadriga.v1 import generation_pb2 as gpb
from router.requests.spec import RequestSpec, Sampling
from tests.router.test_redis_faults import SUBMIT, assert_clean
from tests.router.test_redis_faults import direct, proxy  # noqa: F401  (the fixtures)
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens


async def quiet(app, rep) -> None:
    """Until the router is quiet: nothing held, every write durable, the replica's
    credit granted and its first pop back (which found the queue empty)."""
    credit = app.scheduler.credit_of(rep.knobs.replica_id)
    await wait_until(lambda: not app.table.requests and app.writer.pending == 0
                     and credit.wants_work(0))
    await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def lone_router_with_one_replica(url, model):
    """A router alone on its Redis, with replica r0, quiet."""
    async with running_router(make_config(url, model)) as app:
        await wait_until(lambda: app.lease.alone)
        reps = Replicas(app.address, app.limits.vocab_size)
        rep = await reps.add("r0")
        await quiet(app, rep)
        yield app, rep
        await reps.close()


@contextlib.asynccontextmanager
async def quiet_router_holding_submits(proxy, model):
    """A lone router with replica r0, quiet, and a client; Redis then holds every
    submit until proxy.release() (deadlines long enough to wait for it)."""
    cfg = make_config(proxy.url, model, redis_timeout=5.0, submit_timeout=5.0, stall_after=5.0)
    async with running_router(cfg) as app:
        await wait_until(lambda: app.lease.alone)
        reps = Replicas(app.address, app.limits.vocab_size)
        rep = await reps.add("r0")
        await quiet(app, rep)
        async with client(app.address) as stub:
            proxy.hold(SUBMIT)
            yield app, rep, stub
        await reps.close()
        await assert_clean(app)


async def round_trips_to_assignment(app, stub, rep, request_id: str) -> int:
    """Redis round trips between sending a request and its Assign reaching the replica,
    from a quiet router (a Pull arriving inside the window would add an empty pop)."""
    await quiet(app, rep)
    before, seen = app.writer.round_trips, len(rep.rec.assignments)
    call = stub.Generate(request([5], 4, request_id=request_id))
    reader = asyncio.ensure_future(call.read())
    await wait_until(lambda: len(rep.rec.assignments) > seen)
    taken = app.writer.round_trips - before
    call.cancel()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return taken


@pytest.mark.parametrize("take_at_arrival", [1, 0])
def test_round_trips_before_the_assign(redis_url, tiny_model, arun, take_at_arrival):
    """Popped, a router-made id waits one round trip, a client's id two. Taken
    at arrival, a router-made id's Assign and its submit go out together (which
    is first back is a race on loopback; the held submit below shows the
    order), and a client's id's Assign follows its submit's reply: one."""
    async def scenario():
        # A quiet router (its own lease renewed every 5 s), and the least of five
        # tries: background writes can only add round trips.
        cfg = make_config(redis_url, tiny_model, heartbeat_interval=5.0, lease_ttl=20.0,
                          router_lease_ttl=30.0, take_at_arrival=take_at_arrival)
        async with running_router(cfg) as app:
            await wait_until(lambda: app.lease.other_routers is not None)
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0", hold_on_finish=True)
            async with client(app.address) as stub:
                made = [await round_trips_to_assignment(app, stub, rep, "") for _ in range(5)]
                given = [await round_trips_to_assignment(app, stub, rep, f"c{i}") for i in range(5)]
            assert min(made) == 1, made
            assert min(given) == (1 if take_at_arrival else 2), given
            await reps.close()

    arun(scenario())


def test_a_request_taken_at_arrival_runs_while_its_submit_is_held(proxy, direct, tiny_model,
                                                                  arun):
    """Redis holds the submit: the replica already has the Assign and answers,
    but the client hears nothing until the submit is durable; then the whole
    output, once. Redis records it as a pop would have: leased to the replica
    at its first assignment, never queued, and finished."""
    async def scenario():
        async with quiet_router_holding_submits(proxy, tiny_model) as (app, rep, stub):
            call = asyncio.ensure_future(collect(stub, request([7, 8], 6), timeout=20))
            await wait_until(lambda: len(rep.rec.assignments) == 1)
            rid = rep.rec.assignments[0].request_id
            await wait_until(lambda: app.table.get(rid) is not None and app.table.get(rid).finished)
            await asyncio.sleep(0.3)
            assert not call.done()          # finished on the replica, not yet answered
            assert direct.exists(app.store.req_key(rid)) == 0
            proxy.release()
            msgs = await call
            assert tokens_of(msgs) == expected_tokens([7, 8], 6, app.limits.vocab_size)
            assert msgs[-1].timings.replica_id == "r0"
            await app.writer.drain(5)
            rec = {k.decode(): v.decode() for k, v in direct.hgetall(app.store.req_key(rid)).items()}
            assert (rec["st"], rec["n"], rec["q"], rec["rq"]) == ("f", "1", "", "0")
            assert int(rec["ao"]) >= 1 and float(rec["pat"]) >= float(rec["sat"])
            assert direct.zcard(app.store.queue_key("pending")) == 0
            assert len(rep.rec.assignments) == 1 and not rep.rec.cancels

    arun(scenario())


@pytest.mark.parametrize("take_at_arrival,request_id", [(1, ""), (0, ""), (1, "theirs")])
def test_a_request_whose_submit_times_out_is_withdrawn(proxy, tiny_model, arun,
                                                       take_at_arrival, request_id):
    """The submit ran in Redis, but its reply comes after the client was told
    UNAVAILABLE: a router-made id taken at arrival, the replica is told to
    cancel it; popped, or a client's id held for the reply, it is never
    assigned (the pop behind the submit ran too). Nothing of it is left in
    Redis either way."""
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, redis_timeout=0.3, submit_timeout=0.8,
                          take_at_arrival=take_at_arrival)
        async with running_router(cfg) as app:
            await wait_until(lambda: app.lease.alone)
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0", hold_on_finish=True)
            await quiet(app, rep)
            held = holds_of(app)
            async with client(app.address) as stub:
                proxy.hold(SUBMIT)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request([5], 4, request_id=request_id), timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                proxy.release()
                await wait_until(lambda: not app.table.requests, timeout=10)   # abandon landed
            assert held == ([request_id] if take_at_arrival and request_id else [])
            if take_at_arrival and not request_id:
                assert len(rep.rec.assignments) == 1
                assert rep.rec.cancels == [rep.rec.assignments[0].request_id]
            else:
                assert not rep.rec.assignments and not rep.rec.cancels
            await quiet(app, rep)   # the seat came back
            await reps.close()
            await assert_clean(app)

    arun(scenario())


def test_nothing_is_taken_at_arrival_past_a_request_waiting_for_its_submit(proxy, tiny_model,
                                                                         arun):
    """A client's request waits for its submit's reply (held): a later request
    with a router-made id waits behind it, and both start in arrival order."""
    async def scenario():
        async with quiet_router_holding_submits(proxy, tiny_model) as (app, rep, stub):
            first = asyncio.ensure_future(collect(stub, request([3], 4, request_id="first")))
            await wait_until(lambda: app.table.get("first") is not None)
            second = asyncio.ensure_future(collect(stub, request([4], 4)))
            await wait_until(lambda: len(app.table.requests) == 2)
            await asyncio.sleep(0.3)
            assert not rep.rec.assignments
            proxy.release()
            outputs = await asyncio.gather(first, second)
            vocab = app.limits.vocab_size
            assert [tokens_of(m) for m in outputs] == [expected_tokens([3], 4, vocab),
                                                       expected_tokens([4], 4, vocab)]
            assert rep.rec.assignments[0].request_id == "first"

    arun(scenario())


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding"])
def test_a_push_policy_placement_is_taken_at_arrival_by_its_replica(redis_url, tiny_model, arun,
                                                                    policy):
    """Router-made ids, one at a time, two replicas with seats: each request is
    taken at arrival by the replica its policy placed it with (round_robin
    alternates; least_outstanding, with r0 busy holding one, picks r1), and
    nothing waits in a replica's queue."""
    async def scenario():
        cfg = make_config(redis_url, tiny_model, policy=policy)
        async with running_router(cfg) as app:
            await wait_until(lambda: app.lease.alone)
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            r0 = await reps.add("r0", hold_on_finish=policy == "least_outstanding")
            r1 = await reps.add("r1")
            for rep in (r0, r1):
                await wait_until(lambda: app.scheduler.credit_of(rep.knobs.replica_id).wants_work(0))
            await asyncio.sleep(0.3)   # each replica's first pop (of its own queue) is back
            async with client(app.address) as stub:
                held = None
                if policy == "least_outstanding":
                    held = asyncio.ensure_future(collect(stub, request([9] * 40, 4)))
                    await wait_until(lambda: len(r0.rec.assignments) == 1)
                for i in range(4):
                    msgs = await collect(stub, request([i + 1], 3))
                    assert tokens_of(msgs) == expected_tokens([i + 1], 3, vocab)
                if held is not None:
                    held.cancel()
                    await asyncio.gather(held, return_exceptions=True)
            arrived = app.metrics.registry.get_sample_value("quadriga_pull_picks_total",
                                                            {"reason": "arrival"})
            if policy == "round_robin":
                assert (len(r0.rec.assignments), len(r1.rec.assignments)) == (2, 2)
                assert arrived == 4
            else:
                assert (len(r0.rec.assignments), len(r1.rec.assignments)) == (1, 4)
                assert arrived == 5
            await reps.close()

    arun(scenario())


def test_the_arrivals_of_one_loop_turn_share_one_assign(redis_url, tiny_model, arun):
    """Three router-made arrivals admitted in one turn of the router's loop (as a
    burst read from one socket is) reach their replica as one Assign, as one
    pop's would; each is answered, and each is counted as taken at arrival."""
    async def scenario():
        async with lone_router_with_one_replica(redis_url, tiny_model) as (app, rep):
            vocab = app.limits.vocab_size
            specs = [RequestSpec(prompt_token_ids=(i + 1, 2), sampling=Sampling(max_tokens=3))
                     for i in range(3)]
            requests = await asyncio.gather(*(app.admission.open(s) for s in specs))
            await wait_until(lambda: all(r.finished for r in requests))
            assert [r.tokens for r in requests] == [expected_tokens([i + 1, 2], 3, vocab)
                                                    for i in range(3)]
            assert len(rep.rec.assignments) == 3 and rep.rec.assign_messages == 1
            assert app.metrics.registry.get_sample_value("quadriga_pull_picks_total",
                                                         {"reason": "arrival"}) == 3

    arun(scenario())


def seats_of(app, rep) -> int:
    return app.scheduler.credit_of(rep.knobs.replica_id).requests


def holds_of(app) -> list[str]:
    """The ids the scheduler holds at arrival from now on (so a test knows the
    held path, not the popped one, is what it saw)."""
    held, hold = [], app.scheduler.hold_at_arrival

    def recorded(session, req):
        held.append(req.id)
        hold(session, req)

    app.scheduler.hold_at_arrival = recorded
    return held


def test_a_client_id_taken_at_arrival_waits_for_its_submit(proxy, direct, tiny_model, arun):
    """Redis holds the submit of a request with a client's id: it is taken at
    arrival (its seat spent), but its replica hears nothing until the submit
    is stored; then it runs, and Redis records it as a pop would have: leased
    at its first assignment, never queued."""
    async def scenario():
        async with quiet_router_holding_submits(proxy, tiny_model) as (app, rep, stub):
            seats = seats_of(app, rep)
            call = asyncio.ensure_future(collect(stub, request([7, 8], 6, request_id="mine"), timeout=20))
            await wait_until(lambda: app.table.get("mine") is not None)
            await asyncio.sleep(0.3)
            assert not rep.rec.assignments
            assert app.table.get("mine").owner == "r0" and seats_of(app, rep) == seats - 1
            proxy.release()
            msgs = await call
            assert tokens_of(msgs) == expected_tokens([7, 8], 6, app.limits.vocab_size)
            assert msgs[-1].timings.queue_time_s >= 0.3   # it waited for its submit
            await app.writer.drain(5)
            rec = {k.decode(): v.decode() for k, v in direct.hgetall(app.store.req_key("mine")).items()}
            assert (rec["st"], rec["n"], rec["q"], rec["rq"]) == ("f", "1", "", "0")
            assert [a.request_id for a in rep.rec.assignments] == ["mine"] and not rep.rec.cancels
            assert app.metrics.registry.get_sample_value("quadriga_pull_picks_total",
                                                         {"reason": "arrival"}) == 1

    arun(scenario())


def test_a_held_arrival_cancelled_before_its_submit_lands_never_reaches_its_replica(
        proxy, tiny_model, arun):
    """Cancelled while its submit is held: no Assign and no Cancel reach the
    replica, the seat comes back, and Redis ends the record the submit made."""
    async def scenario():
        async with quiet_router_holding_submits(proxy, tiny_model) as (app, rep, stub):
            seats = seats_of(app, rep)
            call = asyncio.ensure_future(collect(stub, request([5], 4, request_id="gone"), timeout=20))
            await wait_until(lambda: app.table.get("gone") is not None)
            assert app.table.get("gone").owner == "r0" and seats_of(app, rep) == seats - 1
            reply = await stub.Cancel(gpb.CancelRequest(request_id="gone"))
            assert reply.cancelled and seats_of(app, rep) == seats
            proxy.release()
            msgs = await call
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
            await wait_until(lambda: app.table.get("gone") is None)
            assert not rep.rec.assignments and not rep.rec.cancels
            assert seats_of(app, rep) == seats

    arun(scenario())


def test_a_held_arrival_whose_id_redis_holds_starts_nothing_new(redis_url, tiny_model, arun):
    """A client's id Redis still holds (a finished request this router has
    forgotten): taken at arrival, its submit is refused, so its replica never
    hears of it and the seat comes back. The same body re-attaches to the
    stored output; another body is refused. A request after them runs."""
    async def scenario():
        async with lone_router_with_one_replica(redis_url, tiny_model) as (app, rep):
            vocab = app.limits.vocab_size
            held = holds_of(app)
            async with client(app.address) as stub:
                first = await collect(stub, request([3, 4], 5, request_id="kept"))
                assert tokens_of(first) == expected_tokens([3, 4], 5, vocab)
                await wait_until(lambda: app.table.get("kept") is None)
                await quiet(app, rep)
                seats = seats_of(app, rep)
                again = await collect(stub, request([3, 4], 5, request_id="kept"))
                assert tokens_of(again) == tokens_of(first)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request([9], 5, request_id="kept"))
                assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert [a.request_id for a in rep.rec.assignments] == ["kept"]
                assert not rep.rec.cancels and seats_of(app, rep) == seats
                after = await collect(stub, request([6], 3, request_id="after"))
                assert tokens_of(after) == expected_tokens([6], 3, vocab)
            assert held == ["kept", "kept", "kept", "after"]   # each taken at arrival
            await assert_clean(app)

    arun(scenario())
