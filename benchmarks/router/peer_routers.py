"""The peer routers (sglang-router, vllm-router: Rust, shipped in PyPI wheels)
and the instant mock backend they route to, as processes.

The peers live in their own environment, never the project's: a virtual
environment (--peers-venv DIR: DIR/bin/python) or a folder filled by
`pip install --target` (--peers-site DIR: this interpreter with DIR on
PYTHONPATH). Each is started with its Python launcher module, which runs the
Rust router inside that process, so the process's CPU time is the router's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.router.local_router import ROOT, project_env
from common.redis_server import free_port

MOCK_MODULE = "benchmarks.router.mock_openai_backend"


@dataclass(frozen=True)
class PeerKind:
    name: str          # also the distribution name on PyPI
    version: str       # the version measured; prepare-peers-carry.sh packs it
    module: str        # python -m MODULE launches the router
    log_level: str     # its spelling of "warnings only" (request logs cost CPU)


PEERS = (
    PeerKind("sglang-router", "0.3.2", "sglang_router.launch_router", "warn"),
    PeerKind("vllm-router", "0.1.17", "vllm_router.launch_router", "warning"),
)


@dataclass(frozen=True)
class PeerEnv:
    python: str
    pythonpath: str | None

    @staticmethod
    def from_args(venv: str | None, site: str | None) -> "PeerEnv":
        if site:
            return PeerEnv(sys.executable, str(Path(site).resolve()))
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no {python}: make the peers' environment once with\n"
                             f"  python3 -m venv {venv} && {venv}/bin/pip install "
                             + " ".join(f"{p.name}=={p.version}" for p in PEERS))
        return PeerEnv(str(python), None)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def version(self, dist: str) -> str | None:
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        out = subprocess.run([self.python, "-c", code], capture_output=True, text=True, env=self.env())
        return out.stdout.strip() or None


def start_mock(port: int, workers: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", MOCK_MODULE, "--port", str(port),
                             "--workers", str(workers)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=project_env())


def start_peer(kind: PeerKind, env: PeerEnv, port: int, backend_url: str, log) -> subprocess.Popen:
    """One worker, round robin (the cheapest policy: with one worker every
    policy picks it), health checks and retries left at their defaults."""
    cmd = [env.python, "-m", kind.module, "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", backend_url, "--policy", "round_robin", "--log-level", kind.log_level,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return subprocess.Popen(cmd, cwd="/tmp", stdout=log, stderr=subprocess.STDOUT, env=env.env())


def post_completion(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 10.0) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": False}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_chat(url: str, model: str, content: str, max_tokens: int, timeout: float = 10.0) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": False}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until_serving(url: str, proc: subprocess.Popen, model: str, prompt: str,
                       timeout: float = 60.0) -> dict:
    """Polls with a real completion until one comes back 200 (a router that
    answers /health may not have registered its worker yet)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            return post_completion(url, model, prompt, 1, timeout=5)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.3)
    raise RuntimeError(f"not serving after {timeout:.0f} s: {last}")


def check_completion(answer: dict, max_tokens: int) -> str | None:
    """What is wrong with a /v1/completions answer for max_tokens tokens, or None."""
    try:
        choice = answer["choices"][0]
        got = answer["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError):
        return f"not a completion: {str(answer)[:200]}"
    if got != max_tokens or not choice.get("text"):
        return f"asked for {max_tokens} tokens, got {got} ({choice.get('text', '')[:40]!r})"
    return None
