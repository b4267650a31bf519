"""Starts `python -m stack` as a child process for a run and stops it after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


class Stack:
    def __init__(self, *, replicas: int = 2, policy: str = "pull", model: str | None = None,
                 replica_args: list[str] | None = None, device: str = "cpu", scheduler: str | None = None,
                 extra_args: list[str] | None = None, log_dir: str | None = None, ready_timeout: float = 600,
                 router_args: list[str] | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        self.replica_metrics_port = free_port(count=replicas)   # replica i: this + i
        self.replicas = replicas
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="quadriga-bench-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.args = ["-m", "stack", "--replicas", str(replicas), "--policy", policy,
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--http-port", "0",   # load goes over gRPC; stacks side by side need no port
                     "--device", device, "--log-dir", str(self.log_dir),
                     "--replica-metrics-port", str(self.replica_metrics_port)]
        if model:
            self.args += ["--model", model]
        if scheduler:
            self.args += ["--scheduler", scheduler]
        for a in replica_args or []:
            self.args.append(f"--replica-arg={a}")
        for a in router_args or []:
            self.args.append(f"--router-arg={a}")
        self.args += extra_args or []
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.out_path = self.log_dir / "stack.out"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def replica_metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.replica_metrics_port + i}/metrics" for i in range(self.replicas)]

    @property
    def command(self) -> str:
        return " ".join(["python", *self.args])

    def _out(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> "Stack":
        out = open(self.out_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, *self.args], cwd=ROOT, stdout=out,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if "\nready: " in self._out():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"stack exited ({self.proc.returncode}):\n{self._out()[-3000:]}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"stack not ready after {self.ready_timeout:.0f} s:\n{self._out()[-3000:]}")

    def stop(self, timeout: float = 20) -> None:
        """SIGINT (the stack drains replicas, then stops router and Redis); after `timeout`
        the whole process group is killed: the measurement is over by then, and an idle
        replica's drain currently waits out its full drain timeout (30 s) before exiting."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
