"""The router SIGKILLed mid-generation and restarted, with real replica engines.

Replicas keep generating while the router is away, re-register with what they
hold, and resend their output; clients that re-attach by request_id receive
every token exactly once, equal to transformers' greedy output.
"""

import asyncio
import signal

import grpc
import pytest

from client.api import aio_channel, make_request
from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc
from tests.e2e.test_end_to_end import PROMPTS

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
