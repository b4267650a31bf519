"""A scripted replica: a real gRPC client of the ReplicaGateway API that emits
tokens by a fixed rule instead of running a model.

Output token i of a request = (sum(prompt_token_ids) + i) % vocab; text is
f"<{token}>". It finishes with LENGTH after max_tokens and honours
resume_token_ids by continuing the rule from len(resume_token_ids).

Deltas are coalesced to each Assignment's stream_interval by the worker's own
DeltaCoalescer (replica_worker/worker/coalescing.py), and a step whose deltas
are all held sends no StepOutputs, as the real worker does.

With prefix_cache it reports a fake prefix cache, a set of block hashes
(common/block_hash.py): the whole set at every Register, then changes as KV
events; `cached` is the set it starts with, store/evict/replace_cache change
it by hand, and cache_prompts stores each assigned prompt's full blocks at
its first step, as an engine caches what it computed.

In-process:   replica = ScriptedReplica("127.0.0.1:PORT", Knobs(replica_id="r0"))
              task = asyncio.create_task(replica.run())
Subprocess:   python -m tests.support.scripted_replica --router HOST:PORT --id r0 ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field

import grpc

from common.block_hash import SCHEME, BlockHasher
from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from common.pb.quadriga.v1 import replica_pb2_grpc
from replica_worker.worker.coalescing import DeltaCoalescer


def expected_token(prompt_ids, i: int, vocab: int) -> int:
    return (sum(prompt_ids) + i) % vocab


def expected_tokens(prompt_ids, n: int, vocab: int) -> list[int]:
    return [expected_token(prompt_ids, i, vocab) for i in range(n)]


@dataclass
class Knobs:
    replica_id: str = "r0"
    model: str = ""                   # Register.model; empty: not stated
    vocab: int = 512
    max_model_len: int = 1024
    capacity: int = 8                 # requests running at once
    pull_tokens: int = 0              # Pull.max_prompt_tokens (0: no limit)
    auto_pull: bool = True            # False: only pull() sends Pull
    step_delay: float = 0.0           # seconds per engine step
    tokens_per_step: int = 1
    fail_after_steps: int | None = None   # break the stream abruptly after N steps
    die: bool = False                 # with fail_after_steps: os._exit (subprocess mode)
    stop_heartbeats: bool = False
    garbage: str | None = None        # bad_offset | unowned | empty | register
    garbage_after_steps: int = 1
    auth_token: str = ""
    reconnect: bool = False           # re-dial with held_request_ids when the stream breaks
    hold_on_finish: bool = False      # keep requests but never finish (for cancel tests)
    prefix_cache: bool = False        # report a (fake) prefix cache
    block_size: int = 16
    hash_scheme: str = SCHEME
    cached: tuple[int, ...] = ()      # block hashes held from the start
    cache_prompts: bool = False       # store each prompt's full blocks at its first step
    step_credit: bool = True          # a step's credit rides in it when the router takes that


@dataclass
class Run:
    assignment: rpb.Assignment
    next_index: int
    max_tokens: int
    sum_prompt: int = 0


@dataclass
class Record:
    assignments: list = field(default_factory=list)   # every Assignment received
    assign_messages: int = 0                          # the Assign messages they came in
    cancels: list = field(default_factory=list)
    pulls: list = field(default_factory=list)         # (max_requests, max_prompt_tokens)
    step_pulls: list = field(default_factory=list)    # the same, of credit sent inside a step
    registered: list = field(default_factory=list)
    drained: bool = False
    errors: list = field(default_factory=list)        # status codes the stream ended with
    acks: list = field(default_factory=list)          # (monotonic time, step_id) of every Ack


class ScriptedReplica:
    def __init__(self, target: str, knobs: Knobs | None = None):
        self.target = target
        self.knobs = knobs or Knobs()
        self.rec = Record()
        self.running: dict[str, Run] = {}
        self.waiting: dict[str, Run] = {}
        self.steps = 0
        self.coalescer = DeltaCoalescer()
        self._outstanding = 0
        self._out: asyncio.Queue | None = None
        self._work = asyncio.Event()
        self._draining = False
        self.connected = asyncio.Event()
        self._stopped = False
        self.cache: set[int] = set(self.knobs.cached)
        self.hasher = BlockHasher(self.knobs.block_size) if self.knobs.prefix_cache else None

    # ---- public ----
    async def run(self) -> None:
        options = [("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
        targets = self.target.split(",")   # several routers: the next one after each break
        turn = 0
        while not self._stopped:
            async with grpc.aio.insecure_channel(targets[turn % len(targets)], options=options) as channel:
                code = await self._session(replica_pb2_grpc.ReplicaGatewayStub(channel))
            self.rec.errors.append(code)
            if not self.knobs.reconnect or self._stopped:
                return
            turn += 1
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        self._stopped = True
        if self._out is not None:
            self._out.put_nowait(None)

    def pull(self, max_requests: int, max_prompt_tokens: int = 0) -> None:
        """max_prompt_tokens 0: no token limit (the field left out)."""
        self.rec.pulls.append((max_requests, max_prompt_tokens))
        self._send(rpb.ReplicaMessage(pull=self._pull_pb(max_requests, max_prompt_tokens)))

    @staticmethod
    def _pull_pb(max_requests: int, max_prompt_tokens: int) -> rpb.Pull:
        limit = {"max_prompt_tokens": max_prompt_tokens} if max_prompt_tokens else {}
        return rpb.Pull(max_requests=max_requests, **limit)

    def grant_seats(self, max_requests: int) -> None:
        """A Pull of seats alone: max_prompt_tokens present and 0 adds no tokens."""
        self.rec.pulls.append((max_requests, 0))
        self._send(rpb.ReplicaMessage(pull=rpb.Pull(max_requests=max_requests, max_prompt_tokens=0)))

    def store(self, hashes) -> None:
        """Blocks the fake cache now holds, told to the router as KV events."""
        self.cache.update(hashes)
        self._send_kv(rpb.KVEvents(stored=list(hashes)))

    def evict(self, hashes) -> None:
        self.cache.difference_update(hashes)
        self._send_kv(rpb.KVEvents(evicted=list(hashes)))

    def replace_cache(self, hashes) -> None:
        """A cleared event: the router's view becomes exactly this set."""
        self.cache = set(hashes)
        self._send_kv(rpb.KVEvents(stored=list(hashes), cleared=True))

    def _send_kv(self, events: rpb.KVEvents) -> None:
        self._send(rpb.ReplicaMessage(step=rpb.StepOutputs(kv_events=events)))

    def hand_back(self, ids) -> None:
        held = self.coalescer.release(ids)   # sent before the requests go, as the worker does
        if held:
            self._send(rpb.ReplicaMessage(step=rpb.StepOutputs(step_id=self.steps, deltas=held)))
        for rid in ids:
            self.running.pop(rid, None)
            self.waiting.pop(rid, None)
        self._send(rpb.ReplicaMessage(hand_back=rpb.HandBack(request_ids=list(ids))))

    # ---- internals ----
    def _send(self, msg) -> None:
        if self._out is not None:
            self._out.put_nowait(msg)

    async def _outgoing(self):
        while True:
            msg = await self._out.get()
            if msg is None:
                return
            yield msg

    async def _session(self, stub):
        self._out = asyncio.Queue()
        held = list(self.running) + list(self.waiting)
        k = self.knobs
        cache = rpb.PrefixCache(block_size=k.block_size, hash_scheme=k.hash_scheme,
                                block_hashes=sorted(self.cache)) if k.prefix_cache else None
        self._send(rpb.ReplicaMessage(register=rpb.Register(
            replica_id=k.replica_id, model=k.model, scheduler="scripted",
            auth_token=k.auth_token, held_request_ids=held, prefix_cache=cache,
            capacity=rpb.ReplicaCapacity(max_num_seqs=k.capacity, max_model_len=k.max_model_len))))
        call = stub.Connect(self._outgoing())
        tasks = [asyncio.create_task(self._steps(call)), asyncio.create_task(self._heartbeats())]
        code = grpc.StatusCode.OK
        try:
            async for msg in call:
                self._handle(msg)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            if self._stopped:
                raise
        finally:
            for t in tasks:
                t.cancel()
            self.connected.clear()
        return code

    def _handle(self, msg: rpb.RouterMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "registered":
            self.rec.registered.append(msg.registered)
            keep = set(msg.registered.keep_request_ids)
            for pool in (self.running, self.waiting):
                for rid in [r for r in pool if r not in keep]:
                    del pool[rid]
            self.coalescer.retain(keep)
            self._outstanding = 0
            self.connected.set()
            self._maybe_pull()
        elif kind == "assign":
            self.rec.assign_messages += 1
            for a in msg.assign.assignments:
                self.rec.assignments.append(a)
                self.coalescer.assigned(a.request_id, a.stream_interval)
                mt = a.sampling.max_tokens if a.sampling.HasField("max_tokens") else (
                    self.knobs.max_model_len - len(a.prompt_token_ids))
                run = Run(a, len(a.resume_token_ids), mt, sum(a.prompt_token_ids))
                pool = self.running if len(self.running) < self.knobs.capacity else self.waiting
                pool[a.request_id] = run
                self._outstanding -= 1
            self._work.set()
        elif kind == "cancel":
            for rid in msg.cancel.request_ids:
                self.rec.cancels.append(rid)
                self.running.pop(rid, None)
                self.waiting.pop(rid, None)
            self.coalescer.retain(set(self.running) | set(self.waiting))
            self._maybe_pull()
        elif kind == "ack":
            self.rec.acks.append((time.monotonic(), msg.ack.step_id))
        elif kind == "drain":
            self.rec.drained = True
            self._draining = True
            self.hand_back(list(self.running) + list(self.waiting))

    def _maybe_pull(self) -> None:
        room = self._grant()
        if room:
            self.pull(room, self.knobs.pull_tokens)

    def _grant(self) -> int:
        """Seats to grant now (0: none), counted as outstanding once returned."""
        if not self.knobs.auto_pull or self._draining:
            return 0
        room = self.knobs.capacity - len(self.running) - len(self.waiting)
        if room > max(self._outstanding, 0):
            self._outstanding = room
            return room
        return 0

    async def _heartbeats(self) -> None:
        await self.connected.wait()
        interval = self.rec.registered[-1].heartbeat_interval_s or 1.0
        while not self.knobs.stop_heartbeats:
            self._send(rpb.ReplicaMessage(heartbeat=rpb.Heartbeat(
                running=len(self.running), waiting=len(self.waiting),
                request_ids=list(self.running) + list(self.waiting))))
            await asyncio.sleep(interval)

    async def _steps(self, call) -> None:
        k = self.knobs
        while True:
            while not self.running:
                self._work.clear()
                await self._work.wait()
            if k.step_delay:
                await asyncio.sleep(k.step_delay)
            else:
                await asyncio.sleep(0)
            if k.hold_on_finish:
                self._work.clear()
                await self._work.wait()
                continue
            step = self._step()
            room = self._grant()
            if room and k.step_credit and self.rec.registered[-1].step_credit:
                self.rec.step_pulls.append((room, k.pull_tokens))
                step.pull.CopyFrom(self._pull_pb(room, k.pull_tokens))
                room = 0
            if step.deltas or step.HasField("pull") or step.HasField("kv_events"):
                self._send(rpb.ReplicaMessage(step=step))
            self.steps += 1
            self._after_step(call)
            if room:
                self.pull(room, k.pull_tokens)

    def _step(self) -> rpb.StepOutputs:
        k = self.knobs
        step = rpb.StepOutputs(step_id=self.steps, batch_size=len(self.running))
        stored = []
        computed = 0
        for rid, run in list(self.running.items()):
            if k.cache_prompts and run.next_index == len(run.assignment.resume_token_ids):
                stored += self.hasher.hashes(list(run.assignment.prompt_token_ids))
            n = min(k.tokens_per_step, run.max_tokens - run.next_index)
            toks = [(run.sum_prompt + run.next_index + j) % k.vocab for j in range(n)]
            computed += n
            d = rpb.RequestDelta(request_id=rid, token_ids=toks, output_offset=run.next_index,
                                 text="".join(f"<{t}>" for t in toks))
            run.next_index += n
            if run.next_index >= run.max_tokens:
                d.finish_reason = gpb.FINISH_REASON_LENGTH
                del self.running[rid]
            sent = self.coalescer.offer(d)
            if sent is not None:
                step.deltas.append(sent)
        while self.waiting and len(self.running) < k.capacity:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
        step.num_tokens = computed
        if stored:
            self.cache.update(stored)
            step.kv_events.stored.extend(stored)
        return step

    def _after_step(self, call) -> None:
        k = self.knobs
        if k.garbage and self.steps == k.garbage_after_steps:
            self._send(self._garbage(k.garbage))
        if k.fail_after_steps is not None and self.steps >= k.fail_after_steps:
            if k.die:
                os._exit(17)
            call.cancel()

    def _garbage(self, kind: str) -> rpb.ReplicaMessage:
        if kind == "empty":
            return rpb.ReplicaMessage()
        if kind == "register":
            return rpb.ReplicaMessage(register=rpb.Register(replica_id=self.knobs.replica_id))
        step = rpb.StepOutputs(step_id=self.steps)
        if kind == "unowned":
            step.deltas.add(request_id="not-assigned-here", token_ids=[1], output_offset=0)
        else:  # bad_offset: skips ahead, as if a step had been lost
            rid = next(iter(self.running or {r.request_id: 0 for r in self.rec.assignments}))
            run = self.running.get(rid)
            step.deltas.add(request_id=rid, token_ids=[1], output_offset=(run.next_index if run else 0) + 5)
        return rpb.ReplicaMessage(step=step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="HOST:PORT[,HOST:PORT...]")
    p.add_argument("--id", default="r0")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--fail-after-steps", type=int)
    p.add_argument("--die", action="store_true", help="os._exit instead of a stream break")
    p.add_argument("--stop-heartbeats", action="store_true")
    p.add_argument("--garbage")
    p.add_argument("--auth-token", default="")
    p.add_argument("--reconnect", action="store_true")
    a = p.parse_args(argv)
    knobs = Knobs(replica_id=a.id, vocab=a.vocab, capacity=a.capacity, step_delay=a.step_delay,
                  tokens_per_step=a.tokens_per_step, fail_after_steps=a.fail_after_steps,
                  die=a.die, stop_heartbeats=a.stop_heartbeats, garbage=a.garbage,
                  auth_token=a.auth_token, reconnect=a.reconnect)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(ScriptedReplica(a.router, knobs).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
