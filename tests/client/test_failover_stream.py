"""client.api.FailoverStream against scripted Generation servers over loopback gRPC:
a stream that breaks is taken up elsewhere, the streams of a failed router
spread over the others, and new streams pass a failed router over."""

import asyncio

import grpc
import pytest

from client.api import FailoverStream, ReplayMismatch, RouterHealth, make_request
from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc

TOKENS = 6


class ScriptedRouter(generation_pb2_grpc.GenerationServicer):
    """Streams tokens 0..TOKENS-1 of any request from token 0 (as a re-attach
    replays), one message each. break_after: aborts UNAVAILABLE after that many
    tokens. hang_after: stops sending after that many (a router about to die)."""

    def __init__(self, break_after: int | None = None, hang_after: int | None = None, shift: int = 0):
        self.break_after, self.hang_after = break_after, hang_after
        self.shift = shift   # added to every token: a router whose replay differs
        self.calls = 0
        self.hanging = 0

    async def Generate(self, request, context):
        self.calls += 1
        for i in range(TOKENS):
            if self.break_after is not None and i == self.break_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted break")
            if self.hang_after is not None and i == self.hang_after:
                self.hanging += 1
                await asyncio.Event().wait()
            last = i == TOKENS - 1
            msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[i + self.shift],
                                      output_offset=i, text=f"<{i + self.shift}>")
            if last:
                msg.finish_reason = pb.FINISH_REASON_LENGTH
            yield msg
            await asyncio.sleep(0)


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def follow(routers, rid, health, channels):
    stream = FailoverStream(routers, make_request([1, 2], request_id=rid, max_tokens=TOKENS),
                            health=health, channels=channels, retry_delay=0.01)
    tokens = []
    async for msg in stream:
        assert msg.output_offset == len(tokens), "a gap or a duplicate reached the caller"
        tokens.extend(msg.token_ids)
    return tokens, stream.broken


def test_streams_of_a_failed_router_spread_and_new_ones_pass_it_over(arun):
    async def scenario():
        routers = [ScriptedRouter(hang_after=2), ScriptedRouter(), ScriptedRouter(), ScriptedRouter()]
        servers = [await serve(r) for r in routers]
        addresses = [a for _, a in servers]
        health, channels = RouterHealth(down_for=30), {}
        try:
            # 40 streams start at the first router, which then dies mid-stream:
            # each is taken up by another.
            tasks = [asyncio.create_task(follow(addresses, f"a{i}", health, channels)) for i in range(40)]
            while routers[0].hanging < 40:
                await asyncio.sleep(0.01)
            await servers[0][0].stop(None)
            results = await asyncio.gather(*tasks)
            assert all(tokens == list(range(TOKENS)) for tokens, _ in results)
            assert all(len(broken) == 1 for _, broken in results)
            taken_up = [r.calls for r in routers[1:]]
            assert sum(taken_up) == 40
            # In list order all 40 would have landed on the second router.
            assert min(taken_up) >= 5, taken_up
            # Known to be down: new streams that list it first start at a live one
            # instead of paying a failed call there.
            results = await asyncio.gather(*(follow(addresses, f"b{i}", health, channels)
                                             for i in range(10)))
            assert all(tokens == list(range(TOKENS)) and not broken for tokens, broken in results)
        finally:
            for channel in channels.values():
                await channel.close()
            for server, _ in servers:
                await server.stop(None)

    arun(scenario())


def test_when_every_router_is_down_it_waits_and_cycles_in_order(arun):
    async def scenario():
        routers = [ScriptedRouter(break_after=1), ScriptedRouter(break_after=3)]
        servers = [await serve(r) for r in routers]
        addresses = [a for _, a in servers]
        try:
            stream = FailoverStream(addresses, make_request([1], request_id="x", max_tokens=TOKENS),
                                    retry_delay=0.01, max_attempts=4)
            got = []
            try:
                async for msg in stream:
                    got.extend(msg.token_ids)
            except RuntimeError as exc:
                assert "4 attempts broke" in str(exc)
            # Each token once, in order, across attempts at both routers.
            assert got == [0, 1, 2]
            assert (routers[0].calls, routers[1].calls) == (2, 2)
        finally:
            for server, _ in servers:
                await server.stop(None)

    arun(scenario())


@pytest.mark.parametrize("shift", [0, 100], ids=["same replay", "replay differs"])
def test_a_replay_is_checked_against_what_was_delivered(arun, shift):
    """The second router replays from token 0: an equal replay is skipped (and
    counted), one that differs is the router's fault and fails the stream."""
    async def scenario():
        first, a = await serve(ScriptedRouter(break_after=3))
        second, b = await serve(ScriptedRouter(shift=shift))
        try:
            stream = FailoverStream([a, b], make_request([1, 2], request_id="r", max_tokens=TOKENS),
                                    retry_delay=0.01)
            tokens, text = [], ""
            try:
                async for msg in stream:
                    tokens.extend(msg.token_ids)
                    text += msg.text
            except ReplayMismatch as exc:
                assert shift and "differs" in str(exc) and tokens == [0, 1, 2]
                return
            assert not shift and tokens == list(range(TOKENS)) and stream.replayed == 3
            assert text == "".join(f"<{i}>" for i in range(TOKENS))
        finally:
            await first.stop(None)
            await second.stop(None)

    arun(scenario())
