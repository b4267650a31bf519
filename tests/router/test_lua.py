"""The Redis scripts against a real Redis: atomic pops, and every script
idempotent, since the writer sends a whole batch again when a reply is lost."""

import asyncio
import contextlib

from router.persistence.store import Store, pack_tokens
from router.persistence.writer import RedisWriter


@contextlib.asynccontextmanager
async def store_and_writer(redis_url, prefix):
    store = Store(redis_url, prefix, 60, timeout=2.0)
    writer = RedisWriter(store.lean, max_pending_submits=1000, stall_after=1.0)
    writer.start()
    try:
        yield store, writer
    finally:
        await writer.stop()
        await store.close()


def submit(store, rid, prompt_len=1, token="t", arrival=1000.0, priority=0, queue="pending"):
    return store.submit(rid, token, "d", "{}", [1] * prompt_len, 4, priority, arrival, 1, queue)


async def pop(writer, store, n, tokens, token, queue="pending", replica="rep"):
    reply = await writer.call(store.pop(queue, replica, n, tokens, 2e9, 1.0, token))
    return [p.id for p in store.popped(reply)]


def test_pop_takes_while_token_credit_is_left(redis_url, arun):
    """No credit takes nothing (0 is not "no limit"); the last one taken may overrun."""

    async def scenario():
        async with store_and_writer(redis_url, "credit:") as (store, writer):
            for i, prompt_len in enumerate([4, 6, 1]):
                await writer.call(submit(store, f"c{i}", prompt_len, arrival=1000.0 + i))
            assert await pop(writer, store, 3, 0, "a") == []
            assert await pop(writer, store, 3, 5, "b") == ["c0", "c1"]  # 5 - 4 > 0, then 6 overruns
            assert await pop(writer, store, 3, None, "c") == ["c2"]

    arun(scenario())


def test_pop_is_atomic_under_contention(redis_url, arun):
    """Many connections popping one queue at once: every request exactly once."""

    async def scenario():
        async with contextlib.AsyncExitStack() as stack:
            pairs = [await stack.enter_async_context(store_and_writer(redis_url, "atomic:"))
                     for _ in range(8)]
            store0, writer0 = pairs[0]
            for i in range(300):
                writer0.post(submit(store0, f"x{i}", arrival=1000.0 + i))
            await writer0.drain(10)

            async def popper(k):
                store, writer = pairs[k]
                got, n = [], 0
                while True:
                    n += 1
                    ids = await pop(writer, store, 3, None, f"{k}:{n}", replica=f"rep{k}")
                    if not ids:
                        return got
                    got += ids

            results = await asyncio.gather(*(popper(k) for k in range(8)))
            flat = [i for r in results for i in r]
            assert sorted(flat) == sorted(f"x{i}" for i in range(300))
            assert len(flat) == len(set(flat))
            r = store0.redis
            assert await r.zcard("atomic:inflight") == 300
            owners = {(await r.hget(f"atomic:req:{i}", "o")).decode() for i in results[0]}
            assert owners <= {"rep0"}

    arun(scenario())


def test_every_script_run_twice_is_run_once(redis_url, arun):
    """What a retried flush does: each write again, after later writes ran too."""

    async def scenario():
        async with store_and_writer(redis_url, "idem:") as (store, writer):
            r = store.redis
            for _ in range(2):  # a submit whose reply was lost, sent again
                created, member, _ = await writer.call(submit(store, "a", 3, token="tok-a"))
                assert int(created) == 1
            assert await r.zcard("idem:q:pending") == 1
            created, digest, state = await writer.call(submit(store, "a", 3, token="other"))
            assert (int(created), digest, state) == (0, b"d", b"q")  # another submit of that id

            assert await pop(writer, store, 5, None, "p1") == ["a"]
            assert await pop(writer, store, 5, None, "p1") == ["a"]  # a retried pop: what it took
            assert await r.hget("idem:req:a", "n") == b"1"

            step = [("a", 0, pack_tokens([7, 8]), 0, b"xy", "1.0", "", 0, "", "", "", "", "", 0, b"",
                     "", 1)]
            for _ in range(2):
                assert await writer.call(store.step([v for item in step for v in item])) == [1]
            assert await r.get("idem:out:a") == pack_tokens([7, 8])
            assert await r.get("idem:txt:a") == b"xy"

            # Requeued, then popped again by the same replica: the first requeue sent
            # again must not take it back from that second assignment.
            requeue = [ "a", "pending", "rep", 1, 1]
            await writer.call(store.requeue(requeue))
            assert await pop(writer, store, 5, None, "p2") == ["a"]
            await writer.call(store.requeue(requeue))
            assert (await r.hget("idem:req:a", "st"), await r.hget("idem:req:a", "n")) == (b"r", b"2")
            assert await r.zcard("idem:q:pending") == 0

            await writer.call(submit(store, "b", token="tok-b"))
            for _ in range(2):
                await writer.call(store.move(["b", "pending", "r:x"]))
            assert (await r.zcard("idem:q:pending"), await r.zcard("idem:q:r:x")) == (0, 1)

            for _ in range(2):
                await writer.call(store.finish("a", {"fr": 3}))
            assert await r.hget("idem:req:a", "st") == b"f"
            assert not await r.sismember("idem:live", "a")
            assert await r.ttl("idem:req:a") > 0 and await r.ttl("idem:out:a") > 0

            await writer.call(store.abandon("b", "not-its-token"))
            assert await r.exists("idem:req:b")
            for _ in range(2):
                await writer.call(store.abandon("b", "tok-b"))
            assert not await r.exists("idem:req:b") and await r.zcard("idem:q:r:x") == 0
            assert await store.live_ids() == []

    arun(scenario())


def test_cross_router_scripts_run_twice_are_run_once(redis_url, arun):
    """ATTACH, ADOPT, the in-flight sweep and a replica leaving, each sent
    again as a retried flush would, for two registered routers."""
    from router.persistence.store import record_from_flat

    async def scenario():
        async with store_and_writer(redis_url, "xr:") as (store, a), \
                store_and_writer(redis_url, "xr:") as (_, b):
            r = store.redis
            for router_id, writer in (("A", a), ("B", b)):
                writer.fence = (router_id, await store.register_router(router_id, 30))
            await a.call(submit(store, "x", 2, token="tx"))
            assert await r.hget("xr:req:x", "fe") == b"A"
            for _ in range(2):
                flat = await b.call(store.attach("x", "d"))
            assert record_from_flat("x", flat)["id"] == "x"
            assert await r.hget("xr:req:x", "fe") == b"A B"
            await b.call(store.attach("x", "another body"))
            assert await r.hget("xr:req:x", "fe") == b"A B"

            reply = await a.call(store.pop("pending", "rep", 1, None, 2e9, 1.0, "pa"))
            [popped] = store.popped(reply)
            assert (popped.id, popped.assignments, popped.record) == ("x", 1, None)  # A is a front
            for _ in range(2):
                [flat] = await b.call(store.adopt("rep", 2e9, ["x"]))
                assert record_from_flat("x", flat)["tokens"] == []
            assert await r.hget("xr:req:x", "br") == b"B"
            assert [f for _, f in await r.xrange("xr:ev:A")][-1][b"k"] == b"m"
            assert await b.call(store.adopt("other", 2e9, ["x"])) == [b""]

            # B's lease lapses: A sweeps x back to the shared queue, once.
            await r.zadd("xr:routers", {"B": 1.0})
            await r.zadd("xr:inflight", {"x": 1.0})
            assert [await a.call(store.sweep_inflight(0)) for _ in range(2)] == [1, 0]
            assert (await r.hget("xr:req:x", "st"), await r.hget("xr:req:x", "rq")) == (b"q", b"1")
            assert await r.zcard("xr:q:pending") == 1

            await a.call(store.move(["x", "pending", "r:rep"]))
            for _ in range(2):
                await a.call(store.replica_left("rep"))
            assert (await r.zcard("xr:q:r:rep"), await r.zcard("xr:q:pending")) == (0, 1)
            assert await r.hget("xr:req:x", "q") == b"pending"

    arun(scenario())
