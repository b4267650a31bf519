"""Routers and replica workers as real processes, for end-to-end tests: one
router (LiveStack), or several sharing one Redis (RouterTier)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from common.redis_server import free_port
from stack.processes import Child, wait_for_health


class LiveStack:
    def __init__(self, log_dir: Path, redis_url: str, model: str, policy: str = "pull",
                 router_args: tuple[str, ...] = ()):
        self.log_dir = Path(log_dir)
        self.redis_url = redis_url
        self.model = model
        self.policy = policy
        self.port = free_port()
        self.router_args = list(router_args)
        self.router: Child | None = None
        self.replicas: dict[str, Child] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_router(self) -> None:
        self.router = self._router_child("router", self.port)
        wait_for_health(self.address, self.router, timeout=60)

    def _router_child(self, name: str, port: int) -> Child:
        """A router process, started; healthy once wait_for_health says so."""
        return Child(name, [
            "-m", "router", "--port", str(port), "--host", "127.0.0.1",
            "--redis-url", self.redis_url, "--policy", self.policy, "--model", self.model,
            "--lease-ttl", "3", "--heartbeat-interval", "0.5", *self.router_args,
        ], self.log_dir)

    def start_replica(self, replica_id: str, *args: str, wait: bool = True,
                      router: str | None = None) -> Child:
        """router: the address it dials (default the router's; a fault proxy, say).
        wait=False: started only; start several so, then wait_registered(*ids), and
        their start-ups (seconds of CPU each) overlap."""
        child = Child(replica_id, [
            "-m", "replica_worker", "--router", router or self.address, "--model", self.model,
            "--replica-id", replica_id, "--threads", "1", *args,
        ], self.log_dir)
        self.replicas[replica_id] = child
        if wait:
            self.wait_registered(replica_id)
        return child

    def wait_registered(self, *replica_ids: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for replica_id in replica_ids:
            child = self.replicas[replica_id]
            while "registered with router" not in child.tail(400):
                if not child.alive():
                    raise RuntimeError(f"{replica_id} exited:\n{child.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{replica_id} did not register:\n{child.tail()}")
                time.sleep(0.05)

    @contextlib.contextmanager
    def engines_paused(self, *replica_ids: str):
        """These replicas' engine processes stopped (SIGSTOP) inside the block:
        no token is made, while their workers stay connected and heartbeat.
        For a test whose point must come before the output is complete."""
        pids = [engine_pid(self.replicas[r]) for r in replica_ids]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def replica_failures(self) -> list[str]:
        """Replicas that exited, or logged a traceback: neither may happen in a fault test."""
        bad = []
        for name, child in self.replicas.items():
            if not child.alive():
                bad.append(f"{name} exited with {child.proc.returncode}")
            elif "Traceback" in child.log_path.read_text(errors="replace"):
                bad.append(f"{name} logged a traceback:\n{child.tail(40)}")
        return bad

    def stop(self) -> None:
        stop_together(list(self.replicas.values()), timeout=10)
        if self.router is not None:
            self.router.stop(timeout=10)


class RouterTier(LiveStack):
    """Several routers on one Redis and key prefix, each its own process and
    port; router i logs to router{i}.log. `router` is router 0."""

    def __init__(self, log_dir: Path, redis_url: str, model: str, count: int,
                 policy: str = "pull", router_args: tuple[str, ...] = ()):
        super().__init__(log_dir, redis_url, model, policy, router_args)
        self.ports = [self.port] + [free_port() for _ in range(count - 1)]
        self.routers: list[Child | None] = [None] * count

    def address_of(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def addresses(self, *order: int) -> list[str]:
        """The routers' addresses in this order (default: all, in index order)."""
        return [self.address_of(i) for i in (order or range(len(self.ports)))]

    def start_router(self, i: int | None = None) -> None:
        """Router i (again, after a kill), or every router not running (started
        together, then each waited for)."""
        started = []
        for k in ([i] if i is not None else range(len(self.ports))):
            if self.routers[k] is None or not self.routers[k].alive():
                self.routers[k] = self._router_child(f"router{k}", self.ports[k])
                started.append(k)
        for k in started:
            wait_for_health(self.address_of(k), self.routers[k], timeout=60)
        self.router = self.routers[0]

    def log_of(self, i: int) -> str:
        return (self.log_dir / f"router{i}.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_together(list(self.replicas.values()), timeout=10)
        stop_together([c for c in self.routers if c is not None], timeout=10)


def engine_pid(child: Child) -> int:
    """A replica's engine process (rank 0 under tensor parallelism; the
    worker's own process holds no rank)."""
    found = re.search(r"engine ready in process (\d+)", child.log_path.read_text(errors="replace"))
    assert found, f"no engine process in the replica's log:\n{child.tail()}"
    return int(found.group(1))


def stop_together(children: list[Child], timeout: float) -> None:
    """Child.stop for several at once: each gets SIGTERM before any is waited for,
    and every one that outlives the timeout is killed."""
    for child in children:
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        child.stop(timeout=0)   # kills it if still alive; closes its log
