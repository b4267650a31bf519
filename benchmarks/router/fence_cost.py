"""What every script call pays for its fence (router/persistence/lua_common.py:
FENCE) before its own work: one idle Redis, pipelined EVALSHA calls of
scripts that do nothing after their preamble, the preambles alternating:

  fence        FENCE as it is: TIME, the fence GET, seven helper closures
  no_helpers   TIME and the GET, no helper closures
  no_clock     the GET only (a clock read only where a script reads it)
  bare         no preamble at all

Redis's own CPU (utime + stime from /proc) a call, and INFO commandstats'
microseconds a call (the script's run only).

    python -m benchmarks.router.fence_cost --repeats 5 --out benchmarks/results/router_fence_cost.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import tree_commit
from benchmarks.router.step_forms_cost import PREFIX, _cpu_s, fenced_idle_redis
from router.persistence.lua_common import FENCE


_FENCE_CHECK = """
if router_ ~= '' and redis.call('GET', p_ .. 'fence:' .. router_) ~= epoch_ then
  return redis.error_reply('FENCED router ' .. router_)
end
"""
_ARGS = """
local epoch_ = table.remove(ARGV)
local router_ = table.remove(ARGV)
local p_ = ARGV[1]
"""
_CLOCK = """
local t_ = redis.call('TIME')
local now_ = tonumber(t_[1]) + tonumber(t_[2]) / 1e6
"""
PREAMBLES = {
    "fence": FENCE,
    "no_helpers": _ARGS + _CLOCK + _FENCE_CHECK,
    "no_clock": _ARGS + _FENCE_CHECK,
    "bare": "",
}


def run(client, pid: int, sha: str, calls: int) -> tuple[float, float]:
    """(Redis CPU us a call, commandstats us a call) over `calls` pipelined calls."""
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    before = _cpu_s(pid)
    for call in range(calls):
        pipe.evalsha(sha, 0, PREFIX, "r1", "1")   # the fence's router id and epoch
        if call % 64 == 63:
            pipe.execute()
    pipe.execute()
    cpu = (_cpu_s(pid) - before) / calls * 1e6
    return cpu, client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100_000, help="calls a preamble a repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = []
    with fenced_idle_redis("fence-cost") as (pid, client):
        shas = {name: client.script_load(text + "\nreturn 1") for name, text in PREAMBLES.items()}
        for repeat in range(args.repeats):
            for name, sha in shas.items():
                cpu, usec = run(client, pid, sha, args.calls)
                rows.append(dict(repeat=repeat, preamble=name, redis_cpu_us_per_call=cpu,
                                 commandstats_us_per_call=usec))
                print(f"repeat {repeat} {name:10s} {cpu:5.2f} us of Redis CPU a call, "
                      f"{usec:5.2f} us in the script", flush=True)
    summary = {}
    for name in PREAMBLES:
        cpu = [r["redis_cpu_us_per_call"] for r in rows if r["preamble"] == name]
        usec = [r["commandstats_us_per_call"] for r in rows if r["preamble"] == name]
        summary[name] = dict(redis_cpu_us=dict(median=statistics.median(cpu), min=min(cpu), max=max(cpu)),
                             script_us=dict(median=statistics.median(usec), min=min(usec), max=max(usec)))
    out = dict(command=" ".join(shlex.quote(a) for a in [sys.executable, "-m", "benchmarks.router.fence_cost",
                                                         *(argv if argv is not None else sys.argv[1:])]),
               method="one idle Redis; pipelined EVALSHA calls (64 a pipeline) of a preamble then "
                      "'return 1', the preambles alternating; Redis's utime + stime (clock ticks) over "
                      "each run / calls, and INFO commandstats' usec_per_call",
               preambles=PREAMBLES, commit=tree_commit(), when=time.strftime("%Y-%m-%d %H:%M:%S"),
               summary=summary, rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
