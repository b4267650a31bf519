"""A request whose id the router made is poppable from admission: its pop
rides in its submit's round trip. A client's id may be taken in Redis, so
that request is popped only once its submit is durable (table.py, admit)."""

import asyncio

import grpc
import pytest

from tests.router.test_redis_faults import SUBMIT, assert_clean
from tests.router.test_redis_faults import proxy  # noqa: F401  (the fixture)
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, make_config, request,
                                          running_router)


async def round_trips_to_assignment(app, stub, rep, request_id: str) -> int:
    """Redis round trips between sending a request and its Assign reaching the replica,
    from a quiet router: the last request's cancel durable, the replica's credit
    granted (a Pull arriving inside the window would add an empty pop)."""
    credit = app.scheduler.credit_of(rep.knobs.replica_id)
    await wait_until(lambda: not app.table.requests and app.writer.pending == 0
                     and credit.wants_work(0))
    await asyncio.sleep(0.2)
    before, seen = app.writer.round_trips, len(rep.rec.assignments)
    call = stub.Generate(request([5], 4, request_id=request_id))
    reader = asyncio.ensure_future(call.read())
    await wait_until(lambda: len(rep.rec.assignments) > seen)
    taken = app.writer.round_trips - before
    call.cancel()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return taken


def test_a_router_made_id_is_assigned_in_one_round_trip_a_client_id_in_two(redis_url, tiny_model,
                                                                          arun):
    async def scenario():
        # A quiet router (its own lease renewed every 5 s), and the least of five
        # tries: background writes can only add round trips.
        cfg = make_config(redis_url, tiny_model, heartbeat_interval=5.0, lease_ttl=20.0,
                          router_lease_ttl=30.0)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0", hold_on_finish=True)
            async with client(app.address) as stub:
                made = [await round_trips_to_assignment(app, stub, rep, "") for _ in range(5)]
                given = [await round_trips_to_assignment(app, stub, rep, f"c{i}") for i in range(5)]
            assert min(made) == 1, made
            assert min(given) == 2, given
            await reps.close()

    arun(scenario())


def test_a_router_made_id_whose_submit_times_out_is_withdrawn_though_its_pop_ran(proxy, tiny_model,
                                                                                arun):
    """The pop behind the submit ran in Redis, but its reply comes after the
    client was told UNAVAILABLE: the request is never assigned, and nothing of
    it is left in Redis."""
    async def scenario():
        cfg = make_config(proxy.url, tiny_model, redis_timeout=0.3, submit_timeout=0.8)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0")
            async with client(app.address) as stub:
                proxy.hold(SUBMIT)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request([5], 4), timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                proxy.release()
                await wait_until(lambda: not app.table.requests, timeout=10)   # abandon landed
            assert not rep.rec.assignments
            await reps.close()
            await assert_clean(app)

    arun(scenario())
