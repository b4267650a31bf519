"""Where a request's Redis time goes: one router tree under the overhead
benchmark's load (2 scripted replicas, 1-token requests), every command Redis
runs logged (SLOWLOG, threshold 0) and summed per script.

    .venv/bin/python -m benchmarks.router.redis_script_cost TREE RATE [--duration S]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.router.local_router import ROOT, LocalRouter, project_env
from benchmarks.router.tree_scripts import names_by_sha


def load(lr: LocalRouter, rate: float, duration: float) -> dict:
    """The overhead benchmark's load generator against this router; its summary row."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.router.overhead", "--client",
                          lr.grpc_address, "--rate", str(rate), "--duration", str(duration),
                          "--vocab", str(lr.vocab), "--output-tokens", "1"],
                         cwd=ROOT, capture_output=True, text=True, env=project_env(), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree", type=Path)
    p.add_argument("rate", type=float)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--top", type=int, default=6, help="commands and scripts listed")
    args = p.parse_args(argv)
    import redis

    tree = args.tree.resolve()
    names = names_by_sha(tree)
    with LocalRouter(Path(tempfile.mkdtemp(prefix="script-cost-")), replicas=2,
                     router_args=["--heartbeat-interval", "0.5"], router_tree=tree) as lr:
        r = redis.Redis.from_url(lr.redis_url)
        load(lr, 50, 1)   # warm: scripts loaded, connections open
        r.config_set("slowlog-max-len", 200_000)
        r.config_set("slowlog-log-slower-than", 0)
        r.slowlog_reset()
        row = load(lr, args.rate, args.duration)
        entries = r.slowlog_get(200_000)
    n = row["completed"]
    per_command = collections.defaultdict(list)   # EVALSHA by script name, others by command
    for entry in entries:
        words = entry["command"].split(b" ")
        if words[0].upper() == b"EVALSHA":
            key = names.get(words[1].decode(), words[1][:8].decode())
        else:
            key = words[0].decode().upper()
        per_command[key].append(entry["duration"])
    print(f"{tree.name} rate {args.rate:g} added p50 {row['router_added_p50_ms']:.2f} "
          f"queue p50 {row['router_queue_p50_ms']:.2f}")
    for key, took in sorted(per_command.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        took.sort()
        print(f"   {key} calls/req {len(took) / n:.2f} mean {sum(took) / len(took):.1f} "
              f"p50 {took[len(took) // 2]} us/req {sum(took) / n:.1f}")
    scripts = sum(sum(took) for key, took in per_command.items() if key in names.values())
    print(f"   scripts us/req {scripts / n:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
