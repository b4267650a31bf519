"""A Quadriga router under test, as separate processes: real Redis, the router,
and scripted replicas that answer at once (tests/support/scripted_replica.py).

    with LocalRouter(work_dir, replicas=2, http=True) as lr:
        lr.grpc_address, lr.http_port, lr.router.pid, lr.redis_url

Used by benchmarks/router/overhead.py (gRPC) and peers.py (OpenAI HTTP).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int) -> dict[str, float]:
    """Prometheus totals of every quadriga_* series, summed over labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(quadriga_\w+?)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


def cpu_seconds(pid: int) -> float:
    """user + sys CPU of one process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def project_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the project tree first on PYTHONPATH; a PYTHONPATH
    in `extra` goes before it (to shadow a package, say)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in ((extra or {}).get("PYTHONPATH"), str(ROOT),
                                                   os.environ.get("PYTHONPATH")) if p)
    return env


def start(cmd, log, env=None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=env or project_env())


def build_router_model(path: Path) -> Path:
    """A tiny model's tokenizer and config.json (no weights: the router reads no weights)."""
    from common.tiny_model import build_tokenizer_and_config

    build_tokenizer_and_config(path)
    return path


class LocalRouter:
    def __init__(self, work: Path, replicas: int = 2, http: bool = False, model_name: str = "",
                 router_args=(), router_env: dict[str, str] | None = None, capacity: int = 256,
                 router_tree: Path = ROOT):
        # router_tree: the checkout whose router runs (an older commit's, to compare); the
        # Redis server, model and scripted replicas always come from this tree
        self.work = Path(work)
        self.router_tree = Path(router_tree)
        self.replicas = replicas
        self.http = http
        self.model_name = model_name
        self.router_args = list(router_args)
        self.router_env = router_env or {}
        self.capacity = capacity
        self.procs: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self.redis = RedisServer(self.work / "redis")
        self.port, self.metrics_port = free_port(), free_port()
        self.http_port = free_port() if http else 0
        self.model = self.work / "model"
        self.log_path = self.work / "procs.log"
        self._log = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def replica_pids(self) -> list[int]:
        """The scripted replicas' processes: where a peer's mock backend stands."""
        return [proc.pid for proc in self.procs if proc is not self.router]

    @property
    def vocab(self) -> int:
        return json.loads((self.model / "config.json").read_text())["vocab_size"]

    def __enter__(self) -> "LocalRouter":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        build_router_model(self.model)
        self.redis.start()
        self._log = open(self.log_path, "w")
        py = sys.executable
        args = [py, "-m", "router", "--port", str(self.port), "--host", "127.0.0.1",
                "--redis-url", self.redis.url, "--model", str(self.model),
                "--metrics-port", str(self.metrics_port), "--queue-limit", "100000",
                "--log-level", "WARNING"]
        if self.http:
            args += ["--http-port", str(self.http_port)]
        if self.model_name:
            args += ["--model-name", self.model_name]
        env = project_env(self.router_env)
        if self.router_tree != ROOT:
            env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(ROOT), str(self.router_tree), 1)
        self.router = subprocess.Popen(args + self.router_args, cwd=self.router_tree, stdout=self._log,
                                       stderr=subprocess.STDOUT, env=env)
        self.procs.append(self.router)
        time.sleep(0.5)
        for i in range(self.replicas):
            self.procs.append(start([py, "-m", "tests.support.scripted_replica",
                                     "--router", self.grpc_address, "--id", f"bench{i}",
                                     "--vocab", str(self.vocab), "--capacity", str(self.capacity),
                                     "--reconnect"], self._log))
        self._wait_for_replicas()

    def _wait_for_replicas(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                if scrape(self.metrics_port).get("quadriga_replicas_connected", 0) >= self.replicas:
                    return
            except OSError:
                pass
            if any(proc.poll() is not None for proc in self.procs):
                raise SystemExit(f"a process exited early ({[q.poll() for q in self.procs]}); "
                                 f"see {self.log_path}")
            if time.time() > deadline:
                raise SystemExit(f"router/replicas did not come up; see {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs.clear()
        self.redis.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
