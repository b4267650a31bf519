"""Router overhead: latency the router adds and the request rate it sustains.

Everything runs as separate processes: Redis, the router, scripted replicas
that answer at once (1 output token, zero step delay) and a load generator
(one gRPC channel, requests built before the clock starts, Poisson arrivals
scheduled in advance). The router's event loop is what saturates.

    .venv/bin/python -m benchmarks.router.overhead            # writes benchmarks/results/router_overhead.json
    .venv/bin/python -m benchmarks.router.overhead --rates 100 500 --duration 5
    .venv/bin/python -m benchmarks.router.overhead --rates 500 --profile out.txt   # py-spy on the router
    .venv/bin/python -m benchmarks.router.overhead --compare .baseline --paired 0-6:8-14 --repeats 4   # both at once

Definitions (also written into the JSON):
  router_added   router accepted -> finished (RequestTimings.end_to_end_s) with a
                 replica that takes no time: the router's own work, both Redis
                 writes and the Assign/StepOutputs hop. This is "the latency the
                 router adds"; it is an upper bound (the replica's gRPC handling
                 on the same cores is in it).
  client_e2e     client send -> last message: adds the client's gRPC stack and the
                 client hop; an upper bound on what a user sees the router add.
  router_cpu_ms_per_request   router process CPU (user+sys) / completed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import percentile, tree_commit
from benchmarks.router.local_router import LocalRouter, cpu_seconds, project_env, scrape  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFINITIONS = {
    "router_added": "router accepted -> finished (RequestTimings.end_to_end_s) with a zero-time "
                    "replica: router work, its Redis round trips and the Assign/StepOutputs hop; "
                    "the latency the router adds (upper bound: the replica's gRPC handling is in it)",
    "router_queue": "router accepted -> assigned (RequestTimings.queue_time_s)",
    "client_e2e": "client send -> last message: adds the client's gRPC stack and the client hop",
    "achieved_rps": "completed requests / (first send -> last completion)",
    "router_cpu_ms_per_request": "router process user+sys CPU during the rate / completed requests",
    "messages_per_s": "gRPC messages the router received and sent per second: client requests in, "
                      "client responses out, replica messages in (step, pull, heartbeat) and out (assign)",
    "redis_round_trips_per_request": "router's own count (Lua calls and pipelines) / completed",
    "redis_commands_per_request": "Redis-side work: INFO commandstats calls delta / completed (counts the EVALSHA and every command its script runs)",
    "redis_cpu_ms_per_request": "the Redis server's user+sys CPU during the rate / completed "
                                "(its scripts run on every round trip's critical path)",
    "redis_script_calls_per_request": "EVALSHA calls / completed (each runs the fence once)",
    "redis_command_mix_per_request": "redis_commands_per_request by command name (INFO commandstats)",
}


def pct(values, q):
    """q in [0, 1]: numpy's interpolated percentile, as the harness's; nan for none.
    (Until 2026-12-07 the value at rank int(q * n), one rank high: the committed
    figures of earlier trees read slightly worse than this gives.)"""
    value = percentile(values, q * 100)
    return float("nan") if value is None else value



def redis_calls(r) -> tuple[int, int, dict]:
    """Commands Redis ran (a script's own commands included), script calls, and
    the calls of each command by name."""
    stats = r.info("commandstats")
    by_name = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()
               if k != "cmdstat_info"}
    total = sum(by_name.values())
    scripts = by_name.get("evalsha", 0) + by_name.get("eval", 0)
    return total, scripts, by_name


def redis_cpu_seconds(r) -> float:
    """The Redis server's own CPU (user+sys) so far: the scripts' cost on every round trip."""
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])



# ---- load generator (runs in its own process: --client) ----

async def _client(address: str, rate: float, duration: float, vocab: int, seed: int,
                  output_tokens: int, client_ids: bool = False) -> dict:
    import grpc

    from common.pb.quadriga.v1 import generation_pb2 as gpb
    from common.pb.quadriga.v1 import generation_pb2_grpc

    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        times.append(t)
    reqs = [gpb.GenerateRequest(prompt_token_ids=[rng.randrange(vocab) for _ in range(16)],
                                sampling=gpb.SamplingParams(max_tokens=output_tokens))
            for _ in times]
    warm = gpb.GenerateRequest()
    warm.CopyFrom(reqs[0])
    if client_ids:   # as client.FailoverStream names every request it sends
        for req in [warm, *reqs]:
            req.request_id = uuid.uuid4().hex
    lat, e2e, queue, fails = [], [], [], []
    done_at = [0.0]

    async def one(call_fn, req):
        t0 = time.perf_counter()
        try:
            last = None
            async for msg in call_fn(req, timeout=30):
                last = msg
            now = time.perf_counter()
            lat.append(now - t0)
            done_at[0] = max(done_at[0], now)
            e2e.append(last.timings.end_to_end_s)
            queue.append(last.timings.queue_time_s)
        except grpc.aio.AioRpcError as exc:
            fails.append(exc.code().name)

    async with grpc.aio.insecure_channel(address) as channel:
        call_fn = generation_pb2_grpc.GenerationStub(channel).Generate
        await one(call_fn, warm)  # warm the channel
        lat.clear(); e2e.clear(); queue.clear()
        loop = asyncio.get_running_loop()
        tasks = []
        start = time.perf_counter()
        for at, req in zip(times, reqs):
            delay = start + at - time.perf_counter()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(call_fn, req)))
        sent_for = time.perf_counter() - start
        await asyncio.gather(*tasks)
    elapsed = (done_at[0] or time.perf_counter()) - start
    ms = 1e3
    return dict(offered_rps=rate, output_tokens=output_tokens, sent=len(tasks), completed=len(lat), failures=len(fails),
                failure_codes=sorted(set(fails)), achieved_rps=len(lat) / elapsed,
                send_window_s=sent_for,
                router_added_p50_ms=pct(e2e, 0.5) * ms, router_added_p90_ms=pct(e2e, 0.9) * ms,
                router_added_p99_ms=pct(e2e, 0.99) * ms,
                router_queue_p50_ms=pct(queue, 0.5) * ms, router_queue_p99_ms=pct(queue, 0.99) * ms,
                client_e2e_p50_ms=pct(lat, 0.5) * ms, client_e2e_p99_ms=pct(lat, 0.99) * ms)


def client_main(args) -> int:
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    row = run(_client(args.client, args.rate, args.duration, args.vocab, args.seed,
                      args.output_tokens[0], args.client_ids))
    print(json.dumps(row))
    return 0


# ---- orchestration ----


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[100, 250, 500, 750, 1000])
    p.add_argument("--output-tokens", type=int, nargs="+", default=[1, 64],
                   help="output lengths to measure (the per-token path is what real load stresses)")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--compare", action="append", default=[], metavar="[NAME=]TREE",
                   help="also run the router of another checkout, side by side in this run "
                        "(ABAB, --repeats times each), e.g. a git worktree of an older commit; "
                        "repeatable (unnamed: 'baseline')")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="also run this tree's router with extra arguments, side by side, "
                        "e.g. window1='--redis-max-in-flight 1' (repeatable)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--client-ids", action="store_true",
                   help="every request carries an id of the client's (as client.FailoverStream "
                        "sends), not one the router makes")
    p.add_argument("--paired", metavar="CPUS:CPUS",
                   help="with exactly two sides: run them at the same time, each with its own "
                        "Redis, replicas and load generator pinned to one CPU set (e.g. 0-6:8-14), "
                        "the sets swapped every repeat; the host's drift between runs then "
                        "falls on both sides alike")
    p.add_argument("--only", help=argparse.SUPPRESS)   # internal: run this one side
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_overhead.json"))
    p.add_argument("--profile", help="py-spy record the router during each rate into this "
                                     "file (collapsed stacks; one file per rate)")
    p.add_argument("--native", action="store_true", help="with --profile: C frames too (gRPC core)")
    p.add_argument("--profile-hz", type=int, default=200, help="with --profile: samples a second")
    p.add_argument("--client", help=argparse.SUPPRESS)   # internal: run the load generator
    p.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def warm_up(address: str) -> None:
    """One text prompt, so whatever the router loads lazily (its tokenizer) is loaded
    before anything is measured."""
    import grpc

    from common.pb.quadriga.v1 import generation_pb2 as gpb
    from common.pb.quadriga.v1 import generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = gpb.GenerateRequest(prompt="warm up", sampling=gpb.SamplingParams(max_tokens=1))
        for _ in stub.Generate(req, timeout=120):
            pass


def measure(args, router, address: str, mport: int, r, vocab: int, rate: float,
            output_tokens: int, profile: str | None) -> dict:
    py = sys.executable
    time.sleep(1.1)  # the router publishes its round-trip counter each heartbeat
    before, calls_before, cpu_before = scrape(mport), redis_calls(r), cpu_seconds(router.pid)
    redis_cpu_before = redis_cpu_seconds(r)
    spy = None
    if profile:
        from benchmarks.router.peers import find_py_spy

        # --native must stop the router at every sample (it then sustains a tenth
        # of the rate); without it py-spy reads the stacks without stopping it.
        mode = ["--native"] if args.native else ["--nonblocking"]
        spy = subprocess.Popen([find_py_spy(), "record", "-p", str(router.pid),
                                "-r", str(args.profile_hz), "-f", "raw", "-o", profile, "-d",
                                str(int(args.duration + 2)), "--threads", *mode],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.perf_counter()
    out = subprocess.run([py, "-m", "benchmarks.router.overhead", "--client", address,
                          "--rate", str(rate), "--duration", str(args.duration),
                          "--vocab", str(vocab), "--output-tokens", str(output_tokens),
                          *(["--client-ids"] if args.client_ids else [])],
                         cwd=ROOT, capture_output=True, text=True, env=project_env())
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"load generator failed:\n{out.stderr}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = cpu_seconds(router.pid) - cpu_before
    redis_cpu = redis_cpu_seconds(r) - redis_cpu_before
    time.sleep(1.1)
    after, calls_after = scrape(mport), redis_calls(r)
    if spy is not None:
        spy.wait()
    n = max(1, row["completed"] + 1)

    def delta(*names):
        return sum(after.get(k, 0) - before.get(k, 0) for k in names)

    # +1 request: the load generator's warm-up call
    msgs_in = delta("quadriga_messages_in_total") + n
    msgs_out = delta("quadriga_messages_out_total", "quadriga_client_messages_total")
    row.update(router_cpu_ms_per_request=cpu / n * 1e3, router_cpu_util=cpu / wall,
               messages_in_per_s=msgs_in / wall, messages_out_per_s=msgs_out / wall,
               messages_per_s=(msgs_in + msgs_out) / wall,
               redis_cpu_ms_per_request=redis_cpu / n * 1e3,
               redis_commands_per_request=(calls_after[0] - calls_before[0]) / n,
               redis_script_calls_per_request=(calls_after[1] - calls_before[1]) / n,
               redis_round_trips_per_request=delta("quadriga_redis_round_trips_total") / n,
               redis_command_mix_per_request={
                   name: round((calls - calls_before[2].get(name, 0)) / n, 2)
                   for name, calls in sorted(calls_after[2].items())
                   if calls > calls_before[2].get(name, 0)})
    return row


def run_side(args, work: Path, name: str, tree: Path, extra: list[str]) -> list[dict]:
    import redis

    rows = []
    with LocalRouter(work, replicas=args.replicas,
                     router_args=["--heartbeat-interval", "0.5", *extra], router_tree=tree) as lr:
        warm_up(lr.grpc_address)
        r = redis.Redis.from_url(lr.redis_url)
        for output_tokens in args.output_tokens:
            for rate in args.rates:
                profile = f"{args.profile}.{name}.{output_tokens}.{int(rate)}" if args.profile else None
                row = measure(args, lr.router, lr.grpc_address, lr.metrics_port, r, lr.vocab, rate,
                              output_tokens, profile)
                row["router"] = name
                rows.append(row)
                print(f"{name:9s} out {output_tokens:3d}  offered {rate:5.0f}/s achieved "
                      f"{row['achieved_rps']:6.1f}/s  added p50 {row['router_added_p50_ms']:6.2f} "
                      f"p99 {row['router_added_p99_ms']:7.2f} ms  client p50 {row['client_e2e_p50_ms']:7.2f} "
                      f"ms  cpu/req {row['router_cpu_ms_per_request']:.2f} ms "
                      f"({row['router_cpu_util']:.0%})  msgs/s {row['messages_per_s']:5.0f}  "
                      f"rt/req {row['redis_round_trips_per_request']:.2f}  "
                      f"cmds/req {row['redis_commands_per_request']:.1f}  "
                      f"redis cpu/req {row['redis_cpu_ms_per_request'] * 1e3:.0f} us  "
                      f"scripts/req {row['redis_script_calls_per_request']:.2f}  fail {row['failures']}", flush=True)
    return rows


def parse_cpus(text: str) -> set[int]:
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def child_args(argv: list[str]) -> list[str]:
    """A paired run's arguments less those the parent keeps (--paired,
    --repeats, --out), for each side's own run."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--paired", "--repeats", "--out"):
            skip = True
        elif not a.startswith(("--paired=", "--repeats=", "--out=")):
            kept.append(a)
    return kept


def run_paired(args, argv: list[str], work: Path, names: list[str]) -> list[dict]:
    """Both sides at once, one child run each (this script with --only), pinned
    to disjoint CPU sets that swap every repeat; every process a child starts
    inherits its CPU set."""
    if len(names) != 2:
        raise SystemExit(f"--paired needs exactly two sides, not {names}")
    cpu_sets = [parse_cpus(part) for part in args.paired.split(":")]
    if len(cpu_sets) != 2 or cpu_sets[0] & cpu_sets[1]:
        raise SystemExit("--paired takes two disjoint CPU sets, e.g. 0-6:8-14")
    base = child_args(argv)
    rows = []
    for repeat in range(args.repeats):
        children = []
        for i, name in enumerate(names):
            cpus = cpu_sets[(i + repeat) % 2]
            out = work / f"pair{repeat}-{name}.json"
            cmd = [sys.executable, "-m", "benchmarks.router.overhead", *base, "--only", name,
                   "--repeats", "1", "--out", str(out)]
            children.append((name, cpus, out, subprocess.Popen(
                cmd, cwd=ROOT, env=project_env(), preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c))))
        for name, cpus, out, proc in children:
            if proc.wait() != 0:
                raise SystemExit(f"paired side {name} failed (exit {proc.returncode})")
            for row in json.loads(out.read_text())["rows"]:
                row.update(pair=repeat, cpus=f"{min(cpus)}-{max(cpus)}")
                rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args)
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    sides = [("current", ROOT, [])]
    for variant in args.variant:
        name, _, extra = variant.partition("=")
        sides.append((name, ROOT, shlex.split(extra)))
    compared = []
    for spec in args.compare:
        name, sep, tree = spec.partition("=")
        name, tree = (name, tree) if sep else ("baseline", spec)
        compared.append((name, Path(tree).resolve(), []))
    sides += compared
    if args.only:
        sides = [s for s in sides if s[0] == args.only]
        if not sides:
            raise SystemExit(f"--only {args.only}: no such side")
    rows = []
    if args.paired:
        rows = run_paired(args, sys.argv[1:] if argv is None else argv, work,
                          [name for name, _, _ in sides])
    else:
        for repeat in range(args.repeats):
            for name, tree, extra in sides:
                rows += run_side(args, work / f"{name}-{repeat}", name, tree, extra)
    result = {
        "command": " ".join(shlex.quote(a) for a in [
            "flock", "/tmp/quadriga-bench.lock", ".venv/bin/python", "-m",
            "benchmarks.router.overhead", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} cores; router, {args.replicas} scripted replicas, Redis and "
                   "the load generator (one process, one channel) share them",
        "workload": "16-token prompts, output_tokens greedy tokens each, replicas answer at once "
                    "(one StepOutputs per step for all their requests); Poisson arrivals; "
                    + ("every request_id the client's (a uuid4 each)" if args.client_ids
                       else "request ids made by the router"),
        "sides": {name: " ".join([str(tree), *extra]) for name, tree, extra in sides},
        "paired": (f"both sides at once, each pinned to one of the CPU sets {args.paired}, "
                   "swapped every repeat; rows of one repeat share a 'pair'") if args.paired else None,
        "definitions": DEFINITIONS,
        "duration_s": args.duration,
        "rows": rows,
    }
    for name, tree, _ in compared:
        result["baseline_commit" if name == "baseline" else f"{name}_commit"] = tree_commit(tree)
    result["commit"] = tree_commit(ROOT)
    if not args.profile:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
