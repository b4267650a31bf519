"""The router SIGKILLed mid-generation and restarted, with real replica engines.

Replicas keep generating while the router is away, re-register with what they
hold, and resend their output; clients that re-attach by request_id receive
every token exactly once, equal to transformers' greedy output.
"""

import asyncio
import signal

import grpc
import pytest
import redis

from client.api import aio_channel, make_request
from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc
from router.persistence import lua
from router.persistence.resp import Script
from tests.e2e.test_end_to_end import PROMPTS
from tests.support.fault_proxy import FaultProxy
from tests.support.live_stack import LiveStack

MAX_TOKENS = 300


async def follow(address, prompt, request_id):
    """Streams a request to its end, re-attaching from token 0 whenever the stream breaks."""
    for _ in range(200):
        tokens, last = [], None
        try:
            async with aio_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                req = make_request(prompt, request_id=request_id, max_tokens=MAX_TOKENS,
                                   temperature=0.0, ignore_eos=True)
                async for msg in stub.Generate(req, timeout=90):
                    assert msg.output_offset == len(tokens), "a gap or a duplicate reached the client"
                    tokens.extend(msg.token_ids)
                    last = msg
            return tokens, last
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
            await asyncio.sleep(0.2)
    raise AssertionError(f"{request_id} never finished")


@pytest.mark.parametrize("lease_ttl", ["30", "2"], ids=["replicas-keep-work", "leases-expire"])
def test_router_killed_and_restarted_loses_nothing(live_stack, hf_reference, lease_ttl):
    stack = live_stack("pull", router_args=("--lease-ttl", lease_ttl))
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
    stack.wait_registered("r0", "r1")

    async def scenario():
        tasks = [asyncio.create_task(follow(stack.address, p, f"req-{i}"))
                 for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.8)
        stack.router.proc.send_signal(signal.SIGKILL)
        stack.router.proc.wait()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.start_router)
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    for prompt, (tokens, last) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, MAX_TOKENS)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH


def test_output_a_client_saw_before_redis_had_it_survives_a_router_kill(
        tmp_path, redis_server, e2e_model, started_stacks, hf_reference):
    """Output shown before Redis holds it (--show-output on_arrival, which shows
    the most so: every delta; the default shows a request's first token and its
    finish so): with the router's step writes held, clients get tokens Redis
    does not hold.
    The router is then SIGKILLed; the replicas re-register with the restarted
    router and resend what it never acknowledged, so every client re-attaches
    to the exact output, and nothing was recomputed."""
    redis_server.flushall()
    proxy = FaultProxy(redis_server.port).start()
    # Long deadlines: the held writes neither reconnect nor count as a stall.
    stack = started_stacks(LiveStack(tmp_path, proxy.url, e2e_model, "pull", (
        "--lease-ttl", "30", "--redis-timeout", "20", "--submit-timeout", "20",
        "--stall-after", "20", "--show-output", "on_arrival")))
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
    stack.wait_registered("r0", "r1")
    prompts = PROMPTS[:4]
    seen: dict[str, int] = {}

    async def watched(prompt, request_id):
        async with aio_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            req = make_request(prompt, request_id=request_id, max_tokens=MAX_TOKENS,
                               temperature=0.0, ignore_eos=True)
            tokens: list[int] = []
            try:
                async for msg in stub.Generate(req, timeout=90):
                    assert msg.output_offset == len(tokens)
                    tokens.extend(msg.token_ids)
                    seen[request_id] = len(tokens)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                      grpc.StatusCode.UNKNOWN), exc
        return tokens

    async def wait_for(predicate, timeout=60.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, seen
            await asyncio.sleep(0.02)

    async def scenario():
        ids = [f"held-{i}" for i in range(len(prompts))]
        watchers = [asyncio.create_task(watched(p, rid)) for p, rid in zip(prompts, ids)]
        await wait_for(lambda: len(seen) == len(ids) and min(seen.values()) >= 3)
        proxy.hold(Script(lua.STEP).sha.encode())
        await wait_for(proxy.held.is_set)
        at_hold = dict(seen)
        await wait_for(lambda: all(seen[r] >= at_hold[r] + 5 for r in ids))
        direct = redis.Redis(port=redis_server.port)
        recorded = {r: direct.strlen(f"quadriga:out:{r}") // 4 for r in ids}
        direct.close()
        assert all(seen[r] > recorded[r] for r in ids), (seen, recorded)
        stack.router.proc.send_signal(signal.SIGKILL)
        stack.router.proc.wait()
        partial = await asyncio.gather(*watchers)
        assert all(len(t) < MAX_TOKENS for t in partial)
        proxy.release()
        await asyncio.to_thread(stack.start_router)
        return await asyncio.gather(*(follow(stack.address, p, rid) for p, rid in zip(prompts, ids)))

    try:
        results = asyncio.run(scenario())
    finally:
        proxy.release()
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == hf_reference(prompt, MAX_TOKENS)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.timings.requeues == 0   # resent by its replica, not recomputed
    assert stack.replica_failures() == []
    stack.stop()   # before the proxy goes: the router's stop writes through it
    proxy.stop()
