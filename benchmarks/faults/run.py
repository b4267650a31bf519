"""Every fault of the router's failure model under load, repeated, as a table.

A real stack of processes: Redis with an append-only file, the router, and 2
CPU replicas with real engines (a tiny random model built offline), the
replicas dialling the router through a TCP proxy that can reset their
connections. Per run, 32 concurrent streams of 200 greedy tokens; once every
stream is under way (each has 20 tokens, none is done) one fault is applied:

  router_sigterm   SIGTERM the router, start a new one on the same port
  router_sigkill   SIGKILL the router, start a new one
  replica_sigkill  SIGKILL one replica and start it again, as a supervisor would
  network_blip     reset every replica connection (all processes live)
  redis_sigkill    SIGKILL Redis, restart it from its append-only file after 1 s
  redis_sigstop    SIGSTOP Redis for 5 s, then SIGCONT

Clients re-attach by request_id whenever a stream breaks. Per fault the table
gives the requests, those completed with transformers' exact greedy tokens,
those lost (never finished), tokens delivered twice within one stream, and
the client-visible stall: per stream, the longest wait between two tokens it
had not seen before, as p50 and p99 over the fault's streams.

    .venv/bin/python -m benchmarks.faults.run            # writes benchmarks/results/faults.json
    .venv/bin/python -m benchmarks.faults.run --repeats 1 --faults network_blip
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import tree_commit  # noqa: E402
from common.redis_server import RedisServer  # noqa: E402
from common.tiny_model import build_tiny_model  # noqa: E402
from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.live_stack import LiveStack  # noqa: E402

FAULTS = ("router_sigterm", "router_sigkill", "replica_sigkill", "network_blip", "redis_sigkill",
          "redis_sigstop")
REPLICA_FAULTS = ("replica_sigkill", "network_blip")


class Stream:
    """One client request followed to its end across re-attaches."""

    def __init__(self, address: str, prompt: list[int], request_id: str, max_tokens: int):
        self.address, self.prompt, self.request_id, self.max_tokens = address, prompt, request_id, max_tokens
        self.seen = 0                # distinct output positions received so far
        self.last_new = time.monotonic()
        self.longest_gap = 0.0
        self.duplicates = 0
        self.tokens: list[int] | None = None
        self.breaks = 0

    async def run(self, deadline: float) -> None:
        import grpc

        from client.api import aio_channel, make_request
        from common.pb.quadriga.v1 import generation_pb2_grpc

        req = make_request(self.prompt, request_id=self.request_id, max_tokens=self.max_tokens,
                           temperature=0.0, ignore_eos=True)
        self.last_new = time.monotonic()
        while time.monotonic() < deadline:
            tokens = []
            try:
                async with aio_channel(self.address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    async for msg in stub.Generate(req, timeout=max(1.0, deadline - time.monotonic())):
                        if msg.output_offset < len(tokens):
                            self.duplicates += len(tokens) - msg.output_offset
                        tokens[msg.output_offset:] = list(msg.token_ids)
                        if len(tokens) > self.seen:
                            now = time.monotonic()
                            self.longest_gap = max(self.longest_gap, now - self.last_new)
                            self.seen, self.last_new = len(tokens), now
                        if msg.HasField("finish_reason"):
                            self.tokens = tokens
                            return
            except grpc.aio.AioRpcError:
                self.breaks += 1
                await asyncio.sleep(0.2)


class FaultStack:
    def __init__(self, work: Path, model: str, lease_ttl: float, seats: int,
                 replica_args: dict | None = None, router_args: tuple = ()):
        self.redis = RedisServer(work / "redis", appendonly=True)
        self.redis.start()
        self.stack = LiveStack(work, self.redis.url, model, "pull",
                               ("--lease-ttl", str(lease_ttl), "--log-level", "WARNING", *router_args))
        self.stack.start_router()
        self.proxy = FaultProxy(self.stack.port).start()
        self.seats = seats
        self.replica_args = replica_args or {}
        for rid in ("r0", "r1"):
            self.start_replica(rid)

    def start_replica(self, rid: str) -> None:
        self.stack.start_replica(rid, "--max-num-seqs", str(self.seats), *self.replica_args.get(rid, ()),
                                 router=self.proxy.address)

    @property
    def address(self) -> str:
        return self.stack.address

    async def apply(self, fault: str) -> None:
        st = self.stack
        if fault in ("router_sigterm", "router_sigkill"):
            st.router.proc.send_signal(signal.SIGTERM if fault == "router_sigterm" else signal.SIGKILL)
            await asyncio.to_thread(st.router.proc.wait, 30)
            await asyncio.to_thread(st.start_router)
        elif fault == "replica_sigkill":
            st.replicas["r0"].proc.kill()
            await asyncio.to_thread(st.replicas["r0"].proc.wait)
            await asyncio.to_thread(self.start_replica, "r0")
        elif fault == "network_blip":
            self.proxy.reset()
        elif fault == "redis_sigkill":
            # In threads: the followers share this event loop and must keep reading.
            await asyncio.to_thread(self.redis.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.redis.start)
        elif fault == "redis_sigstop":
            self.redis.pause()
            await asyncio.sleep(5.0)
            self.redis.resume()
        else:
            raise ValueError(fault)

    def stop(self) -> None:
        self.stack.stop()
        self.proxy.stop()
        self.redis.stop()


def reference(model: str, prompts, max_tokens: int) -> list[list[int]]:
    from tests.engine.hf_reference import hf_greedy

    return hf_greedy(model, prompts, max_tokens)


async def one_run(stack: FaultStack, fault: str, prompts, max_tokens: int, tag: str) -> list[Stream]:
    streams = [Stream(stack.address, p, f"{tag}-{i}", max_tokens) for i, p in enumerate(prompts)]
    deadline = time.monotonic() + 300
    tasks = [asyncio.create_task(s.run(deadline)) for s in streams]
    while min(s.seen for s in streams) < 20:
        if all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.02)
    if max(s.seen for s in streams) >= max_tokens:
        print(f"  ({tag}: a stream finished before the fault; the run still counts)", flush=True)
    await stack.apply(fault)
    await asyncio.gather(*tasks)
    return streams


def summarize(fault: str, streams: list[Stream], expected: list[list[int]], lease_ttl: float) -> dict:
    gaps = [s.longest_gap for s in streams]
    exact = sum(s.tokens == expected[i % len(expected)] for i, s in enumerate(streams))
    target = 2 * lease_ttl if fault in REPLICA_FAULTS else 5.0
    row = dict(fault=fault, requests=len(streams), completed_exact=exact,
               lost=sum(s.tokens is None for s in streams),
               duplicated_tokens=sum(s.duplicates for s in streams),
               stall_p50_s=round(float(np.percentile(gaps, 50)), 2),
               stall_p99_s=round(float(np.percentile(gaps, 99)), 2),
               stall_max_s=round(max(gaps), 2), stall_target_p99_s=target,
               client_reattaches=sum(s.breaks for s in streams))
    row["met"] = row["lost"] == 0 and row["duplicated_tokens"] == 0 and \
        row["completed_exact"] == row["requests"] and row["stall_p99_s"] < target
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/faults.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="quadriga-faults-"))
    model = str(build_tiny_model(work / "model"))
    prompts = [[5 + i, 17, 230 - i, 9, 44 + 3 * i] + list(range(60, 60 + (i % 8) * 5))
               for i in range(args.streams)]
    expected = reference(model, prompts, args.max_tokens)
    stack = FaultStack(work, model, args.lease_ttl, seats=(args.streams + 1) // 2)
    rows = []
    try:
        for fault in args.faults:
            streams = []
            for rep in range(args.repeats):
                t0 = time.monotonic()
                streams += asyncio.run(one_run(stack, fault, prompts, args.max_tokens, f"{fault}-{rep}"))
                print(f"{fault} run {rep + 1}/{args.repeats}: {time.monotonic() - t0:.1f} s", flush=True)
            rows.append(summarize(fault, streams, expected, args.lease_ttl))
            print(json.dumps(rows[-1]), flush=True)
            assert not stack.stack.replica_failures(), stack.stack.replica_failures()
    finally:
        stack.stop()
    result = {
        "command": " ".join(["python", "-m", "benchmarks.faults.run", *map(shlex.quote, sys.argv[1:])]),
        "commit": tree_commit(),
        "setup": f"Redis (AOF), router, 2 CPU replicas (tiny model, {(args.streams + 1) // 2} seats, "
                 f"1 torch thread each) behind a TCP proxy; {args.streams} concurrent streams of "
                 f"{args.max_tokens} greedy tokens per run; lease_ttl {args.lease_ttl:g} s; "
                 f"{args.repeats} runs per fault; 2 shared cores",
        "stall": "per stream, the longest wait between two tokens it had not seen before "
                 "(re-attaches replay from token 0; only new tokens count)",
        "targets": "0 lost and 0 duplicated; stall p99 < 2 x lease_ttl for replica faults, "
                   "< 5 s for router and Redis faults",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
