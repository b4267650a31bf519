"""A closed-loop gRPC load generator for the router's Generate API, shaped like
wrk: C concurrent callers on one channel, each sending its next request when
the last one finished, for a fixed time. stream_interval = max_tokens, so a
request's answer comes in one message, as a non-streaming HTTP answer does.

    python -m benchmarks.router.grpc_closed_loop --address HOST:PORT -c 32 --max-tokens 64 -d 10

Prints one JSON line in wrk_runner's shape (latency in microseconds). It is
Python on the same cores as the router, so at high concurrency it is a
heavier client than wrk: its req/s is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def percentile(sorted_values, q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


async def run(address: str, concurrency: int, max_tokens: int, duration: float, prompt: str) -> dict:
    import grpc

    from common.pb.quadriga.v1 import generation_pb2 as gpb
    from common.pb.quadriga.v1 import generation_pb2_grpc

    request = gpb.GenerateRequest(prompt=prompt, stream_interval=max_tokens,
                                  sampling=gpb.SamplingParams(max_tokens=max_tokens, temperature=0))
    latencies: list[float] = []
    errors: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        async for _ in generate(request, timeout=30):  # warm the channel
            pass
        start = time.perf_counter()
        stop_at = start + duration

        async def caller():
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async for _ in generate(request, timeout=30):
                        pass
                    latencies.append(time.perf_counter() - t0)
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc.code().name)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    lat = sorted(x * 1e6 for x in latencies)
    return {"requests": len(lat), "duration_us": int(elapsed * 1e6),
            "errors": {"status": len(errors)}, "error_codes": sorted(set(errors)),
            "latency_us": {"min": lat[0] if lat else None, "mean": sum(lat) / max(1, len(lat)),
                           "max": lat[-1] if lat else None,
                           "percentiles": {str(q): percentile(lat, q) for q in (50, 90, 99, 99.9)}},
            "requests_per_s": len(lat) / elapsed, "error_count": len(errors)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("-c", "--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("-d", "--duration", type=float, default=10.0)
    p.add_argument("--prompt", required=True)
    a = p.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(json.dumps(runner(run(a.address, a.concurrency, a.max_tokens, a.duration, a.prompt))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
