"""Routers and replica workers as real processes, for end-to-end tests: one
router (LiveStack), or several sharing one Redis (RouterTier)."""

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
        self.router = self._router_child("router", self.port)

    def _router_child(self, name: str, port: int) -> Child:
        child = Child(name, [
            "-m", "router", "--port", str(port), "--host", "127.0.0.1",
            "--redis-url", self.redis_url, "--policy", self.policy, "--model", self.model,
            "--lease-ttl", "3", "--heartbeat-interval", "0.5", *self.router_args,
        ], self.log_dir)
        wait_for_health(f"127.0.0.1:{port}", child, timeout=60)
        return child

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
        """Router i (again, after a kill), or every router not running."""
        for k in ([i] if i is not None else range(len(self.ports))):
            if self.routers[k] is None or not self.routers[k].alive():
                self.routers[k] = self._router_child(f"router{k}", self.ports[k])
        self.router = self.routers[0]

    def log_of(self, i: int) -> str:
        return (self.log_dir / f"router{i}.log").read_text(errors="replace")

    def stop(self) -> None:
        for child in self.replicas.values():
            child.stop(timeout=10)
        for child in self.routers:
            if child is not None:
                child.stop(timeout=10)
