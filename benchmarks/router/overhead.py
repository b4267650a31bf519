"""Router overhead: latency the router adds and the request rate it sustains.

Scripted replicas that answer at once (1 output token, zero step delay) run in
their own processes, as does the router, so the router's event loop is
measured on its own. Offered load is Poisson at several rates.

    .venv/bin/python -m benchmarks.router.overhead            # writes benchmarks/results/router_overhead.json
    .venv/bin/python -m benchmarks.router.overhead --rates 100 500 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.pb.quadriga.v1 import generation_pb2 as gpb  # noqa: E402
from common.pb.quadriga.v1 import generation_pb2_grpc  # noqa: E402
from common.tiny_model import build_tiny_model  # noqa: E402

try:
    from common.redis_server import RedisServer  # noqa: E402
except ImportError:
    from tests.support.redis_server import RedisServer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(quadriga_\w+?)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


def redis_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


async def one(stub, vocab, latencies, router_e2e, failures):
    req = gpb.GenerateRequest(prompt_token_ids=[random.randrange(vocab) for _ in range(16)],
                              sampling=gpb.SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    try:
        last = None
        async for msg in stub.Generate(req, timeout=30):
            last = msg
        latencies.append(time.perf_counter() - t0)
        router_e2e.append(last.timings.end_to_end_s)
    except grpc.aio.AioRpcError as exc:
        failures.append(exc.code().name)


async def offered_load(address, rate, duration, vocab):
    latencies, router_e2e, failures, tasks = [], [], [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await one(stub, vocab, [], [], [])  # warm the channel
        start = time.perf_counter()
        next_at = start
        while next_at - start < duration:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(stub, vocab, latencies, router_e2e, failures)))
            next_at += random.expovariate(rate)
        sent_for = time.perf_counter() - start
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return dict(offered_rps=rate, sent=len(tasks), completed=len(latencies),
                failures=len(failures), achieved_rps=len(latencies) / elapsed, send_window_s=sent_for,
                client_e2e_p50_ms=pct(latencies, 0.5) * 1e3, client_e2e_p99_ms=pct(latencies, 0.99) * 1e3,
                router_e2e_p50_ms=pct(router_e2e, 0.5) * 1e3, router_e2e_p99_ms=pct(router_e2e, 0.99) * 1e3)


def run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def start(cmd, log):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[100, 250, 500, 750, 1000])
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_overhead.json"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    model = build_tiny_model(work / "model")
    redis_srv = RedisServer(work / "redis")
    redis_srv.start()
    port, mport = free_port(), free_port()
    log = open(work / "procs.log", "w")
    py = sys.executable
    procs = [start([py, "-m", "router", "--port", str(port), "--host", "127.0.0.1",
                    "--redis-url", redis_srv.url, "--model", str(model), "--metrics-port", str(mport),
                    "--heartbeat-interval", "0.5", "--queue-limit", "100000",
                    "--log-level", "WARNING"], log)]
    address = f"127.0.0.1:{port}"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    try:
        time.sleep(0.5)
        for i in range(args.replicas):
            procs.append(start([py, "-m", "tests.support.scripted_replica", "--router", address,
                                "--id", f"bench{i}", "--vocab", str(vocab), "--capacity", "256",
                                "--reconnect"], log))
        deadline = time.time() + 60
        while True:
            try:
                if scrape(mport).get("quadriga_replicas_connected", 0) >= args.replicas:
                    break
            except OSError:
                pass
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"a process exited early ({[q.poll() for q in procs]}); see {work}/procs.log")
            if time.time() > deadline:
                raise SystemExit(f"router/replicas did not come up; see {work}/procs.log")
            time.sleep(0.2)
        r = redis.Redis.from_url(redis_srv.url)
        rows = []
        for rate in args.rates:
            before, calls_before = scrape(mport), redis_calls(r)
            t0 = time.perf_counter()
            row = run_loop(offered_load(address, rate, args.duration, vocab))
            wall = time.perf_counter() - t0
            time.sleep(1.1)  # let the router publish its round-trip counter
            after, calls_after = scrape(mport), redis_calls(r)
            n = max(1, row["completed"] + 1)
            msgs = sum(after.get(k, 0) - before.get(k, 0) for k in (
                "quadriga_messages_in_total", "quadriga_messages_out_total",
                "quadriga_client_messages_total"))
            row.update(messages_per_s=msgs / wall,
                       redis_commands_per_request=(calls_after - calls_before) / n,
                       redis_round_trips_per_request=(after.get("quadriga_redis_round_trips_total", 0)
                                                      - before.get("quadriga_redis_round_trips_total", 0)) / n)
            rows.append(row)
            print(f"offered {rate:6.0f}/s  achieved {row['achieved_rps']:7.1f}/s  "
                  f"client e2e p50 {row['client_e2e_p50_ms']:6.2f} ms p99 {row['client_e2e_p99_ms']:7.2f} ms  "
                  f"router p50 {row['router_e2e_p50_ms']:6.2f} ms p99 {row['router_e2e_p99_ms']:7.2f} ms  "
                  f"msgs/s {row['messages_per_s']:7.0f}  redis rt/req {row['redis_round_trips_per_request']:.2f}  "
                  f"cmds/req {row['redis_commands_per_request']:.1f}  fail {row['failures']}", flush=True)
        result = {
            "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m",
                                                          "benchmarks.router.overhead", *sys.argv[1:]]),
            "machine": f"{os.cpu_count()} cores; router, {args.replicas} scripted replicas, Redis and the "
                       "client share them",
            "workload": "16-token prompts, 1 output token, replicas answer at once; Poisson arrivals",
            "definitions": {
                "client_e2e": "client send to last message (includes client gRPC, both hops, replica)",
                "router_e2e": "router accepted to finished (RequestTimings.end_to_end_s)",
                "redis_round_trips_per_request": "router's own count (Lua calls and pipelines)",
            },
            "duration_s": args.duration,
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        redis_srv.stop()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
