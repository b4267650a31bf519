"""How long replica workers take to start (launch -> registered with the router) and
to stop (SIGTERM -> exited), this tree beside another, in one run.

    python -m benchmarks.engine.replica_start --compare before=TREE [--replicas 2 --repeats 3]

For each side in turn (alternating, --repeats times): a router of that tree on a
Redis of its own, then --replicas CPU replica workers of that tree launched
together on a tiny random-weight model, as the local stack and the end-to-end
tests start them. Their start-ups share the machine's cores, which is what a
2-core machine's tests pay. Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, save_result, tree_commit
from common.redis_server import RedisServer, free_port

_REGISTERED = "registered with router"


def _launch(tree: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, *args], cwd=tree, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log.name}: no {text!r}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.02)


def run_side(tree: Path, model: str, replicas: int, work: Path) -> dict:
    redis = RedisServer(work / "redis")
    redis.start()
    port = free_port()
    router = _launch(tree, work / "router.log", "-m", "router", "--port", str(port), "--host", "127.0.0.1",
                     "--redis-url", redis.url, "--policy", "pull", "--model", model)
    procs: list[subprocess.Popen] = []
    try:
        _wait_for(work / "router.log", "router listening", router, timeout=120)
        start = time.monotonic()
        logs = [work / f"replica{i}.log" for i in range(replicas)]
        procs = [_launch(tree, log, "-m", "replica_worker", "--router", f"127.0.0.1:{port}", "--model", model,
                         "--replica-id", f"r{i}", "--threads", "1") for i, log in enumerate(logs)]
        registered = []
        for log, proc in zip(logs, procs):
            _wait_for(log, _REGISTERED, proc)
            registered.append(time.monotonic() - start)
        stop_start = time.monotonic()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        return {"registered_s": registered, "all_registered_s": max(registered),
                "stopped_s": time.monotonic() - stop_start}
    finally:
        for proc in [*procs, router]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        redis.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", required=True, metavar="NAME=TREE", help="the other side: a tree (git archive copy)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="replica_start_cpu")
    a = p.parse_args(argv)
    from common.tiny_model import build_tiny_model

    model = str(build_tiny_model(Path(tempfile.gettempdir()) / "quadriga-replica-start-tiny"))
    name, _, tree = a.compare.partition("=")
    sides = {"this": ROOT, name: Path(tree).resolve()}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(a.repeats):
        for side, path in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            with tempfile.TemporaryDirectory(prefix="quadriga-replica-start-") as work:
                row = run_side(path, model, a.replicas, Path(work))
            runs[side].append(row)
            print(f"{side:<8} registered {', '.join(f'{t:.2f}' for t in row['registered_s'])} s  "
                  f"stopped {row['stopped_s']:.2f} s", flush=True)
    save_result(a.name, {
        "what": __doc__.strip().splitlines()[0],
        "setup": {"replicas": a.replicas, "model": "tiny random Llama (common/tiny_model.py), CPU, 1 thread each",
                  "cpus": os.cpu_count()},
        "commits": {side: tree_commit(path) for side, path in sides.items()},
        "runs": runs,
    })


if __name__ == "__main__":
    main()
