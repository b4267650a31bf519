"""What Redis spends on one request's scripts, on an idle Redis: N requests go
through SUBMIT, POP and STEP (a 1-token finish) phase by phase, one call a
request, and INFO commandstats gives each script's server-side microseconds a
call (the EVALSHA with every command it runs; no client, network or
contention in it). Trees (git worktrees, `git archive` copies) run alternately,
REPEATS times, each against its own fresh Redis, fenced as a registered router.

    .venv/bin/python -m benchmarks.router.script_lifecycle_cost NAME=TREE ... \
        [--requests 5000] [--repeats 3] [--out FILE]

Measures the scripts of trees whose Store has this tree's submit/pop/step
signatures (router/persistence/store.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _measure(n: int) -> dict:
    """Runs in a subprocess whose sys.path starts with the tree measured."""
    import redis

    from router.persistence.store import Store

    port = int(os.environ["SCRIPT_COST_PORT"])
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    store = Store(url, "b:", 60, 5.0)
    epoch = str(r.incr("b:epoch"))
    # A live lease as any tree's fence reads it (the zset and hash, or the fence key).
    r.zadd("b:routers", {"r1": time.time() + 3600})
    r.hset("b:router:r1", "epoch", epoch)
    r.set("b:fence:r1", epoch, ex=3600)
    fence = ("r1", epoch)
    for script in store.lean._scripts:
        r.script_load(script.text)

    def send(writes) -> None:
        pipe = r.pipeline(transaction=False)
        for w in writes:
            pipe.execute_command(*w.script.command([*w.header, *w.items, *fence], w.numkeys))
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise reply

    def phase(writes) -> float:
        r.config_resetstat()
        for start in range(0, len(writes), 200):
            send(writes[start:start + 200])
        stats = r.info("commandstats")["cmdstat_evalsha"]
        return stats["usec"] / stats["calls"]

    spec = json.dumps({"sampling": {"temperature": 0.0, "max_tokens": 1}, "stream_interval": 0})
    ids = [f"{i:032x}" for i in range(n)]
    now = time.time()
    out = {"submit": phase([store.submit(rid, "t" + rid, "d" * 32, spec, range(100, 116), 1, 0,
                                         now, 0, "pending") for rid in ids])}
    out["pop"] = phase([store.pop("pending", "rep1", 1, None, now + 30, now, f"p{i}")
                        for i in range(n)])
    from router.persistence import lua as tree_lua

    step = []
    for rid in ids:
        finish = (rid, 0, b"\x07\x00\x00\x00", 0, "x", "0.001", "0.002", 1, "length", "", "rep1",
                  repr(now), "", "", "", 0, 1)
        # Trees before the plain/full STEP forms take the fields flat.
        step.append(store.step([finish] if hasattr(tree_lua, "STEP_FULL_ARGS") else list(finish)))
    out["step"] = phase(step)
    out["total"] = out["submit"] + out["pop"] + out["step"]
    left = r.scard("b:live")
    if left:
        raise RuntimeError(f"{left} requests did not finish: the calls do not match this tree's scripts")
    return out


def _run_tree(tree: Path, n: int) -> dict:
    # Imported here, in the parent only: the child's imports must all come from the tree measured.
    from common.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            # This file run as a script, its imports of router.* from the tree measured.
            env = dict(os.environ, SCRIPT_COST_PORT=str(server.port), PYTHONPATH=str(tree))
            res = subprocess.run([sys.executable, __file__, "--child", str(n)], env=env,
                                 cwd=tree, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{tree}: {res.stderr[-2000:]}")
            return json.loads(res.stdout.strip().splitlines()[-1])
        finally:
            server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sides", nargs="*", metavar="NAME=TREE")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.child)))
        return 0
    sides = [s.split("=", 1) for s in args.sides]
    runs: dict[str, list] = {name: [] for name, _ in sides}
    for k in range(args.repeats):
        for name, tree in sides:
            row = _run_tree(Path(tree).resolve(), args.requests)
            runs[name].append(row)
            print(f"{name:10s} {k + 1}: " + "  ".join(f"{key} {v:5.1f} us" for key, v in row.items()),
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python -m benchmarks.router.script_lifecycle_cost " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "what": __doc__.split("\n\n")[0],
            "sides": dict(sides), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
