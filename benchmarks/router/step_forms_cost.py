"""What Redis spends on a plain delta in lua.STEP's plain form (7 arguments)
against the same delta in its full form (18): one Redis, idle but for this,
pipelined STEP calls of K deltas each; Redis's own CPU (utime + stime from
/proc) a delta, the forms alternating, each repeat on the same requests. It
includes what argument count costs outside the script (reading and parsing
the call, building ARGV), which INFO commandstats leaves out.

    python -m benchmarks.router.step_forms_cost --repeats 5 --out benchmarks/results/router_step_forms_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.common import tree_commit
from benchmarks.router.overhead import ROOT
from common.redis_server import RedisServer
from router.persistence import lua
from router.persistence.store import pack_tokens

PREFIX = "b:"


@contextlib.contextmanager
def fenced_idle_redis(name: str):
    """A Redis of its own, idle but for the caller, with router r1's fence
    (epoch 1) set: yields (its pid, a client); stopped after."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix=f"{name}-")) / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set(PREFIX + "fence:r1", "1")
        yield server.proc.pid, client
    finally:
        server.stop()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delta(form: str, rid: str, at: int) -> list:
    plain = [rid, 4 * at, pack_tokens([7]), 2 * at, b"ab"]
    if form == "plain":
        return ["p", *plain, 1]
    return ["f", *plain, "", "", 0, "", "", "", "", "", 0, b"", "", 1]


def run(client, pid: int, sha: str, form: str, k: int, calls: int) -> float:
    """Redis CPU microseconds a delta over `calls` STEP calls of k deltas."""
    pipe = client.pipeline(transaction=False)
    before = _cpu_s(pid)
    for call in range(calls):
        args = [PREFIX, 60]
        for i in range(k):
            args += _delta(form, f"x{i}", call % 512)
        pipe.evalsha(sha, 0, *args, "r1", "1")   # fence: router id, epoch
        if call % 64 == 63:
            pipe.execute()
    pipe.execute()
    return (_cpu_s(pid) - before) / (calls * k) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deltas-per-call", type=int, nargs="+", default=[1, 8])
    p.add_argument("--deltas", type=int, default=40_000, help="deltas a form a repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = []
    with fenced_idle_redis("step-forms") as (pid, client):
        sha = client.script_load(lua.STEP)
        for k in args.deltas_per_call:
            for i in range(k):
                client.hset(PREFIX + f"req:x{i}", mapping={"st": "r", "n": "1", "br": "r1", "fe": "r1"})
            for repeat in range(args.repeats):
                for form in ("full", "plain"):
                    us = run(client, pid, sha, form, k, args.deltas // k)
                    rows.append(dict(deltas_per_call=k, repeat=repeat, form=form, redis_cpu_us_per_delta=us))
                    print(f"k={k} repeat {repeat} {form:5s} {us:6.2f} us of Redis CPU a delta", flush=True)
    summary = {}
    for k in args.deltas_per_call:
        by = {f: [r["redis_cpu_us_per_delta"] for r in rows if r["deltas_per_call"] == k and r["form"] == f]
              for f in ("full", "plain")}
        summary[str(k)] = {f: dict(median=statistics.median(v), min=min(v), max=max(v)) for f, v in by.items()}
        summary[str(k)]["plain_over_full_pairs"] = [pl / fu for fu, pl in zip(by["full"], by["plain"])]
    out = dict(command=" ".join(shlex.quote(a) for a in [sys.executable, "-m", "benchmarks.router.step_forms_cost",
                                                         *(argv if argv is not None else sys.argv[1:])]),
               method="one idle Redis; pipelined STEP calls (64 a pipeline), the forms alternating; Redis's "
                      "utime + stime (clock ticks) over each run / deltas",
               commit=tree_commit(ROOT), when=time.strftime("%Y-%m-%d %H:%M:%S"), summary=summary,
               rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
