"""The hops a Quadriga request crosses at concurrency 1, each alone, on this machine:
what bounds the router's added latency from below, beside benchmarks/router/peers.py.

  grpc_stream_rtt   one message out and one back on a grpc.aio bidirectional stream
                    between two processes (uvloop both sides): the Assign out to a
                    replica and its step back
  redis_rtt         one PING through the router's Redis connection (router/persistence/resp.py)
  http_rtt          one POST answered at once by a bare ASGI app under uvicorn (httptools,
                    uvloop), from wrk at concurrency 1 (peers.py's load generator): a front
                    door with nothing behind it; peers.py's direct target is wrk against its
                    mock backend

A request taken at arrival pays the HTTP hop, then the gRPC round trip and the
SUBMIT's Redis round trip side by side (the client is answered once both are in),
then the answer: its floor is about http_rtt + max(grpc_stream_rtt, redis_rtt),
before any of the router's own work. sglang-router's whole added latency is one
HTTP hop in Rust.

    .venv/bin/python -m benchmarks.router.hop_floor --out benchmarks/results/router_hop_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.redis_server import RedisServer, free_port  # noqa: E402


def _identity(b: bytes) -> bytes:
    return b


def _grpc_echo(port: int) -> None:
    import grpc
    import uvloop

    async def serve():
        async def echo(it, _ctx):
            async for msg in it:
                yield msg
        handler = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=_identity,
                                                        response_serializer=_identity)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("hop.Echo",
                                                                              {"Echo": handler})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    uvloop.run(serve())


def _bare_http(port: int) -> None:
    import uvicorn

    body = b'{"ok":true}'

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


def percentiles(us: list[float]) -> dict:
    s = sorted(us)
    return {"p50_us": round(statistics.median(s), 1), "p90_us": round(s[int(len(s) * 0.9)], 1),
            "p99_us": round(s[int(len(s) * 0.99)], 1)}


async def grpc_rtt(port: int, n: int) -> list[float]:
    import grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 20)
        call = channel.stream_stream("/hop.Echo/Echo", request_serializer=_identity,
                                     response_deserializer=_identity)()
        payload = b"x" * 200   # about an Assign of a short prompt
        out = []
        for _ in range(n):
            start = time.perf_counter()
            await call.write(payload)
            await call.read()
            out.append((time.perf_counter() - start) * 1e6)
        await call.done_writing()
        return out


async def redis_rtt(url: str, n: int) -> list[float]:
    import redis.asyncio as aioredis

    from router.persistence.resp import LeanRedis

    pool = aioredis.Redis.from_url(url).connection_pool
    lean = LeanRedis(pool.connection_kwargs)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await lean.execute("PING")
        out.append((time.perf_counter() - start) * 1e6)
    lean.close()
    return out


def http_rtt(port: int, seconds: int) -> dict:
    """wrk at concurrency 1 (as peers.py drives every target) against the bare app."""
    from benchmarks.router.wrk_runner import WrkSettings, find_wrk, run_wrk

    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 20
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/")
            conn.getresponse().read()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    wrk = find_wrk(None)
    run_wrk(wrk, url, WrkSettings(1, 1, 1, 1, "m", "x"))   # warm-up
    row = run_wrk(wrk, url, WrkSettings(1, 1, seconds, 1, "m", "x"))
    lat = row["latency_us"]["percentiles"]
    return {"p50_us": float(lat["50"]), "p90_us": float(lat["90"]), "p99_us": float(lat["99"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=int, default=3, help="wrk's run against the bare app")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_hop_floor.json"))
    a = p.parse_args(argv)
    import uvloop

    ctx = mp.get_context("spawn")
    grpc_port, http_port = free_port(), free_port()
    procs = [ctx.Process(target=_grpc_echo, args=(grpc_port,), daemon=True),
             ctx.Process(target=_bare_http, args=(http_port,), daemon=True)]
    for proc in procs:
        proc.start()
    redis = RedisServer(Path(tempfile.mkdtemp()) / "redis")
    redis.start()
    runs: dict[str, list[dict]] = {"grpc_stream_rtt": [], "redis_rtt": [], "http_rtt": []}
    try:
        for _ in range(a.repeats):
            warm = a.calls // 10
            runs["grpc_stream_rtt"].append(percentiles(
                uvloop.run(grpc_rtt(grpc_port, a.calls + warm))[warm:]))
            runs["redis_rtt"].append(percentiles(uvloop.run(redis_rtt(redis.url, a.calls + warm))[warm:]))
            runs["http_rtt"].append(http_rtt(http_port, a.seconds))
    finally:
        redis.stop()
        for proc in procs:
            proc.kill()
    summary = {hop: {"p50_us_per_repeat": [r["p50_us"] for r in rows],
                     "p99_us_per_repeat": [r["p99_us"] for r in rows]} for hop, rows in runs.items()}
    for hop, row in summary.items():
        print(f"{hop:16s} p50 {row['p50_us_per_repeat']} us   p99 {row['p99_us_per_repeat']} us")
    out = {"command": "python -m benchmarks.router.hop_floor " + shlex.join(argv or sys.argv[1:]),
           "definitions": {"p50_us, p99_us": "one round trip from the caller's side, microseconds; "
                                             "gRPC and Redis: the first tenth of each run's calls "
                                             "left out; HTTP: wrk's percentiles of one run"},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "summary": summary, "runs": runs}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
