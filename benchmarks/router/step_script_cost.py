"""One STEP call's Redis time, this tree's script beside another tree's, on
one idle Redis (alternated in rounds): a 1-token request's only step (its
output, the first token's stamps and its finish) from the router that holds
it. Redis's own per-command timing (INFO commandstats), not the client's.

    .venv/bin/python -m benchmarks.router.step_script_cost --compare .baseline-tree --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.router.tree_scripts import tree_scripts  # noqa: E402
from common.redis_server import RedisServer  # noqa: E402


def step_script(tree: Path) -> str:
    """STEP of a tree's router (its FENCE included)."""
    return tree_scripts(tree)["STEP"]


def one_call_us(r, sha: str, calls: int, tag: str) -> float:
    """Mean Redis time of one STEP call finishing a fresh request, in us."""
    for i in range(calls):
        r.hset(f"P:req:{tag}{i}", mapping={"st": "r", "n": "1", "br": "rA", "fe": "rA"})
        r.zadd("P:inflight", {f"{tag}{i}": 1e12})
    r.config_resetstat()
    for i in range(calls):
        rid = f"{tag}{i}"
        r.evalsha(sha, 0, "P:", "300", rid, "0", "\x00\x00\x00\x07", "0", "<7>", "1700000000.1",
                  "1700000000.05", "1", "FINISH_REASON_LENGTH", "", "r0", "1700000000.1", "0", "",
                  "", "0", "1", "rA", "7")
    return r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", required=True, help="another tree (a git archive of a commit)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out")
    args = p.parse_args(argv)
    import redis

    trees = {"current": ROOT, "compared": Path(args.compare).resolve()}
    server = RedisServer(Path(tempfile.mkdtemp(prefix="step-cost-")))
    server.start()
    try:
        r = redis.Redis(port=server.port)
        # A live lease as either tree's fence reads it (the zset and hash, or the fence key).
        r.zadd("P:routers", {"rA": 1e12})
        r.hset("P:router:rA", "epoch", "7")
        r.set("P:fence:rA", "7")
        shas = {name: r.script_load(step_script(tree)) for name, tree in trees.items()}
        samples = {name: [] for name in trees}
        for n in range(args.rounds):
            for name, sha in shas.items():
                samples[name].append(one_call_us(r, sha, args.calls, f"{name}{n}-"))
    finally:
        server.stop()
    result = {
        "command": " ".join(["python", "-m", "benchmarks.router.step_script_cost", *(argv or sys.argv[1:])]),
        "what": "Redis usec per STEP call finishing a 1-token request (INFO commandstats), "
                "one idle Redis, the two scripts alternated in rounds",
        "trees": {k: str(v) for k, v in trees.items()},
        "us_per_call": samples,
        "median_us": {k: statistics.median(v) for k, v in samples.items()},
    }
    print(json.dumps(result["median_us"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
