"""The writer keeps up to two batches in flight on its one connection: a write
queued while a batch awaits its replies goes out at once, and a fault in the
window sends every batch from the failed one on again, in order, once each in
effect. Real Redis, with a TCP proxy to hold or break the connection."""

import asyncio

from router.persistence.store import Store
from router.persistence.writer import RedisWriter
from tests.router.test_lua import pop, submit
from tests.router.test_scheduling import wait_until
from tests.router.test_redis_faults import proxy  # noqa: F401  (the fixture)


async def started(proxy, window=2):
    store = Store(proxy.url, "win:", 60, timeout=2.0)
    writer = RedisWriter(store.lean, max_pending_submits=1000, stall_after=5.0,
                         max_in_flight=window)
    writer.start()
    await writer.call(submit(store, "warm", token="w"))   # connected, scripts loaded
    return store, writer


def post_in_order(writer, store, done, ids):
    futures = []
    for rid in ids:
        write = submit(store, rid, token=f"t-{rid}")
        write.on_done = lambda _reply, rid=rid: done.append(rid)
        futures.append(writer.call(write))
        yield futures[-1]


def test_a_write_queued_behind_an_unanswered_batch_is_sent_at_once(proxy, arun):
    async def scenario():
        store, writer = await started(proxy)
        try:
            done = []
            proxy.hold()                        # Redis sees nothing until released
            futures = post_in_order(writer, store, done, ["a", "b", "c"])
            first = next(futures)
            await wait_until(lambda: writer.in_flight == 1)
            second = next(futures)
            await wait_until(lambda: writer.in_flight == 2)   # sent before the first's reply
            third = next(futures)                             # the window is full: it waits
            await asyncio.sleep(0.05)
            assert writer.in_flight == 2 and not first.done()
            proxy.release()
            await asyncio.gather(first, second, third)
            assert done == ["a", "b", "c"]
            assert await pop(writer, store, 10, None, "p") == ["warm", "a", "b", "c"]
        finally:
            await writer.stop()
            await store.close()

    arun(scenario())


def test_a_broken_window_is_sent_again_in_order_once_each(proxy, arun):
    async def scenario():
        store, writer = await started(proxy)
        try:
            done = []
            proxy.hold()
            futures = []
            for n, fut in enumerate(post_in_order(writer, store, done, ["a", "b"]), 1):
                futures.append(fut)
                await wait_until(lambda: writer.in_flight == n)   # one batch each
            proxy.reset()                        # both batches' connection breaks
            proxy.release()
            await asyncio.gather(*futures)
            assert done == ["a", "b"]
            assert await pop(writer, store, 10, None, "p") == ["warm", "a", "b"]
        finally:
            await writer.stop()
            await store.close()

    arun(scenario())


def test_a_reply_lost_with_a_later_batch_in_flight_runs_each_write_once(proxy, arun):
    """Redis ran both batches, the replies are lost: both go again, in order, and
    the idempotent submits store each request once, in arrival order."""

    async def scenario():
        store, writer = await started(proxy, window=2)
        try:
            done = []
            proxy.hold()
            proxy.drop_reply_after(b"t-a")
            futures = []
            for n, fut in enumerate(post_in_order(writer, store, done, ["a", "b"]), 1):
                futures.append(fut)
                await wait_until(lambda: writer.in_flight == n)   # one batch each
            proxy.release()
            await asyncio.gather(*futures)
            assert proxy.dropped >= 1
            assert done == ["a", "b"]
            assert await pop(writer, store, 10, None, "p") == ["warm", "a", "b"]
            assert await store.redis.zcard(f"{store.prefix}q:pending") == 0
        finally:
            await writer.stop()
            await store.close()

    arun(scenario())
