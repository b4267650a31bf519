"""The router process is SIGKILLed and restarted: every accepted request still
completes, exactly, for a client that re-attaches by request_id."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.tokenizer import vocab_size
from tests.router.test_redis_faults import permanent
from tests.support.router_harness import client, free_port, request, tokens_of
from tests.support.scripted_replica import expected_tokens

ROOT = Path(__file__).resolve().parents[2]
N = 60  # output tokens per request: about 2 s of scripted steps


def start_router(port, redis_url, model, prefix, log, lease_ttl, policy="pull"):
    env = {**os.environ, "QUADRIGA_REDIS_PREFIX": prefix, "PYTHONPATH": str(ROOT),
           "QUADRIGA_ROUTER_POLICY": policy}
    return subprocess.Popen(
        [sys.executable, "-m", "router", "--port", str(port), "--host", "127.0.0.1",
         "--redis-url", redis_url, "--model", str(model), "--lease-ttl", str(lease_ttl),
         "--heartbeat-interval", "0.5", "--no-replica-timeout", "20"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_replica(port, rid, vocab, log, capacity=8):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.scripted_replica", "--router", f"127.0.0.1:{port}",
         "--id", rid, "--vocab", str(vocab), "--step-delay", "0.03", "--reconnect",
         "--capacity", str(capacity)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)


def wait_for_joined(log_path: Path, replica_ids, timeout: float = 60) -> None:
    """Until the router logged every replica's registration: a request sent before
    would find one replica and, under a per-replica policy, stay bound to it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if all(f"replica {rid} joined" in text for rid in replica_ids):
            return
        time.sleep(0.05)
    raise AssertionError(f"replicas never joined:\n{log_path.read_text(errors='replace')[-2000:]}")


async def follow(stub, req, progress: dict, breaks: list):
    """Streams until finished, re-attaching (from token 0) whenever the stream breaks."""
    for _ in range(300):
        msgs = []
        try:
            async for m in stub.Generate(req, timeout=60):
                msgs.append(m)
                progress[req.request_id] = len(tokens_of(msgs))
            return msgs
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
            if msgs:
                breaks.append(req.request_id)
            await asyncio.sleep(0.2)
    raise AssertionError("never finished")


def assert_no_leaks(redis_url, prefix):
    """After every request finished: empty queues and in-flight set, and every
    request key expires (result_ttl)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        for key in r.scan_iter(match=f"{prefix}*"):
            name = key.decode()[len(prefix):]
            if permanent(name):
                continue
            assert not name.startswith("q:") and name != "inflight", (name, r.type(key))
            assert r.ttl(key) > 0, f"{name} never expires"
    finally:
        r.close()


CASES = {
    # Short leases: in-flight work is requeued at restart. Long leases: the
    # replicas re-register with held_request_ids and keep running it.
    "pull-leases-expire": ("pull", 2, 8, 10),
    "pull-replicas-keep-work": ("pull", 30, 8, 10),
    # Per-replica policies, three seats each: when the router dies some requests
    # run and the rest wait in the replicas' own queues.
    "round_robin-leases-expire": ("round_robin", 2, 3, 12),
    "least_outstanding-replicas-keep-work": ("least_outstanding", 30, 3, 12),
}


@pytest.mark.parametrize("policy,lease_ttl,seats,num_requests", CASES.values(), ids=CASES.keys())
def test_router_sigkill_and_restart_loses_nothing(redis_url, tiny_model, tmp_path, arun,
                                                  policy, lease_ttl, seats, num_requests):
    port, prefix = free_port(), f"restart{uuid.uuid4().hex[:6]}:"
    vocab = vocab_size(tiny_model)
    log = open(tmp_path / "procs.log", "w")
    router = start_router(port, redis_url, tiny_model, prefix, log, lease_ttl, policy)
    replicas = [start_replica(port, f"r{i}", vocab, log, capacity=seats) for i in range(2)]
    wait_for_joined(tmp_path / "procs.log", ["r0", "r1"])
    prompts = {f"job{i}": [i + 1, 7] for i in range(num_requests)}
    running = min(num_requests, 2 * seats)

    async def scenario():
        nonlocal router
        progress: dict = {}
        breaks: list = []
        async with client(f"127.0.0.1:{port}") as stub:
            reqs = [request(p, N, request_id=rid) for rid, p in prompts.items()]
            tasks = [asyncio.create_task(follow(stub, r, progress, breaks)) for r in reqs]
            # Kill the router once every seat is streaming and no request is done.
            deadline = time.monotonic() + 60
            while len(progress) < running or min(progress.values()) < 3:
                assert time.monotonic() < deadline and router.poll() is None, "router never served"
                await asyncio.sleep(0.05)
            assert max(progress.values()) < N
            assert running == num_requests or len(progress) < num_requests, "some must still wait"
            under_way = set(progress)
            router.send_signal(signal.SIGKILL)
            router.wait()
            await asyncio.sleep(0.5)
            router = start_router(port, redis_url, tiny_model, prefix, log, lease_ttl, policy)
            results = await asyncio.gather(*tasks)
        assert under_way <= set(breaks)  # every running stream really broke mid-way
        for (rid, p), msgs in zip(prompts.items(), results):
            assert tokens_of(msgs) == expected_tokens(p, N, vocab), rid
            assert msgs[-1].finish_reason == gpb.FINISH_REASON_LENGTH
        await asyncio.sleep(0.5)
        assert_no_leaks(redis_url, prefix)

    try:
        arun(scenario(), timeout=150)
    finally:
        for proc in [router, *replicas]:
            proc.kill()
            proc.wait()
        log.close()
