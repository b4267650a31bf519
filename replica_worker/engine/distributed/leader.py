"""Rank 0 of a tensor-parallel engine: starts ranks 1..N-1, joins them, watches them.

The engine's own process is rank 0: it runs the scheduler, the block manager and the
sampler, and publishes each step's batch. Ranks 1..N-1 are processes it starts
(`python -m replica_worker.engine.distributed.follower`, so no user script is
re-imported), each with its own device (cuda:r on GPUs). They rendezvous on a
TCPStore that rank 0 binds to a free loopback port, and join one process group.

Lifetimes are tied both ways:
- A rank that exits while rank 0 runs leaves the model unusable (its collectives would
  wait forever on CUDA): rank 0 logs which rank died and exits at once with status
  RANK_FAILED_EXIT, as a crashed replica, so the router requeues its requests.
- Each rank holds the read end of a pipe whose write end only rank 0 holds: on EOF
  (rank 0 died, however) the rank exits; shutdown() writes "stop" first, and the rank
  exits quietly.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from replica_worker.engine.config import EngineConfig
from replica_worker.engine.distributed.follower import STOP
from replica_worker.engine.distributed.group import RankContext
from replica_worker.engine.distributed.step_channel import StepChannel
from replica_worker.engine.distributed.torch_group import join, leave
from replica_worker.engine.model import LlamaShape, load_hf_config
from replica_worker.engine.model.parallel import tensor_parallel_problem

log = logging.getLogger(__name__)

# Exit status of rank 0 when another rank died (sysexits' EX_SOFTWARE, as for a failed GPU).
RANK_FAILED_EXIT = 70
_PROJECT_ROOT = Path(__file__).resolve().parents[3]


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU from the configured one, or the CPU."""
    if device == "cpu":
        return "cpu"
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


@dataclass
class _Follower:
    rank: int
    proc: subprocess.Popen
    life_fd: int  # write end of the rank's pipe; closing it tells the rank to exit


def check_splits(config: EngineConfig) -> None:
    """Raises ValueError, before any process starts, when the model does not split
    or the GPUs its ranks would run on are not there."""
    size = config.parallel.tensor_parallel_size
    shape = LlamaShape.from_hf_config(load_hf_config(config.model.model))
    problem = tensor_parallel_problem(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, size)
    if problem:
        raise ValueError(f"{config.model.model} cannot run tensor-parallel: {problem}")
    if config.device != "cpu":
        last = rank_device(config.device, size - 1)
        if int(last.partition(":")[2]) >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} runs its last rank on {last}, "
                             f"but {torch.cuda.device_count()} GPUs are visible")


class TensorParallelLeader:
    def __init__(self, config: EngineConfig) -> None:
        self.size = config.parallel.tensor_parallel_size
        check_splits(config)
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group (another tensor-parallel "
                               "engine?): shut that one down first (LLM.shutdown())")
        self._stopping = False
        self._lock = threading.Lock()
        self._threads_before = torch.get_num_threads()
        self._threads = self._share_cores(config.device)
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False)
        self._followers = [self._spawn(config, rank) for rank in range(1, self.size)]
        atexit.register(self.shutdown)
        device = rank_device(config.device, 0)
        try:
            tensors, host = join(0, self.size, self._store, torch.device(device))
        except BaseException:
            self.abort("rank 0 could not join the process group")
            raise
        self.ranks = RankContext(tensors, device, StepChannel(host, config.cache.block_size))
        log.info("tensor parallel: %d ranks joined (rank 0 on %s)", self.size, device)

    def _share_cores(self, device: str) -> int:
        """Torch threads per rank. On the CPU the ranks split the cores: N processes
        each spinning up every core's worth of threads would wait on each other in
        every collective (a tiny model's step went from 10 ms to 70 ms)."""
        if device != "cpu":
            return self._threads_before
        per_rank = max(1, min(self._threads_before, len(os.sched_getaffinity(0)) // self.size))
        torch.set_num_threads(per_rank)
        return per_rank

    def _spawn(self, config: EngineConfig, rank: int) -> _Follower:
        read_fd, write_fd = os.pipe()
        device = rank_device(config.device, rank)
        command = [
            sys.executable, "-m", "replica_worker.engine.distributed.follower",
            "--rank", str(rank), "--size", str(self.size), "--store-port", str(self._store.port),
            "--device", device, "--threads", str(self._threads), "--life-fd", str(read_fd),
            "--config", json.dumps(dataclasses.asdict(config)),
        ]
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PROJECT_ROOT), path]))}
        try:
            proc = subprocess.Popen(command, pass_fds=(read_fd,), env=env)
        finally:
            os.close(read_fd)
        log.info("tensor-parallel rank %d started: pid %d, device %s", rank, proc.pid, device)
        follower = _Follower(rank, proc, write_fd)
        threading.Thread(target=self._watch, args=(follower,), name=f"tp-rank-{rank}-watch", daemon=True).start()
        return follower

    def _watch(self, follower: _Follower) -> None:
        status = follower.proc.wait()
        with self._lock:
            if self._stopping:
                return
        log.critical("tensor-parallel rank %d (pid %d) exited with status %s; the model cannot run without "
                     "it, so this process exits with status %d (a replica's requests are requeued by the router)",
                     follower.rank, follower.proc.pid, status, RANK_FAILED_EXIT)
        logging.shutdown()
        os._exit(RANK_FAILED_EXIT)

    def _begin_stop(self) -> bool:
        """True for the one caller that gets to stop the ranks (and disarms the watchers)."""
        with self._lock:
            if self._stopping:
                return False
            self._stopping = True
        atexit.unregister(self.shutdown)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops ranks 1..N-1 and leaves the process group. Idempotent.

        First together: a stop over the step channel, and every rank leaves the group
        (NCCL's teardown may want its peers). Then the pipes: "stop" and EOF for a rank
        that is somehow still there, and a kill past the timeout."""
        if not self._begin_stop():
            return
        try:
            self.ranks.steps.publish_stop()
            leave()
        except Exception as exc:  # a rank already gone: the pipes below still end the rest
            log.warning("tensor-parallel ranks did not stop together: %s", exc)
        self._end_followers(STOP, timeout)
        leave()
        torch.set_num_threads(self._threads_before)

    def abort(self, reason: str, timeout: float = 10.0) -> None:
        """Ends ranks 1..N-1 without a word over the channel, which a failed step (or
        start-up) may have left out of step: each sees its pipe close and exits. Later
        steps raise RuntimeError(reason)."""
        if not self._begin_stop():
            return
        log.error("stopping the tensor-parallel ranks: %s", reason)
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.steps.close(reason)
        self._end_followers(b"", timeout)
        leave()
        torch.set_num_threads(self._threads_before)

    def _end_followers(self, word: bytes, timeout: float) -> None:
        for f in self._followers:
            if word:
                try:
                    f.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("tensor-parallel rank %d did not stop within %.0f s", f.rank, timeout)
                try:
                    os.write(f.life_fd, word)
                except OSError:
                    pass  # the rank is gone
            os.close(f.life_fd)
            try:
                f.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                f.proc.kill()
                f.proc.wait()

    @property
    def follower_pids(self) -> list[int]:
        return [f.proc.pid for f in self._followers]
