"""A replica run with --tensor-parallel-size 2 through the whole stack: two processes,
one replica to the router, transformers' tokens to the clients; a dead rank ends the
replica and the router moves its work; the ranks end together."""

import asyncio
import os
import re
import signal
import time

from common.pb.quadriga.v1 import generation_pb2 as pb
from common.redis_server import free_port
from tests.e2e.test_end_to_end import PROMPTS, generate, generate_all, replica_metric

TP = ("--tensor-parallel-size", "2")


def follower_pid(child) -> int:
    found = re.search(r"tensor-parallel rank 1 started: pid (\d+)", child.log_path.read_text(errors="replace"))
    assert found, f"no rank 1 in the replica's log:\n{child.tail()}"
    return int(found.group(1))


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned rank is reaped by whoever adopts it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while running(pid):
        assert time.monotonic() < deadline, f"rank process {pid} outlived its replica"
        time.sleep(0.05)


def test_one_replica_exact_tokens_and_a_dead_rank_moves_its_work(live_stack, hf_reference):
    metrics_port = free_port()
    stack = live_stack("pull", router_args=("--metrics-port", str(metrics_port)))
    tp = stack.start_replica("tp0", *TP, "--max-num-seqs", "4")
    rank1 = follower_pid(tp)
    assert running(rank1)
    assert replica_metric(metrics_port, "quadriga_replicas_connected") == 1

    results = asyncio.run(generate_all(stack.address, PROMPTS[:4], 16))
    for prompt, (tokens, last) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, 16)
        assert last.timings.replica_id == "tp0"

    max_tokens = 200

    async def scenario():
        progress = [[0] for _ in PROMPTS[:4]]
        tasks = [asyncio.create_task(generate(stack.address, p, max_tokens, progress=n))
                 for p, n in zip(PROMPTS, progress)]
        while min(n[0] for n in progress) < 3:
            await asyncio.sleep(0.01)
        assert max(n[0] for n in progress) < max_tokens
        os.kill(rank1, signal.SIGKILL)
        await asyncio.to_thread(stack.start_replica, "r1")
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    requeued = 0
    for prompt, (tokens, last) in zip(PROMPTS, results):
        assert tokens == hf_reference(prompt, max_tokens)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        requeued += last.timings.requeues
    assert requeued > 0, "rank 1's death should have moved tp0's requests to r1"
    assert tp.proc.wait(30) == 70
    assert re.search(rf"tensor-parallel rank 1 \(pid {rank1}\) exited with status -9", tp.log_path.read_text())


def test_the_ranks_end_with_rank_zero(live_stack):
    stack = live_stack("pull")
    tp = stack.start_replica("tp0", *TP)
    rank1 = follower_pid(tp)
    tp.proc.send_signal(signal.SIGTERM)  # drain: nothing to finish, a clean exit
    assert tp.proc.wait(30) == 0
    wait_gone(rank1)

    tp = stack.start_replica("tp1", *TP)
    rank1 = follower_pid(tp)
    tp.proc.kill()
    tp.proc.wait(10)
    wait_gone(rank1)
    assert "rank 0 exited; tensor-parallel rank 1 exits with it" in tp.log_path.read_text()
