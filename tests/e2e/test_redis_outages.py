"""Redis SIGKILLed and restarted from its append-only file, and Redis stalled
(SIGSTOP for 5 s), under a live router with real replica engines.

The router is never restarted. No client waits past a bound: while Redis is
away the router serves streams from memory (the replicas keep what it has not
acknowledged). Every request finishes with transformers' exact output, a
re-attach afterwards replays it from Redis, and new work is taken again.
"""

import asyncio
import time

import grpc
import pytest

from common.redis_server import RedisServer
from tests.e2e.test_end_to_end import PROMPTS, generate
from tests.e2e.test_router_lifecycle import MAX_TOKENS, Follower, check, streaming
from tests.support.live_stack import LiveStack


@pytest.fixture
def aof_redis(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    yield server
    server.resume() if server.proc.poll() is None else None
    server.stop()


class TimedFollower(Follower):
    """Also measures the longest gap between two messages of its stream."""

    async def run(self):
        self.longest_gap, self._last = 0.0, time.monotonic()
        watcher = asyncio.create_task(self._watch())
        try:
            return await super().run()
        finally:
            watcher.cancel()

    async def _watch(self):
        seen = 0
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            if self.progress != seen:
                seen, self._last = self.progress, now
            self.longest_gap = max(self.longest_gap, now - self._last)


async def new_work_once_redis_is_back(address, timeout: float = 30):
    """New requests are turned away (UNAVAILABLE) until Redis answers again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await generate(address, PROMPTS[1], 8)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in exc.details(), exc
            assert time.monotonic() < deadline, "the router never took new work again"
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("fault", ["sigkill-aof-restart", "sigstop-5s"])
def test_redis_outage_mid_stream_loses_nothing(tmp_path, aof_redis, e2e_model, hf_reference, fault):
    stack = LiveStack(tmp_path, aof_redis.url, e2e_model, "pull",
                      ("--lease-ttl", "20", "--redis-timeout", "1", "--submit-timeout", "2"))
    try:
        stack.start_router()
        for rid in ("r0", "r1"):
            stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
        stack.wait_registered("r0", "r1")

        async def scenario():
            followers = [TimedFollower(stack.address, p, f"{fault}-{i}") for i, p in enumerate(PROMPTS)]
            tasks = [asyncio.create_task(f.run()) for f in followers]
            await streaming(stack, followers, running=8)
            if fault == "sigstop-5s":
                aof_redis.pause()
                await asyncio.sleep(5)
                aof_redis.resume()
            else:
                aof_redis.kill()
                await asyncio.sleep(1)
                aof_redis.start()
            results = await asyncio.gather(*tasks)
            fresh = await new_work_once_redis_is_back(stack.address)
            again = await generate(stack.address, PROMPTS[0], MAX_TOKENS, request_id=f"{fault}-0")
            return followers, results, again, fresh

        followers, results, again, fresh = asyncio.run(scenario())
        check(results, hf_reference, stack)
        assert again[0] == hf_reference(PROMPTS[0], MAX_TOKENS)
        assert fresh[0] == hf_reference(PROMPTS[1], 8)
        assert stack.router.alive()
        # Streams went on from memory: far less than the outage itself.
        assert max(f.longest_gap for f in followers) < 4.0, [f.longest_gap for f in followers]
    finally:
        stack.stop()
