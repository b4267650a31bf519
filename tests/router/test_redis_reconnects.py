"""Redis answers that the same connection would give for ever, and a re-attach
while Redis stalls: the router opens a new connection for the first, and bounds
the client's wait for the second. A real Redis (two for a failover) behind a
TCP proxy (tests/support/fault_proxy.py)."""

import asyncio
import contextlib
import time

import grpc
import redis

from common.redis_server import RedisServer
from router.persistence import lua_routers
from router.persistence.resp import Script
from tests.router.test_redis_faults import proxy  # noqa: F401  (a fixture used below)
from tests.support.fault_proxy import FaultProxy
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens

ATTACH = Script(lua_routers.ATTACH).sha.encode()


@contextlib.asynccontextmanager
async def one_replica(redis_url: str, tiny_model, **config):
    """A router on that Redis with one scripted replica: (router, client stub, vocab)."""
    cfg = make_config(redis_url, tiny_model, redis_timeout=1.0, submit_timeout=2.0, **config)
    async with running_router(cfg) as app:
        reps = Replicas(app.address, app.limits.vocab_size)
        await reps.add("r0", step_delay=0.01)
        async with client(app.address) as stub:
            yield app, stub, app.limits.vocab_size
        await reps.close()


async def served_again_within(stub, seconds: float) -> list[str]:
    """Sends fresh requests until one is served; every outcome, in order."""
    outcomes, start = [], time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            await collect(stub, request([4], 5), timeout=5)
            outcomes.append("ok")
            break
        except grpc.aio.AioRpcError as exc:
            outcomes.append(f"{exc.code().name}: {exc.details()[:80]}")
            await asyncio.sleep(0.5)
    return outcomes


def test_redis_that_forgot_the_scripts_is_served_on_a_new_connection(redis_url, tiny_model, arun):
    """SCRIPT FLUSH (or a restart behind a proxy that kept the connection): every
    EVALSHA on the old connection answers NOSCRIPT; the scripts load per connection."""
    async def scenario():
        async with one_replica(redis_url, tiny_model) as (_, stub, vocab):
            assert tokens_of(await collect(stub, request([3], 5))) == expected_tokens([3], 5, vocab)
            redis.Redis.from_url(redis_url).script_flush()
            outcomes = await served_again_within(stub, 20)
            assert outcomes[-1] == "ok", outcomes

    arun(scenario(), timeout=60)


def test_the_router_follows_a_failover_to_the_new_master(tmp_path, tiny_model, arun):
    """The address now leads to the promoted replica; the old master, on the
    connection kept, answers READONLY for ever."""
    a, b = RedisServer(tmp_path / "a"), RedisServer(tmp_path / "b")
    a.start()
    b.start()
    ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port)
    rb.replicaof("127.0.0.1", a.port)
    front = FaultProxy(a.port).start()

    async def scenario():
        async with one_replica(front.url, tiny_model, router_lease_ttl=30.0) as (_, stub, vocab):
            assert tokens_of(await collect(stub, request([3], 5))) == expected_tokens([3], 5, vocab)
            while (rb.info("replication")["master_link_status"] != "up" or
                   rb.info("replication")["master_repl_offset"]
                   < ra.info("replication")["master_repl_offset"]):
                await asyncio.sleep(0.05)
            rb.replicaof("NO", "ONE")
            ra.replicaof("127.0.0.1", b.port)
            front.target = ("127.0.0.1", b.port)   # new connections reach the new master
            outcomes = await served_again_within(stub, 20)
            assert outcomes[-1] == "ok", outcomes

    try:
        arun(scenario(), timeout=90)
    finally:
        front.stop()
        a.stop()
        b.stop()


def test_a_reattach_while_redis_stalls_is_told_to_retry_within_the_bound(proxy, tiny_model, arun):  # noqa: F811
    """A finished request only Redis holds: its ATTACH waits on Redis. The client
    is told UNAVAILABLE past submit_timeout, not kept for the whole stall, and
    its retry once Redis answers replays the output exactly."""
    async def scenario():
        async with one_replica(proxy.url, tiny_model) as (app, stub, vocab):
            await collect(stub, request([3], 5, request_id="done"))
            await app.writer.drain(5)
            assert app.table.get("done") is None
            proxy.hold(ATTACH)
            start = time.monotonic()
            try:
                await collect(stub, request([3], 5, request_id="done"), timeout=20)
                raise AssertionError("answered while Redis held the ATTACH")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert "retry" in exc.details()
            assert time.monotonic() - start < 6
            proxy.release()
            deadline = time.monotonic() + 20
            while True:   # told to retry until the router sees Redis answer again
                try:
                    msgs = await collect(stub, request([3], 5, request_id="done"), timeout=20)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    await asyncio.sleep(0.5)
            assert tokens_of(msgs) == expected_tokens([3], 5, vocab)

    arun(scenario(), timeout=90)
