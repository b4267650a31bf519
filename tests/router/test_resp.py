"""The router's lean Redis connection: replies per batch, in order; one deadline
timer per connection that still holds every batch to its own deadline. Real
Redis, with a TCP proxy to hold the connection (tests/support/fault_proxy.py)."""

import asyncio
import time

import pytest

from router.persistence.resp import LeanRedis, ReplyError
from tests.router.test_redis_faults import proxy  # noqa: F401  (the fixture)


def lean(port: int, timeout: float) -> LeanRedis:
    return LeanRedis({"host": "127.0.0.1", "port": port}, timeout=timeout)


def test_batches_sent_back_to_back_get_their_own_replies_in_order(redis_server, arun):
    async def scenario():
        client = lean(redis_server.port, 2.0)
        try:
            await client.execute("DEL", "resp:n")
            futures = [await client.send([("INCRBY", "resp:n", i), ("GET", "resp:n")])
                       for i in (1, 10, 100)]
            replies = [await f for f in futures]
            assert replies == [[1, b"1"], [11, b"11"], [111, b"111"]]
            # An error reply comes back in its place; the batch and the connection go on.
            out = await client.execute_many([("INCR", "resp:n"), ("LPUSH", "resp:n", "x"),
                                             ("GET", "resp:n")])
            assert out[0] == 112 and isinstance(out[1], ReplyError) and out[2] == b"112"
        finally:
            client.close()

    arun(scenario())


def test_a_held_batch_misses_its_own_deadline_though_later_batches_follow(proxy, arun):  # noqa: F811
    """The timer is lazy (one per connection, re-armed for the oldest batch): a
    batch sent just before the timer would fire must not push the older one's
    deadline back, and one sent later must not be failed early."""
    timeout = 1.0

    async def scenario():
        client = lean(proxy.port, timeout)
        try:
            await client.execute("PING")              # connected
            await asyncio.sleep(0.7 * timeout)        # the connection's timer is armed from here
            proxy.hold()
            first_sent = time.monotonic()
            first = await client.send([("PING",)])
            await asyncio.sleep(0.6 * timeout)
            second = await client.send([("PING",)])
            with pytest.raises(TimeoutError):
                await first
            assert 0.9 * timeout <= time.monotonic() - first_sent < 1.2 * timeout
            with pytest.raises((TimeoutError, ConnectionError)):  # the same connection went down
                await second
            proxy.release()
            assert await client.execute("PING") == b"PONG"   # the next call reconnects
        finally:
            client.close()

    arun(scenario())
