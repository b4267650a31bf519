"""Child processes of the local stack, started and stopped in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


class Child:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.env = env or {}
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM without waiting (replicas drain on it): several children stop at once."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (replicas drain on it), then SIGKILL after timeout."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_for_health(address: str, child: Child, timeout: float) -> None:
    """Until the router's gRPC health service answers SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{child.name} not healthy after {timeout:.0f} s:\n{child.tail()}")
