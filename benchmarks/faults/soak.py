"""A long run at 70% of capacity, with a replica and the router each killed and
restarted once along the way, watching for anything that grows.

The stack is the fault benchmark's (benchmarks/faults/run.py): Redis with an
append-only file, the router, 2 CPU replicas with real engines on a tiny
model. Load: Poisson arrivals of greedy requests (prompts of 16 to 96 token
ids, 16 to 64 output tokens). First the capacity is found (the highest rate
whose requests all complete with p99 TTFT under 2 s over a 30 s probe, rates
growing by 1.25x), then the soak runs at 70% of it. Once a minute arrivals
pause until nothing is in flight, and the run records: router and replica
RSS, the replicas' KV cache in use (vllm:kv_cache_usage_perc; 0 when idle
unless blocks leak), Redis's in-flight and live set sizes, its key count and
memory. At a third of the way the replica r0 is SIGKILLed and restarted; at
two thirds the router.

    .venv/bin/python -m benchmarks.faults.soak                # 30 minutes; benchmarks/results/soak.json + .png
    .venv/bin/python -m benchmarks.faults.soak --minutes 3    # a short check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import rss_mb, tree_commit  # noqa: E402
from benchmarks.faults.run import FaultStack  # noqa: E402
from common.redis_server import free_port  # noqa: E402
from common.tiny_model import build_tiny_model  # noqa: E402
from common.tokenizer import vocab_size  # noqa: E402


def child_pids(pid: int) -> list[int]:
    """The processes this one started (a replica worker's engine process)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def gauge(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values) if values else float("nan")


class Load:
    """Poisson arrivals of greedy requests against the router, with pause()."""

    def __init__(self, address: str, vocab: int, seed: int = 0, tag: str = "soak"):
        # tag: request ids are tag-n; each Load needs its own, or a later one would
        # re-attach to an earlier one's finished results
        self.address, self.vocab, self.tag = address, vocab, tag
        self.rng = random.Random(seed)
        self.running = asyncio.Event()
        self.running.set()
        self.inflight = 0
        self.done: list[tuple[float, float, bool]] = []   # (start, ttft or nan, completed)
        self.failed = 0

    async def one(self, stub, n: int) -> None:
        import grpc

        from common.pb.quadriga.v1 import generation_pb2 as gpb

        req = gpb.GenerateRequest(
            request_id=f"{self.tag}-{n}",
            prompt_token_ids=[self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(16, 96))],
            sampling=gpb.SamplingParams(max_tokens=self.rng.randint(16, 64), temperature=0.0,
                                        ignore_eos=True))
        start, ttft, finished = time.monotonic(), float("nan"), False
        try:
            for _ in range(100):  # re-attach by request_id across the router's restart
                try:
                    async for msg in stub.Generate(req, timeout=120):
                        if msg.token_ids and ttft != ttft:
                            ttft = time.monotonic() - start
                        if msg.HasField("finish_reason"):
                            finished = msg.finish_reason == gpb.FINISH_REASON_LENGTH
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.3)
        finally:
            self.inflight -= 1
            self.done.append((start, ttft, finished))
            self.failed += not finished

    async def drive(self, rate: float, seconds: float) -> None:
        import grpc

        from common.pb.quadriga.v1 import generation_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            tasks, n, end = set(), len(self.done) + self.inflight, time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(self.rng.expovariate(rate))
                await self.running.wait()  # after the gap: nothing may start once paused
                n += 1
                self.inflight += 1  # counted before the task first runs, so drained() sees it
                t = asyncio.create_task(self.one(stub, n))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)

    async def drained(self, timeout: float = 60) -> bool:
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.1)
        return self.inflight == 0


async def probe(stack: FaultStack, vocab: int, rate: float, seconds: float) -> dict:
    load = Load(stack.address, vocab, seed=int(rate * 1000), tag=f"probe-{rate:g}")
    await load.drive(rate, seconds)
    ttfts = [t for _, t, ok in load.done if ok]
    return {"rate": rate, "requests": len(load.done), "failed": load.failed,
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else float("inf")}


async def find_capacity(stack: FaultStack, vocab: int, start: float, seconds: float) -> tuple[float, list]:
    """The highest rate that passes: up from `start` by 1.25x until one fails,
    or, when `start` itself fails, down by as much until one passes."""
    probes, rate, best, going_up = [], start, 0.0, None
    while rate >= 1.0:
        p = await probe(stack, vocab, rate, seconds)
        probes.append(p)
        print(json.dumps(p), flush=True)
        passed = not p["failed"] and p["ttft_p99_s"] <= 2.0
        going_up = passed if going_up is None else going_up
        if passed:
            best = rate
        if passed != going_up:
            return best, probes
        rate = rate * 1.25 if going_up else rate / 1.25
    return best, probes


class Watch:
    def __init__(self, stack: FaultStack, metrics: dict[str, int], router_metrics: int):
        self.stack, self.metrics, self.router_metrics = stack, metrics, router_metrics
        import redis

        self.redis = redis.Redis.from_url(stack.redis.url)

    def sample(self, minute: int, load: Load) -> dict:
        st = self.stack.stack
        prefix = "quadriga:"
        row = {"minute": minute, "router_rss_mb": round(rss_mb(st.router.proc.pid), 1),
               "requests_done": len(load.done), "requests_failed": load.failed}
        for rid, child in st.replicas.items():
            row[f"{rid}_rss_mb"] = round(rss_mb(child.proc.pid), 1)
            # The engine runs in a process of its own: the model, the KV cache.
            row[f"{rid}_engine_rss_mb"] = round(sum(map(rss_mb, child_pids(child.proc.pid))), 1)
            row[f"{rid}_kv_in_use_when_idle"] = gauge(
                f"http://127.0.0.1:{self.metrics[rid]}/metrics", "vllm:kv_cache_usage_perc")
        inflight = [m.decode() for m in self.redis.zrange(prefix + "inflight", 0, 9)]
        if inflight:  # which requests, and what their records say, so a leak can be followed
            row["inflight_ids"] = {rid: {k.decode(): v.decode(errors="replace")[:40] for k, v in
                                         self.redis.hgetall(prefix + "req:" + rid).items()
                                         if k in (b"st", b"o", b"n", b"rq", b"fin", b"fr")}
                                   for rid in inflight}
        row["redis_inflight"] = self.redis.zcard(prefix + "inflight")
        row["redis_live"] = self.redis.scard(prefix + "live")
        row["redis_keys"] = self.redis.dbsize()
        row["redis_used_memory_mb"] = round(self.redis.info("memory")["used_memory"] / 2 ** 20, 2)
        row["router_queue_depth"] = gauge(f"http://127.0.0.1:{self.router_metrics}/metrics",
                                          "quadriga_queue_depth")
        return row


async def soak(stack: FaultStack, watch: Watch, vocab: int, rate: float, minutes: int) -> list:
    load = Load(stack.address, vocab, seed=7)
    rows = []
    driver = asyncio.create_task(load.drive(rate, minutes * 60))
    for minute in range(1, minutes + 1):
        await asyncio.sleep(60)
        load.running.clear()
        idle = await load.drained()
        await asyncio.sleep(1.0)  # the replicas' metrics see the last step
        row = watch.sample(minute, load)
        row["idle"] = idle
        if minute == minutes // 3:
            await stack.apply("replica_sigkill")
            row["event"] = "replica r0 SIGKILLed and restarted"
        elif minute == 2 * minutes // 3:
            await stack.apply("router_sigkill")
            row["event"] = "router SIGKILLed and restarted"
        rows.append(row)
        print(json.dumps(row), flush=True)
        load.running.set()
    load.running.set()
    await driver
    return rows


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["minute"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key in [k for k in rows[0] if k.endswith("_rss_mb")]:
        axes[0].plot(minutes, [r[key] for r in rows], label=key[:-7])
    axes[0].set_title("RSS (MB)")
    for key in ("redis_inflight", "redis_live", "router_queue_depth"):
        axes[1].plot(minutes, [r[key] for r in rows], label=key)
    for key in [k for k in rows[0] if k.endswith("kv_in_use_when_idle")]:
        axes[1].plot(minutes, [r[key] for r in rows], label=key)
    axes[1].set_title("left over when idle (should stay 0)")
    axes[2].plot(minutes, [r["redis_keys"] for r in rows], label="redis keys")
    axes[2].set_title("Redis keys (finished results expire after result_ttl)")
    for ax in axes:
        ax.set_xlabel("minute")
        ax.legend(fontsize=7)
        for r in rows:
            if "event" in r:
                ax.axvline(r["minute"], color="grey", ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=int, default=30)
    p.add_argument("--rate", type=float, help="skip the capacity search: soak at this rate")
    p.add_argument("--probe-seconds", type=float, default=30)
    p.add_argument("--start-rate", type=float, default=4.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="quadriga-soak-"))
    model = str(build_tiny_model(work / "model"))
    vocab = vocab_size(model)
    metrics = {"r0": free_port(), "r1": free_port()}
    router_metrics = free_port()
    stack = FaultStack(work, model, lease_ttl=5.0, seats=16,
                       replica_args={rid: ("--metrics-port", str(port)) for rid, port in metrics.items()},
                       router_args=("--metrics-port", str(router_metrics)))
    try:
        probes = []
        capacity = args.rate / 0.7 if args.rate else None
        if capacity is None:
            capacity, probes = asyncio.run(find_capacity(stack, vocab, args.start_rate, args.probe_seconds))
        rate = 0.7 * capacity
        print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {args.minutes} min", flush=True)
        rows = asyncio.run(soak(stack, Watch(stack, metrics, router_metrics), vocab, rate, args.minutes))
    finally:
        stack.stop()
    first, last = rows[0], rows[-1]
    result = {
        "command": " ".join(["python", "-m", "benchmarks.faults.soak", *map(shlex.quote, sys.argv[1:])]),
        "commit": tree_commit(),
        "setup": "Redis (AOF), router, 2 CPU replicas (tiny model, 16 seats, 1 torch thread each) "
                 "behind a TCP proxy, 2 shared cores; prompts 16-96 ids, 16-64 greedy output tokens",
        "capacity_rps": capacity, "soak_rps": rate, "capacity_probes": probes,
        "per_minute": rows,
        "growth_first_to_last": {k: (last[k] - first[k]) for k in first
                                 if isinstance(first[k], (int, float)) and k != "minute"},
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print("wrote", out, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
