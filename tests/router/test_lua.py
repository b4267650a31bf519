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
                assert await writer.call(store.step(step)) == [1]
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


@contextlib.asynccontextmanager
async def routers_a_and_b(redis_url, prefix):
    """A store and the writers of two registered routers, A and B (fenced as theirs)."""
    async with store_and_writer(redis_url, prefix) as (store, a), \
            store_and_writer(redis_url, prefix) as (_, b):
        for router_id, writer in (("A", a), ("B", b)):
            writer.fence = (router_id, await store.register_router(router_id, 30))
        yield store, a, b


def test_restore_refuses_a_record_abandon_removed_and_names_only_a_front(redis_url, arun):
    """Router A's ABANDON of a request running on router B's replica leaves a
    tombstone with its submit token: B's RESTORE of that submit is refused (2:
    removed on purpose, not lost), while a later submit of the same id (another
    token) whose record Redis lost is stored again. B, not a front, is not
    named one; as a front it is."""

    async def scenario():
        async with routers_a_and_b(redis_url, "tomb:") as (store, a, b):
            r = store.redis

            def restore(token: str, front: bool):
                return store.restore("x", token, "d", "{}", [1, 1], 4, 0, 1000.5, 1, "rep", 1, 0,
                                     2e9, front=front)

            await a.call(submit(store, "x", 2, token="t1", arrival=1000.5))
            assert await pop(b, store, 5, None, "p1") == ["x"]
            await a.call(store.abandon("x", "t1"))
            assert not await r.exists("tomb:req:x") and await r.ttl("tomb:ab:x") > 0
            assert await b.call(restore("t1", front=False)) == [2]
            assert not await r.exists("tomb:req:x")

            await a.call(submit(store, "x", 2, token="t2", arrival=1000.5))
            assert await pop(b, store, 5, None, "p2") == ["x"]
            await r.delete("tomb:req:x")
            assert await b.call(restore("t2", front=False)) == [1]
            assert await r.hmget("tomb:req:x", "st", "tok", "fe", "br") == [b"r", b"t2", b"", b"B"]
            await r.delete("tomb:req:x")
            assert await b.call(restore("t2", front=True)) == [1]
            assert await r.hmget("tomb:req:x", "fe", "br") == [b"B", b"B"]

    arun(scenario())


def test_a_router_whose_lease_lapsed_or_epoch_moved_on_is_fenced(redis_url, arun):
    """FENCE: a router writes only while its lease is live and its epoch is the
    one registered last for its id; its fence key never outlives the lease the
    other routers see (P routers), so none counts it dead while it still writes."""
    from router.persistence.writer import PermanentWriteError

    async def scenario():
        async with store_and_writer(redis_url, "fen:") as (store, old), \
                store_and_writer(redis_url, "fen:") as (_, new), \
                store_and_writer(redis_url, "fen:") as (_, short):
            r = store.redis
            old.fence = ("A", await store.register_router("A", 30))
            await old.call(submit(store, "a", token="ta"))
            await old.call(store.renew_router(30, 0))
            fence_ms = await r.execute_command("PEXPIRETIME", "fen:fence:A")
            assert 0 < fence_ms <= 1000 * await r.zscore("fen:routers", "A")

            new.fence = ("A", await store.register_router("A", 30))   # A started over
            try:
                await old.call(submit(store, "b", token="tb"))
                raise AssertionError("a write under a stale epoch ran")
            except PermanentWriteError as exc:
                assert "FENCED" in str(exc)
            assert old.fenced and not await r.exists("fen:req:b")
            await new.call(submit(store, "b", token="tb"))

            short.fence = ("C", await store.register_router("C", 0.2))
            await short.call(submit(store, "c", token="tc"))
            await asyncio.sleep(0.3)
            try:
                await short.call(submit(store, "d", token="td"))
                raise AssertionError("a write after the lease lapsed ran")
            except PermanentWriteError:
                pass
            assert not await r.exists("fen:req:d")

    arun(scenario())


def test_cross_router_scripts_run_twice_are_run_once(redis_url, arun):
    """ATTACH, ADOPT, the in-flight sweep and a replica leaving, each sent
    again as a retried flush would, for two registered routers."""
    from router.persistence.store import record_from_flat

    async def scenario():
        async with routers_a_and_b(redis_url, "xr:") as (store, a, b):
            r = store.redis
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


def test_a_named_pop_by_a_router_that_is_not_a_front_adopts_what_it_takes(redis_url, arun):
    """POP_IDS follows POP's rules across routers: the caller becomes the back
    router, gets the whole record of what it does not front (by name, or from
    the head when an older request it cannot see leads the queue), the fronts
    hear of it ('a'), and a retried call returns the same requests."""

    async def scenario():
        async with routers_a_and_b(redis_url, "xn:") as (store, a, b):
            r = store.redis
            await a.call(submit(store, "theirs", 3, token="t0", arrival=1000.0))
            await b.call(submit(store, "mine", 2, token="t1", arrival=1001.0))
            await b.call(submit(store, "named", 2, token="t2", arrival=1002.0))
            for _ in range(2):
                reply = await b.call(store.pop_ids("pending", "rep", 1, None, 2e9, 1.0, "nb",
                                                   ["mine", "named"], ["named"]))
                [head] = store.popped(reply)
                assert (head.id, head.assignments) == ("theirs", 1)   # A's, older: from the head
                assert head.record["id"] == "theirs" and head.record["p"]
            assert (await r.hget("xn:req:theirs", "br"), await r.hget("xn:req:theirs", "n")) == (b"B", b"1")
            assert [f[b"k"] for _, f in await r.xrange("xn:ev:A")][-1] == b"a"

            # By name: A names B's request, behind one A says it holds.
            for _ in range(2):
                reply = await a.call(store.pop_ids("pending", "rep2", 5, None, 2e9, 1.0, "na",
                                                   ["mine", "named"], ["named"]))
                [p] = store.popped(reply)
                assert (p.id, p.record["id"], p.record["fe"]) == ("named", "named", b"B")
            assert await r.hget("xn:req:named", "br") == b"A"
            assert [f[b"k"] for _, f in await r.xrange("xn:ev:B")][-1] == b"a"
            # Its own front's named pop carries no record.
            reply = await b.call(store.pop_ids("pending", "rep", 5, None, 2e9, 1.0, "nm",
                                               ["mine"], ["mine"]))
            assert [(p.id, p.record) for p in store.popped(reply)] == [("mine", None)]
            assert await r.zcard("xn:q:pending") == 0

    arun(scenario())


async def pop_ids(writer, store, ids, token, held, queue="pending", replica="rep", n=10,
                  tokens=None):
    """A named pop by a router whose oldest requests in `queue` are `held`."""
    reply = await writer.call(store.pop_ids(queue, replica, n, tokens, 2e9, 1.0, token, held, ids))
    return [p.id for p in store.popped(reply)]


def test_named_pop_takes_only_what_is_still_queued_there_and_once(redis_url, arun):
    """Pull affinity's pop: the chosen ids, in the order given, if still queued in
    that queue; a retried call (same token) returns what it took, nothing more."""

    async def scenario():
        async with store_and_writer(redis_url, "named:") as (store, writer):
            r = store.redis
            for i in range(4):
                await writer.call(submit(store, f"n{i}", arrival=1000.0 + i))
            await writer.call(submit(store, "elsewhere", queue="r:x"))
            assert await pop(writer, store, 1, None, "head") == ["n0"]
            held = ["n1", "n2", "n3"]
            taken = await pop_ids(writer, store, ["n2", "n0", "elsewhere", "nobody", "n1"], "t1", held)
            assert taken == ["n2", "n1"]   # n0 was taken already; the others are not queued here
            assert await pop_ids(writer, store, ["n2", "n1", "n3"], "t1", held) == ["n2", "n1"]
            assert await r.hget("named:req:n2", "n") == b"1"
            assert (await r.hget("named:req:n1", "st"), await r.hget("named:req:n1", "o")) == (b"r", b"rep")
            assert await r.zrange("named:q:pending", 0, -1) == [b"%016d%012d:n3" % (1003000000, 4)]
            assert await r.zcard("named:inflight") == 3
            assert await r.zcard("named:q:r:x") == 1 and await r.hget("named:req:elsewhere", "st") == b"q"
            # Requeued to the front, it can be named again (a fresh token).
            await writer.call(store.requeue(["n2", "pending", "rep", 1, 1]))
            assert await pop_ids(writer, store, ["n3", "n2"], "t2", ["n2", "n3"]) == ["n3", "n2"]
            # Nothing named, the first request one the caller holds: nothing is taken.
            await writer.call(submit(store, "n4", arrival=1004.0))
            assert await pop_ids(writer, store, [], "t3", ["n4"]) == []

    arun(scenario())


def test_named_pop_takes_from_the_head_once_another_request_leads(redis_url, arun):
    """The caller chose among what it holds; a request it does not hold (another
    router's) leads the queue, at once or once a pick is taken: the seats and
    credit left are taken from the head, as POP would take them."""

    async def scenario():
        async with store_and_writer(redis_url, "nhead:") as (store, writer):
            for i, prompt_len in enumerate([4, 6, 1, 1, 2, 3, 3]):
                await writer.call(submit(store, f"h{i}", prompt_len, arrival=1000.0 + i))
            # h0 leads and is not held: from the head, within 3 seats and 5 tokens.
            assert await pop_ids(writer, store, ["h3"], "t1", ["h1", "h3"], n=3, tokens=5) == ["h0", "h1"]
            assert await pop_ids(writer, store, ["h3"], "t1", ["h1", "h3"], n=3, tokens=5) == ["h0", "h1"]
            # h2 leads and is held: the pick; then h2 still leads.
            assert await pop_ids(writer, store, ["h3"], "t2", ["h2", "h3"], n=3) == ["h3"]
            # Held h2 and h5, picked in order: h2, then h4 (not held) leads: the head
            # pop takes it with the seat left, not h5 behind it.
            assert await pop_ids(writer, store, ["h2", "h5"], "t3", ["h2", "h5", "h6"], n=2) == ["h2", "h4"]
            # Credit the picks spent is gone for the head pop: h5 takes all 3 tokens,
            # so h6 (not held, leading then) is not taken.
            assert await pop_ids(writer, store, ["h5"], "t4", ["h5"], n=3, tokens=3) == ["h5"]
            assert await pop_ids(writer, store, ["h5"], "t5", ["h5"], n=3, tokens=4) == ["h6"]

    arun(scenario())


def test_step_takes_plain_and_full_deltas_and_merged_writes_get_their_own_replies(redis_url, arun):
    """Plain deltas (output only) and full ones (stamps, finish) mixed in one
    write and across writes the writer merges into one call: each write gets
    one reply a delta, a delta of another assignment is dropped, and a finish
    after plain deltas ends the request with all of its output."""

    async def scenario():
        async with store_and_writer(redis_url, "mixed:") as (store, writer):
            r = store.redis
            for rid in ("a", "b"):
                await writer.call(submit(store, rid, token=f"t{rid}"))
            assert sorted(await pop(writer, store, 5, None, "p1")) == ["a", "b"]
            first = store.step([("a", 0, pack_tokens([5]), 0, b"h", "1.0", "2.0", 0, "", "", "", "", "",
                                 0, b"", 3, 1),
                                ("b", 0, pack_tokens([6]), 0, b"x", 1)])
            second = store.step([("a", 4, pack_tokens([7]), 1, b"i", 1),
                                 ("b", 4, pack_tokens([9]), 1, b"y", 2)])   # not b's assignment
            third = store.step([("a", 8, pack_tokens([8]), 2, b"!", "", "", 1, "length", "", "rep",
                                 "3.0", "0", 0, b"", "", 1)])
            await r.config_resetstat()
            replies = await asyncio.gather(*(writer.call(w) for w in (first, second, third)))
            calls = (await r.info("commandstats"))["cmdstat_evalsha"]["calls"]
            assert calls <= 2, "at least two of the three writes share a call"
            assert replies == [[1, 1], [1, 0], [1]]
            assert await r.get("mixed:out:a") == pack_tokens([5, 7, 8])
            assert await r.get("mixed:txt:a") == b"hi!"
            assert await r.hmget("mixed:req:a", "st", "ft", "fs", "ct", "fr") == [b"f", b"1.0", b"2.0",
                                                                                  b"3", b"length"]
            assert await r.get("mixed:out:b") == pack_tokens([6])
            assert await r.hget("mixed:req:b", "st") == b"r"

    arun(scenario())


def test_a_step_of_a_request_with_no_record_says_so_and_restore_stores_it_once(redis_url, arun):
    """A delta of a request Redis has no record of is refused with its own reply
    (3, not "dropped"); RESTORE stores the request again as running on the
    caller's replica under its assignment count, only where no record is (run
    twice it changes nothing), and the whole output then written in the full
    form finishes it as any request."""

    async def scenario():
        async with store_and_writer(redis_url, "restore:") as (store, writer):
            r = store.redis
            await writer.call(submit(store, "a", 2, token="ta", arrival=1000.5))
            assert await pop(writer, store, 5, None, "p1") == ["a"]
            await r.delete("restore:req:a", "restore:out:a")
            await r.zrem("restore:inflight", "a")
            await r.srem("restore:live", "a")
            plain = [("a", 0, pack_tokens([5]), 0, b"h", 1)]
            assert await writer.call(store.step(plain)) == [3]

            restore = store.restore("a", "ta", "d", "{}", [1, 1], 4, 0, 1000.5, 1, "rep", 1, 0, 2e9,
                                    front=True)
            assert await writer.call(restore) == [1]
            assert await writer.call(store.restore("a", "ta", "d", "{}", [1, 1], 4, 0, 1000.5, 1,
                                                   "rep", 1, 0, 2e9, front=True)) == [0]
            assert await r.hmget("restore:req:a", "st", "o", "n", "tok", "pl", "q") == [
                b"r", b"rep", b"1", b"ta", b"2", b""]
            assert await r.zscore("restore:inflight", "a") == 2e9
            assert await store.live_ids() == ["a"]
            whole = [("a", 0, pack_tokens([5, 6]), 0, b"hi", "1.0", "", 1, "length", "", "rep",
                      "3.0", "0", 0, b"", "", 1)]
            assert await writer.call(store.step(whole)) == [1]
            assert await r.get("restore:out:a") == pack_tokens([5, 6])
            assert await r.hget("restore:req:a", "st") == b"f"
            assert await store.live_ids() == [] and await r.zcard("restore:inflight") == 0
            # A request that has a record is left as it is.
            assert await writer.call(store.restore("a", "ta", "d", "{}", [1, 1], 4, 0, 1000.5, 1,
                                                   "rep", 1, 0, 2e9, front=True)) == [0]
            assert await r.hget("restore:req:a", "st") == b"f"

    arun(scenario())
