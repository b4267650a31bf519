"""A replica run with --tensor-parallel-size 2 through the whole stack: two processes,
one replica to the router, transformers' tokens to the clients; a dead rank ends the
replica and the router moves its work; the ranks end together."""

import asyncio
import os
import re
import signal
import time

from common.redis_server import free_port
from tests.e2e.test_end_to_end import (
    PROMPTS,
    generate_all,
    generate_and_fail_midway,
    replica_metric,
    requeues_of_exact_results,
)
from tests.support.live_stack import engine_pid

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

    async def kill_rank1_and_add_a_replica():
        os.kill(rank1, signal.SIGKILL)
        await asyncio.to_thread(stack.start_replica, "r1")

    results = asyncio.run(generate_and_fail_midway(stack.address, PROMPTS[:4], max_tokens,
                                                   kill_rank1_and_add_a_replica, min_tokens=3))
    requeued = requeues_of_exact_results(PROMPTS, results, hf_reference, max_tokens)
    assert requeued > 0, "rank 1's death should have moved tp0's requests to r1"
    assert tp.proc.wait(30) == 70
    # Whichever rank 0 notices first, its watcher of rank 1 or the step's broken
    # collective, the log says why the replica ended.
    assert re.search(rf"tensor-parallel rank 1 \(pid {rank1}\) exited with status -9|"
                     r"engine cannot go on \(.*Connection reset by peer", tp.log_path.read_text())


def test_the_ranks_end_with_rank_zero(live_stack):
    stack = live_stack("pull")
    # The three replicas start together (each start is most of this test's time).
    for rid in ("tp0", "tp1", "tp2"):
        stack.start_replica(rid, *TP, wait=False)
    stack.wait_registered("tp0", "tp1", "tp2")
    tp = stack.replicas["tp0"]
    rank1 = follower_pid(tp)
    tp.proc.send_signal(signal.SIGTERM)  # drain: nothing to finish, a clean exit
    assert tp.proc.wait(30) == 0
    wait_gone(rank1)

    tp = stack.replicas["tp1"]
    rank0, rank1 = engine_pid(tp), follower_pid(tp)
    tp.proc.kill()  # the worker: its engine process (rank 0) sees the pipe close, and ends the ranks
    tp.proc.wait(10)
    wait_gone(rank0)
    wait_gone(rank1)

    tp = stack.replicas["tp2"]
    rank0, rank1 = engine_pid(tp), follower_pid(tp)
    os.kill(rank0, signal.SIGKILL)  # rank 0 dies abruptly: rank 1 and the worker end with it
    wait_gone(rank1)
    assert tp.proc.wait(30) == 70
    assert "rank 0 exited or gave up on the ranks; tensor-parallel rank 1 exits with it" in tp.log_path.read_text()
