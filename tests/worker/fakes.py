"""A scripted engine and a worker wired to an in-memory outbox (no router)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import grpc

from common.block_hash import BlockHasher
from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as pb
from common.pb.quadriga.v1 import replica_pb2_grpc
from common.redis_server import free_port
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.kv_events import KVEventLog, PrefixCacheStats
from replica_worker.engine.outputs import EngineLoad, RequestDelta, StepResult
from replica_worker.engine.schedulers.base import AdmissionCapacity
from replica_worker.worker.client import ReplicaWorker
from replica_worker.worker.config import WorkerConfig


@dataclass
class _Seq:
    num_output_tokens: int


class _Sched:
    def __init__(self, engine: "FakeEngine") -> None:
        self.engine = engine

    def get_seq(self, rid):
        n = self.engine.reqs.get(rid)
        return None if n is None else _Seq(n)


class FakeEngine:
    """Each step emits one token (id 1) per request; a request finishes after
    `length` tokens. fail_steps: how many next steps raise step_error. fail_add: request
    ids whose add_request raises an unexpected error.

    prefix_cache: a request's first step stores its prompt's full blocks (real
    block hashes) in a cache of hashes that never fills; `evict_next_step`
    takes hashes out at the next step. max_pending_events bounds the event log
    (past it the next take is a cleared snapshot, as the real one)."""

    def __init__(self, seats: int = 4, tokens: int = 1000, length: int = 3,
                 prefix_cache: bool = False, block_size: int = 4,
                 max_pending_events: int = 1000, step_s: float = 0.0) -> None:
        self.seats, self.tokens, self.length = seats, tokens, length
        self.step_s = step_s
        self.reqs: dict[str, int] = {}
        self.step_id = 0
        self.fail_steps = 0
        self.step_error: Exception = RuntimeError("boom in step")
        self.fail_after_sampling = False
        self.fail_add: set[str] = set()
        self.hold = False  # when True, step() produces nothing (requests stay in hand)
        self.scheduler = _Sched(self)
        self.prefix_caching_enabled = prefix_cache
        self.block_hasher = BlockHasher(block_size)
        self.cache: set[int] = set()
        self.events = KVEventLog(max_pending_events, lambda: list(self.cache))
        self.evict_next_step: deque[int] = deque()
        self._to_store: dict[str, list[int]] = {}

    def add_request(self, rid, prompt, params, arrival_time=None, resume_token_ids=(), resume_text_len=None):
        if rid in self.fail_add:
            raise RuntimeError(f"boom adding {rid}")
        if rid in self.reqs:
            raise InvalidRequestError(f"request_id {rid!r} is already running on this engine")
        self.reqs[rid] = len(resume_token_ids)
        if self.prefix_caching_enabled:
            self._to_store[rid] = self.block_hasher.hashes(list(prompt))

    def abort_request(self, rid) -> bool:
        return self.reqs.pop(rid, None) is not None

    def shutdown(self) -> None:
        """No other ranks to stop."""

    def has_unfinished(self) -> bool:
        return bool(self.reqs) and not self.hold

    def step(self) -> StepResult:
        self.step_id += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail_steps:
            self.fail_steps -= 1
            if self.fail_after_sampling:  # tokens appended, never reported
                for rid in self.reqs:
                    self.reqs[rid] += 1
            raise self.step_error
        self._cache_step()
        deltas = []
        for rid, n in list(self.reqs.items()):
            d = RequestDelta(rid, [1], "x", n)
            self.reqs[rid] = n + 1
            if n + 1 >= self.length:
                d.finish_reason = "length"
                del self.reqs[rid]
            deltas.append(d)
        return StepResult(deltas=deltas, batch_size=len(deltas), num_tokens=len(deltas))

    def _cache_step(self) -> None:
        for rid in list(self._to_store):
            for h in self._to_store.pop(rid):
                self.cache.add(h)
                self.events.stored(h)
        while self.evict_next_step:
            h = self.evict_next_step.popleft()
            self.cache.discard(h)
            self.events.evicted(h)

    def take_kv_events(self):
        return self.events.take()

    def cached_block_hashes(self) -> list[int]:
        return list(self.cache)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(0, 0, len(self.cache))

    def admission_capacity(self) -> AdmissionCapacity:
        seats = self.seats - len(self.reqs)
        return AdmissionCapacity(seats, self.tokens) if seats > 0 else AdmissionCapacity(0, 0)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.reqs), 0, 10, 10)

    def request_ids(self):
        return list(self.reqs)


def assignment(rid: str, prompt=(1, 2, 3), max_tokens: int = 3, **sampling) -> pb.Assignment:
    return pb.Assignment(request_id=rid, prompt_token_ids=list(prompt),
                         sampling=gpb.SamplingParams(max_tokens=max_tokens, **sampling))


def make_worker(engine: FakeEngine, **config) -> ReplicaWorker:
    cfg = WorkerConfig(**{"router": "127.0.0.1:1", "model": "m", "replica_id": "r0", "model_name": "m",
                          **config})
    return ReplicaWorker(cfg, engine, pb.ReplicaCapacity(num_kv_blocks=16))


class Wired:
    """A worker 'connected' to an outbox the test reads, with its engine thread running.
    Every StepOutputs the test reads is acknowledged, as a router does once it
    is durable."""

    def __init__(self, worker: ReplicaWorker) -> None:
        self.worker = worker
        self.pump: asyncio.Task | None = None

    async def __aenter__(self) -> "Wired":
        w = self.worker
        w._loop = asyncio.get_running_loop()
        w._outbox = asyncio.Queue()
        w.engine_loop.start()
        self.pump = asyncio.create_task(w._pump_reports())
        return self

    async def __aexit__(self, *exc) -> None:
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)
        self.worker.engine_loop.stop()

    async def next(self, kind: str | None = None, timeout: float = 2.0) -> pb.ReplicaMessage:
        """The next message (of that kind, skipping others)."""
        async def get():
            while True:
                msg = self._acked(await self.worker._outbox.get())
                if kind is None or (msg is not None and msg.WhichOneof("kind") == kind) or (
                        msg is None and kind == "close"):
                    return msg
        return await asyncio.wait_for(get(), timeout)

    async def settle(self, delay: float = 0.2) -> list:
        await asyncio.sleep(delay)
        out = []
        while not self.worker._outbox.empty():
            out.append(self._acked(self.worker._outbox.get_nowait()))
        return out

    def _acked(self, msg):
        if msg is not None and msg.WhichOneof("kind") == "step":
            self.worker._on_router_message(pb.RouterMessage(ack=pb.Ack(step_id=msg.step.step_id)))
        return msg


async def serve_router(servicer) -> tuple[grpc.aio.Server, int]:
    """A scripted router (a ReplicaGatewayServicer) on a loopback port: (server, port)."""
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaGatewayServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port
