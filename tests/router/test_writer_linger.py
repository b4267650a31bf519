"""A batch of middle output only may wait (linger) for more writes to join it,
from its oldest write on; any other write, or enough deltas, sends it at once.
Lingering changes when writes go, never their order. Real Redis."""

import asyncio
import contextlib
import time

import pytest

from router.persistence.store import Store
from router.persistence.writer import RedisWriter, Write

LINGER = 1.0   # long, so a loaded machine cannot make a wait look like a flush


@contextlib.asynccontextmanager
async def running_writer(redis_url, linger=LINGER, linger_items=64):
    """A started writer on a real Redis, connected; stopped on the way out."""
    store = Store(redis_url, "linger:", 60, timeout=2.0)
    writer = RedisWriter(store.lean, max_pending_submits=1000, stall_after=5.0,
                         linger=linger, linger_items=linger_items)
    writer.start()
    try:
        await writer.call(Write(None, items=("PING",)))   # connected
        yield writer
    finally:
        await writer.stop()
        await store.close()


def incr(done: list, name: str, lingers: bool = True) -> Write:
    write = Write(None, items=("RPUSH", "linger:order", name), lingers=lingers)
    write.on_done = lambda _reply: done.append(name)
    return write


def test_middle_output_waits_for_the_linger_then_goes_in_one_round_trip(redis_url, arun):
    async def scenario():
        async with running_writer(redis_url) as writer:
            done, trips = [], writer.round_trips
            started_at = time.monotonic()
            futures = [writer.call(incr(done, "a"))]
            await asyncio.sleep(0.2)
            futures += [writer.call(incr(done, n)) for n in ("b", "c")]
            await asyncio.sleep(0.2)
            assert done == [] and writer.round_trips == trips
            await asyncio.gather(*futures)
            assert time.monotonic() - started_at >= LINGER * 0.95   # from the oldest write
            assert done == ["a", "b", "c"] and writer.round_trips == trips + 1
            stored = await writer.call(Write(None, items=("LRANGE", "linger:order", "0", "-1")))
            assert stored == [b"a", b"b", b"c"]

    arun(scenario())


def test_a_write_that_may_not_wait_sends_the_batch_at_once_in_order(redis_url, arun):
    async def scenario():
        async with running_writer(redis_url) as writer:
            done = []
            first = writer.call(incr(done, "a"))
            await asyncio.sleep(0.1)
            assert done == []
            posted = time.monotonic()
            urgent = writer.call(incr(done, "submit", lingers=False))
            later = writer.call(incr(done, "b"))
            await asyncio.gather(first, urgent, later)
            assert time.monotonic() - posted < LINGER / 2
            assert done == ["a", "submit", "b"]

    arun(scenario())


@pytest.mark.parametrize("linger, linger_items, names", [(LINGER, 3, ("a", "b", "c")), (0.0, 64, ("a",))],
                         ids=["enough deltas go at once", "without a linger nothing waits"])
def test_writes_that_need_not_wait_go_at_once(redis_url, arun, linger, linger_items, names):
    async def scenario():
        async with running_writer(redis_url, linger=linger, linger_items=linger_items) as writer:
            done = []
            posted = time.monotonic()
            await asyncio.gather(*[writer.call(incr(done, n)) for n in names])
            assert time.monotonic() - posted < LINGER / 2
            assert done == list(names)

    arun(scenario())
