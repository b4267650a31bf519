"""A router and replica workers as real processes, for end-to-end tests."""

from __future__ import annotations

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
        self.router = Child("router", [
            "-m", "router", "--port", str(self.port), "--host", "127.0.0.1",
            "--redis-url", self.redis_url, "--policy", self.policy, "--model", self.model,
            "--lease-ttl", "3", "--heartbeat-interval", "0.5", *self.router_args,
        ], self.log_dir)
        wait_for_health(self.address, self.router, timeout=60)

    def start_replica(self, replica_id: str, *args: str, wait: bool = True,
                      router: str | None = None) -> Child:
        """router: the address it dials (default the router's; a fault proxy, say)."""
        child = Child(replica_id, [
            "-m", "replica_worker", "--router", router or self.address, "--model", self.model,
            "--replica-id", replica_id, "--threads", "1", *args,
        ], self.log_dir)
        self.replicas[replica_id] = child
        if wait:
            self.wait_registered(replica_id)
        return child

    def wait_registered(self, replica_id: str, timeout: float = 120) -> None:
        child = self.replicas[replica_id]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "registered with router" in child.tail(400):
                return
            if not child.alive():
                raise RuntimeError(f"{replica_id} exited:\n{child.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"{replica_id} did not register:\n{child.tail()}")

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
        for child in self.replicas.values():
            child.stop(timeout=10)
        if self.router is not None:
            self.router.stop(timeout=10)
