"""Runs a router in the test's event loop, and small client helpers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import generation_pb2_grpc
from common.redis_server import free_port  # noqa: F401  (tests import it from here)
from router.config import RouterConfig
from router.server import RouterApp
from tests.support.scripted_replica import Knobs, ScriptedReplica


def make_config(redis_url: str, model, **overrides) -> RouterConfig:
    values = dict(model=str(model), port=0, host="127.0.0.1", redis_url=redis_url,
                  redis_prefix=f"t{uuid.uuid4().hex[:8]}:", lease_ttl=3.0,
                  heartbeat_interval=0.5, no_replica_timeout=5.0, log_level="INFO")
    values.update(overrides)
    return RouterConfig(**values)


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig):
    app = RouterApp(config)
    await app.start()
    app.address = f"127.0.0.1:{app.port}"
    try:
        yield app
    finally:
        await app.stop(grace=0.2)


class Replicas:
    """Scripted replicas as tasks of the current loop."""

    def __init__(self, address: str, vocab: int):
        self.address = address
        self.vocab = vocab
        self.items: dict[str, tuple[ScriptedReplica, asyncio.Task]] = {}

    async def add(self, replica_id: str, wait: bool = True, **knobs) -> ScriptedReplica:
        replica = ScriptedReplica(self.address, Knobs(replica_id=replica_id, vocab=self.vocab, **knobs))
        task = asyncio.create_task(replica.run())
        self.items[replica_id] = (replica, task)
        if wait:
            await asyncio.wait_for(replica.connected.wait(), 10)
        return replica

    async def kill(self, replica_id: str) -> None:
        replica, task = self.items.pop(replica_id)
        replica.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        for rid in list(self.items):
            await self.kill(rid)

    def __getitem__(self, replica_id: str) -> ScriptedReplica:
        return self.items[replica_id][0]


def request(prompt_ids, max_tokens: int, **kw) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(prompt_token_ids=prompt_ids,
                               sampling=gpb.SamplingParams(max_tokens=max_tokens), **kw)


async def collect(stub, req: gpb.GenerateRequest, timeout: float = 30) -> list[gpb.GenerateResponse]:
    out = []
    async for msg in stub.Generate(req, timeout=timeout):
        out.append(msg)
    return out


def tokens_of(messages) -> list[int]:
    """Concatenates token ids, checking offsets continue with no gap and no duplicate."""
    toks: list[int] = []
    for m in messages:
        assert m.output_offset == len(toks), (m.output_offset, len(toks))
        toks.extend(m.token_ids)
    return toks


@contextlib.asynccontextmanager
async def client(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)
