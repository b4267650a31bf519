"""The whole system as processes: router, Redis, two real replica engines.

Outputs are checked token for token against transformers' greedy generation.
"""

import asyncio
import signal
import time

import grpc
import pytest

from client.api import aio_channel, make_request
from common.pb.quadriga.v1 import generation_pb2 as pb
from common.pb.quadriga.v1 import generation_pb2_grpc

POLICIES = ["pull", "round_robin", "least_outstanding"]
PROMPTS = [[5 + i, 17, 230 - i, 9, 44 + 3 * i] + list(range(60, 60 + 7 * i)) for i in range(8)]


async def generate(address, prompt, max_tokens, progress=None, **kw):
    """Streams one request; returns (token ids, final message). progress, a list,
    gets the running token count of this request as messages arrive."""
    async with aio_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens, last = [], None
        async for msg in stub.Generate(make_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True, **kw), timeout=120):
            assert msg.output_offset == len(tokens), "a gap or a duplicate reached the client"
            tokens.extend(msg.token_ids)
            last = msg
            if progress is not None:
                progress[0] = len(tokens)
        return tokens, last


async def generate_all(address, prompts, max_tokens):
    return await asyncio.gather(*(generate(address, p, max_tokens) for p in prompts))


async def generate_and_fail_midway(address, prompts, max_tokens, fail, min_tokens=5, intervals=None):
    """Streams every prompt; once each has streamed min_tokens and none is near its end,
    awaits fail() (a kill, say); returns generate()'s results. intervals: each
    request's stream_interval (default: the router's)."""
    progress = [[0] for _ in prompts]
    intervals = intervals or [0] * len(prompts)
    tasks = [asyncio.create_task(generate(address, p, max_tokens, progress=n, stream_interval=k))
             for p, n, k in zip(prompts, progress, intervals)]
    while min(n[0] for n in progress) < min_tokens:
        await asyncio.sleep(0.01)
    assert max(n[0] for n in progress) < max_tokens
    await fail()
    return await asyncio.gather(*tasks)


def requeues_of_exact_results(prompts, results, hf_reference, max_tokens) -> int:
    """Asserts each request got transformers' whole output; the requeues they went through."""
    requeued = 0
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == hf_reference(prompt, max_tokens)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        requeued += last.timings.requeues
    return requeued


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_outputs_equal_transformers_on_two_replicas(live_stack, hf_reference, policy):
    stack = live_stack(policy)
    # Four seats each: neither replica can take all eight requests at once.
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
    stack.wait_registered("r0", "r1")
    results = asyncio.run(generate_all(stack.address, PROMPTS, 20))
    replicas = set()
    for prompt, (tokens, last) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, 20)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.timings.output_tokens == 20
        replicas.add(last.timings.replica_id)
    assert replicas == {"r0", "r1"}, "both replicas should have served"


@pytest.mark.parametrize("policy", POLICIES)
def test_replica_killed_mid_generation_loses_nothing(live_stack, hf_reference, policy):
    stack = live_stack(policy)
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
    stack.wait_registered("r0", "r1")
    max_tokens = 300

    async def kill_r0():
        stack.replicas["r0"].proc.send_signal(signal.SIGKILL)

    # Four seats each, so all eight run at once when r0 dies. Half coalesce at
    # the replica: the tokens r0 held for them die with it and are recomputed.
    intervals = [0, 8] * (len(PROMPTS) // 2)
    results = asyncio.run(generate_and_fail_midway(stack.address, PROMPTS, max_tokens, kill_r0,
                                                   intervals=intervals))
    requeued = requeues_of_exact_results(PROMPTS, results, hf_reference, max_tokens)
    assert requeued > 0, "the kill should have moved some requests to r1"


def test_a_replica_whose_engine_dies_hands_its_work_back_at_once(live_stack, hf_reference):
    """kill -9 of the engine process: the worker hands every request in hand back
    before it exits 70, so the router resumes them now, not a 30-s lease later."""
    import os

    from common.redis_server import free_port
    from tests.support.live_stack import engine_pid

    metrics_port = free_port()
    stack = live_stack("pull", router_args=("--metrics-port", str(metrics_port), "--lease-ttl", "30"))
    for rid in ("r0", "r1"):
        stack.start_replica(rid, "--max-num-seqs", "4", wait=False)
    stack.wait_registered("r0", "r1")
    max_tokens = 300

    async def kill_r0s_engine():
        os.kill(engine_pid(stack.replicas["r0"]), signal.SIGKILL)

    results = asyncio.run(generate_and_fail_midway(stack.address, PROMPTS, max_tokens, kill_r0s_engine))
    assert requeues_of_exact_results(PROMPTS, results, hf_reference, max_tokens) > 0
    assert stack.replicas["r0"].proc.wait(30) == 70
    assert replica_metric(metrics_port, 'quadriga_requeues_total{reason="hand_back"}'), \
        "the requests came back by a hand-back"
    assert not replica_metric(metrics_port, 'quadriga_requeues_total{reason="lease_expired"}')


def test_replica_joining_under_load_takes_work(live_stack, hf_reference):
    stack = live_stack("pull")
    # One seat, and r0's engine paused while r1 starts: r1 joins while r0 is
    # mid-request and most requests still wait, however fast r0 would have
    # served them alone and however slow r1's start-up is on a busy machine.
    stack.start_replica("r0", "--max-num-seqs", "1")
    prompts = PROMPTS * 3

    async def scenario():
        progress = [[0] for _ in prompts]
        tasks = [asyncio.create_task(generate(stack.address, p, 300, progress=n))
                 for p, n in zip(prompts, progress)]
        while max(n[0] for n in progress) == 0:
            await asyncio.sleep(0.01)
        with stack.engines_paused("r0"):
            await asyncio.to_thread(stack.start_replica, "r1")
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    served = [last.timings.replica_id for _, last in results]
    assert "r1" in served and "r0" in served
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == hf_reference(prompt, 300)


def replica_metric(port: int, name: str) -> float | None:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_cancel_and_bad_input_disturb_no_one(live_stack, hf_reference):
    from common.redis_server import free_port

    stack = live_stack("pull")
    metrics_port = free_port()
    stack.start_replica("r0", "--metrics-port", str(metrics_port))

    async def scenario():
        good = asyncio.create_task(generate(stack.address, PROMPTS[1], 40))
        victim = asyncio.create_task(generate(stack.address, PROMPTS[2], 900, request_id="victim"))
        async with aio_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Generate(make_request([1, 2, 10**6], max_tokens=5)):
                    pass
            await asyncio.sleep(0.5)
            cancelled = await stub.Cancel(pb.CancelRequest(request_id="victim"))
        return await good, await victim, bad.value, cancelled

    (good_tokens, _), (_, victim_last), bad, cancelled = asyncio.run(scenario())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocab" in bad.details()
    assert cancelled.cancelled
    assert victim_last.finish_reason == pb.FINISH_REASON_CANCELLED
    assert good_tokens == hf_reference(PROMPTS[1], 40)
    # The cancel reached the engine: nothing runs and every KV block is free again.
    for _ in range(100):
        if replica_metric(metrics_port, "quadriga_replica_running") == 0:
            break
        time.sleep(0.05)
    assert replica_metric(metrics_port, "quadriga_replica_running") == 0
    assert replica_metric(metrics_port, "quadriga_replica_kv_utilisation") == 0


def test_sigterm_drains_and_exits_cleanly(live_stack, hf_reference):
    stack = live_stack("pull")
    r0 = stack.start_replica("r0", "--drain-timeout", "30")

    async def scenario():
        tasks = [asyncio.create_task(generate(stack.address, p, 80)) for p in PROMPTS[:4]]
        await asyncio.sleep(0.5)
        r0.proc.send_signal(signal.SIGTERM)
        stack.start_replica("r1", wait=False)
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    for prompt, (tokens, _) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, 80)
    assert r0.proc.wait(30) == 0
