"""What a tier of routers on one Redis costs a request, router by router count:
Redis's commands and time (INFO commandstats, reset after a warm-up) and the
cores each process kept busy, at one modest rate of 64-token streams from
simulated replicas (benchmarks/router/tier.py's set-up, small). It shows what
several routers add over one for the same work: events between routers (XADD,
XREAD), pops that find nothing. --compare runs the routers of another tree
(e.g. a `git archive` of an older commit), or this tree with other router
settings, beside this one, sides alternating: NAME=TREE[:KEY=VALUE,...], TREE
`.` for this tree, the settings added to the routers' environment.

    python -m benchmarks.router.tier_redis_cost --routers 1 2 --rate 40 \\
        --compare before=/tmp/tree --repeats 2 --out benchmarks/results/router_tier_redis_cost.json
    python -m benchmarks.router.tier_redis_cost --routers 1 2 --rate 40 \\
        --compare linger2=.:QUADRIGA_ROUTER_REDIS_STEP_LINGER_MS=2 --repeats 3 --out ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy
import redis

from benchmarks.common import tree_commit
from benchmarks.router import tier as tier_bench
from benchmarks.router.overhead import ROOT
from common.tiny_model import build_tiny_model

WATCHED = ("evalsha", "xadd", "xread", "hgetall", "zscore")


def parse_side(text: str) -> tuple[str, str | None, list[str]]:
    """NAME=TREE[:KEY=VALUE,...] -> (name, tree or None for this one, settings)."""
    name, _, rest = text.partition("=")
    tree, _, settings = rest.partition(":")
    if not name or not tree:
        raise SystemExit(f"a side is NAME=TREE[:KEY=VALUE,...], not {text!r}")
    return name, None if tree == "." else tree, [kv for kv in settings.split(",") if kv]


def percentile(values: list, q: float) -> float | None:
    return round(float(numpy.percentile(values, q)), 3) if values else None


def measure(args, work: Path, model: Path, routers: int, tree: str | None,
            settings: list[str]) -> dict:
    tier_args = tier_bench.parse_args(["--replicas", str(args.replicas), "--per-process",
                                       str(args.per_process), "--clients", str(args.clients)]
                                      + (["--router-tree", tree] if tree else [])
                                      + [f"--router-env={kv}" for kv in settings])
    tier_args.vocab = args.vocab
    tier = tier_bench.Tier(tier_args, work, model, routers).start()
    try:
        tier.load(args.rate / 4, 2.0, seed=999)   # warm-up: channels, first steps
        client = redis.Redis.from_url(tier.redis.url)
        client.config_resetstat()
        result = tier.load(args.rate, args.duration, seed=1)
        stats = client.info("commandstats")
    finally:
        tier.stop()
    records = result["records"]
    n = len(records)
    per_request = {k.removeprefix("cmdstat_"): {"calls": v["calls"] / n, "usec": v["usec"] / n}
                   for k, v in stats.items() if not k.startswith("cmdstat_config")}
    cores = result["cores_busy"]
    gaps = [g for r in records for g in r.get("gaps_ms", ())]
    return dict(routers=routers, requests=n, exact=sum(1 for r in records if r["exact"]),
                lost=sum(1 for r in records if r["error"]),
                ttft_p50_ms=percentile([1000 * r["ttft"] for r in records if r["ttft"] is not None], 50),
                e2e_p50_ms=percentile([1000 * r["end"] for r in records if r["end"] is not None], 50),
                client_gap_p50_ms=percentile(gaps, 50), client_gap_p99_ms=percentile(gaps, 99),
                per_request_counts=result["per_request"],
                redis_usec_per_request=sum(v["usec"] for v in per_request.values()),
                calls_per_request={k: round(per_request.get(k, {"calls": 0})["calls"], 2) for k in WATCHED},
                router_cores=round(sum(c for c in cores["routers"] if c), 3),
                redis_cores=round(cores["redis"], 3), commands=per_request)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--per-process", type=int, default=4)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--compare", action="append", default=[], metavar="NAME=TREE")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tier-redis-cost-"))
    model = build_tiny_model(work / "model")
    args.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    sides = [("current", None, [])] + [parse_side(c) for c in args.compare]
    rows = []
    for repeat in range(args.repeats):
        for routers in args.routers:
            # The order of the sides turns every repeat, so the box's drift falls on each alike.
            for name, tree, settings in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:
                row = dict(side=name, repeat=repeat,
                           **measure(args, work, model, routers, tree, settings))
                rows.append(row)
                print(f"{name:10s} routers {routers}  requests {row['requests']} exact {row['exact']}  "
                      f"Redis {row['redis_usec_per_request']:7.0f} us/req  calls/req {row['calls_per_request']}  "
                      f"round trips/req {row['per_request_counts']['redis_round_trips']:.1f}  "
                      f"cores: routers {row['router_cores']:.2f} Redis {row['redis_cores']:.2f}  "
                      f"client gap p50/p99 {row['client_gap_p50_ms']}/{row['client_gap_p99_ms']} ms  "
                      f"TTFT p50 {row['ttft_p50_ms']} ms", flush=True)
    out = dict(command=" ".join(shlex.quote(a) for a in [sys.executable, "-m", "benchmarks.router.tier_redis_cost",
                                                         *(argv if argv is not None else sys.argv[1:])]),
               sides={name: {"tree": tree or "this tree", "settings": settings,
                             "commit": tree_commit(Path(tree) if tree else ROOT)}
                      for name, tree, settings in sides},
               settings={k: v for k, v in vars(args).items() if k not in ("out", "compare")},
               method="one tier a row (Redis, routers, simulated replicas, load generators as processes); "
                      "Redis INFO commandstats reset after a warm-up, divided by the requests of one "
                      "open-loop run; cores = CPU seconds / wall of that run; sides alternate, "
                      "their order turning every repeat; client gaps: the times between a "
                      "request's messages with tokens, as its client saw them, over all requests",
               rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
