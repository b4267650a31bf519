"""The router's Redis connection, side by side: the lean hand-written client
(router/persistence/resp.py) against redis-py's own asyncio Connection with
the hiredis parser (send_packed_command / read_response), in one run.

Both run the same script call the router's hot path makes (EVALSHA of a
small Lua script with a dozen arguments), one call at a time and in
pipelined batches, against one real redis-server on loopback, measuring
wall time and this process's CPU per call.

    .venv/bin/python -m benchmarks.router.redis_client      # writes benchmarks/results/redis_client.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.redis_server import RedisServer  # noqa: E402
from router.persistence.resp import LeanRedis  # noqa: E402

SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) return #ARGV"
ARGS = ["bench:key", "x" * 64, *[str(i) for i in range(10)]]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def lean_client(port: int):
    client = LeanRedis({"host": "127.0.0.1", "port": port})
    script = client.script(SCRIPT)  # loaded when the connection opens
    command = script.command(ARGS, numkeys=1)

    async def run(batch: int) -> None:
        # One write for the whole batch, with its deadline, as the router's writer sends it.
        await client.execute_many([command] * batch)

    return run, client.close


async def redis_py_connection(port: int):
    from redis.asyncio.connection import Connection

    conn = Connection(host="127.0.0.1", port=port)
    await conn.connect()
    assert "Hiredis" in type(conn._parser).__name__, type(conn._parser)
    import hashlib

    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    await conn.send_command("SCRIPT", "LOAD", SCRIPT)
    await conn.read_response()

    async def run(batch: int) -> None:
        packed = conn.pack_commands([("EVALSHA", sha, 1, *ARGS)] * batch)
        await conn.send_packed_command(packed, check_health=False)
        for _ in range(batch):
            await conn.read_response()

    async def close() -> None:
        await conn.disconnect()

    return run, close


async def measure(make, port: int, batch: int, calls: int, repeats: int) -> dict:
    run, close = await make(port)
    for _ in range(200 // batch + 1):
        await run(batch)  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), cpu_seconds()
        for _ in range(calls // batch):
            await run(batch)
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((cpu_seconds() - c0) / calls * 1e6)
    res = close()
    if asyncio.iscoroutine(res):
        await res
    return {"wall_us_per_call": {"median": float(np.median(wall)), "min": min(wall), "max": max(wall)},
            "cpu_us_per_call": {"median": float(np.median(cpu)), "min": min(cpu), "max": max(cpu)}}


async def main_async(args) -> dict:
    clients = {"lean (router/persistence/resp.py)": lean_client,
               "redis-py asyncio Connection + hiredis": redis_py_connection}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            rows = []
            for batch in args.batches:
                for name, make in clients.items():
                    rows.append({"client": name, "batch": batch,
                                 **await measure(make, server.port, batch, args.calls, args.repeats)})
                    print(rows[-1], flush=True)
            for batch in args.batches:  # the same again in the other order: drift shows as a change
                for name, make in reversed(clients.items()):
                    rows.append({"client": name, "batch": batch, "second_pass": True,
                                 **await measure(make, server.port, batch, args.calls, args.repeats)})
                    print(rows[-1], flush=True)
        finally:
            server.stop()
    return {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks.router.redis_client",
                                                          *sys.argv[1:]]),
            "calls_per_repeat": args.calls, "repeats": args.repeats, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/redis_client.json"))
    args = p.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
