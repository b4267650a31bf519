"""Every way the router stops, and the network between it and its replicas
breaking, with real processes and real replica engines.

In each case every client that re-attaches by request_id gets the exact full
output (transformers' greedy tokens), no gap and no token twice, no replica
process exits or logs a traceback, and where the replicas keep their work
nothing is recomputed (no request was ever requeued).
"""

import asyncio
import signal
import time

import grpc
import pytest

from client.api import aio_channel, make_request
from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc
from tests.e2e.test_end_to_end import PROMPTS
from tests.support.fault_proxy import FaultProxy

MAX_TOKENS = 200


class Follower:
    """Streams one request to its end, re-attaching whenever the stream breaks,
    and records how each attempt ended."""

    def __init__(self, address: str, prompt, request_id: str):
        self.address, self.prompt, self.request_id = address, prompt, request_id
        self.progress = 0
        self.ended_with: list[str] = []

    async def run(self):
        for _ in range(300):
            tokens, last = [], None
            try:
                async with aio_channel(self.address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    req = make_request(self.prompt, request_id=self.request_id,
                                       max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                    async for msg in stub.Generate(req, timeout=120):
                        assert msg.output_offset == len(tokens), "a gap or a duplicate"
                        tokens.extend(msg.token_ids)
                        self.progress = max(self.progress, len(tokens))
                        last = msg
                return tokens, last
            except grpc.aio.AioRpcError as exc:
                self.ended_with.append(exc.code().name)
                await asyncio.sleep(0.2)
        raise AssertionError(f"{self.request_id} never finished")


def check(results, hf_reference, stack, recomputed_allowed=False):
    for prompt, (tokens, last) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, MAX_TOKENS)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        if not recomputed_allowed:
            assert last.timings.requeues == 0, "a request was recomputed"
    assert stack.replica_failures() == []


async def streaming(stack, followers, running: int):
    """Until `running` requests stream (3+ tokens each) and none has finished."""
    deadline = time.monotonic() + 90
    while sum(f.progress >= 3 for f in followers) < running:
        assert time.monotonic() < deadline, "the requests never got going"
        await asyncio.sleep(0.05)
    assert max(f.progress for f in followers) < MAX_TOKENS


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_router_stopped_mid_stream_and_restarted_loses_and_recomputes_nothing(
        live_stack, hf_reference, sig):
    """Two seats per replica: when the router stops four requests stream and
    four wait in the queue. A SIGTERM cancels none of them: streams end
    UNAVAILABLE, never CANCELLED."""
    stack = live_stack("pull", router_args=("--lease-ttl", "20"))
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "2", wait=False)
    stack.wait_registered("r0", "r1")

    async def scenario():
        followers = [Follower(stack.address, p, f"{sig.name}-{i}") for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(f.run()) for f in followers]
        await streaming(stack, followers, running=4)
        stack.router.proc.send_signal(sig)
        code = await asyncio.to_thread(stack.router.proc.wait, 30)
        if sig == signal.SIGTERM:
            assert code == 0, stack.router.tail()
        await asyncio.sleep(0.5)
        await asyncio.to_thread(stack.start_router)
        results = await asyncio.gather(*tasks)
        for f in followers:
            assert "CANCELLED" not in f.ended_with, (f.request_id, f.ended_with)
        assert sum(bool(f.ended_with) for f in followers) >= 4, "the running streams must have broken"
        return results

    check(asyncio.run(scenario()), hf_reference, stack)


def test_network_blip_between_replicas_and_router_recomputes_nothing(live_stack, hf_reference):
    """Every replica connection is reset twice while all processes live: each
    replica re-registers holding its work and continues it."""
    stack = live_stack("pull", router_args=("--lease-ttl", "10"))
    proxy = FaultProxy(stack.port).start()
    try:
        for rid in ("r0", "r1"):
            stack.start_replica(rid, "--max-num-seqs", "4", router=proxy.address, wait=False)
        stack.wait_registered("r0", "r1")

        async def scenario():
            followers = [Follower(stack.address, p, f"blip-{i}") for i, p in enumerate(PROMPTS)]
            tasks = [asyncio.create_task(f.run()) for f in followers]
            await streaming(stack, followers, running=8)
            for _ in range(2):
                proxy.reset()
                await asyncio.sleep(1.0)
            return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
    finally:
        proxy.stop()
    check(results, hf_reference, stack)
    log = stack.router.log_path.read_text()
    assert log.count("replica r0 joined") >= 2 and log.count("replica r1 joined") >= 2
