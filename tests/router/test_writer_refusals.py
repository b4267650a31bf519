"""Error replies that mean "not now" (Redis out of memory, snapshots failing,
too few replicas): the write waits and goes again, as through an outage. Real Redis."""

import asyncio

from router.persistence.writer import Write
from tests.router.test_writer_linger import running_writer


def test_a_write_redis_refuses_for_memory_is_retried_until_it_fits(redis_url, arun):
    """OOM (maxmemory reached), like MISCONF (snapshots failing) or NOREPLICAS, is
    Redis saying "not now": the write waits and goes again, as it would through an
    outage, and is never failed (a failed step write left its request stuck)."""
    import redis as redis_py

    admin = redis_py.Redis.from_url(redis_url)
    before = admin.config_get("maxmemory")["maxmemory"]

    async def scenario():
        async with running_writer(redis_url, linger=0.0) as writer:
            try:
                admin.config_set("maxmemory", 1)
                done = []
                write = Write(None, items=("SET", "linger:big", "x" * 1000))
                write.on_done = done.append
                future = writer.call(write)
                await asyncio.sleep(0.5)
                assert not future.done() and writer.failing_since is not None   # refused, waiting
                admin.config_set("maxmemory", before)
                assert await asyncio.wait_for(future, 5) == b"OK" and done == [b"OK"]
            finally:
                admin.config_set("maxmemory", before)

    arun(scenario())
