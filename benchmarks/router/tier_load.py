"""The load generator of benchmarks/router/tier.py, in its own process: an
open loop of Poisson arrivals, each a 64-token stream followed with
client.api.FailoverStream over every router (request i starts at router
i mod N, so clients spread over the routers), one shared channel a router.

Prints one JSON object: a record per request (planned send time and how late
it went, TTFT and end from the planned time, tokens,
whether the output is exactly the simulated replicas' rule, duplicated
tokens, tokens replayed after a re-attach (checked equal by the client; one
that differs fails the request), attempts that broke, the router's timings).

    python -m benchmarks.router.tier_load --routers A,B --rate 300 --duration 8 \
        --vocab 512 --output-tokens 64 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from client.api import FailoverStream, RouterHealth, make_request, parse_routers


def expected_tokens(prompt, n: int, vocab: int) -> list[int]:
    """The simulated replicas' output (replica_worker/sim/runner.py rule_token;
    imported from there it would bring torch into the load generator)."""
    base = sum(prompt)
    return [(base + i) % vocab for i in range(n)]


async def one(routers, index, prompt, args, channels, health, start, planned, out):
    """One stream; its TTFT and end count from `planned` (perf_counter), its arrival in the
    plan, not from when this task got to run: a generator whose loop stalls sends late, and
    the stall must not drop out of the latency (coordinated omission)."""
    order = routers[index % len(routers):] + routers[:index % len(routers)]
    request = make_request(prompt, request_id=f"{args.seed}-{index}", max_tokens=args.output_tokens,
                           ignore_eos=True, temperature=0.0, stream_interval=args.stream_interval)
    stream = FailoverStream(order, request, channels=channels, health=health, attempt_timeout=120,
                            retry_delay=0.05)
    sent = planned
    rec = dict(i=index, sent=planned - start, send_lag=round(time.perf_counter() - planned, 6),
               ttft=None, end=None, tokens=0, exact=False, duplicated=0, broken=[], error="",
               gaps_ms=[])
    tokens = []
    last = None
    try:
        async for msg in stream:
            if msg.token_ids:
                now = time.perf_counter()
                if last is None:
                    rec["ttft"] = now - sent
                else:   # between messages with tokens: the TBT a client sees
                    rec["gaps_ms"].append(round(1000 * (now - last), 3))
                last = now
            if msg.output_offset != len(tokens):
                rec["duplicated"] += max(0, len(tokens) - msg.output_offset)
            tokens.extend(msg.token_ids)
            if msg.HasField("finish_reason"):
                t = msg.timings
                rec.update(server_ttft=t.time_to_first_token_s, sched_delay=t.scheduling_delay_s,
                           queue=t.queue_time_s, requeues=t.requeues)
        rec["end"] = time.perf_counter() - sent
    except Exception as exc:  # counted as lost, with why
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rec["tokens"] = len(tokens)
    rec["exact"] = tokens == expected_tokens(prompt, args.output_tokens, args.vocab)
    rec["broken"] = stream.broken
    rec["replayed"] = stream.replayed
    rec["first"] = routers.index(order[0])
    rec["attempts"] = [(routers.index(a), round(s - start, 4), round(e - start, 4), c)
                       for a, s, e, c in stream.attempts]
    out.append(rec)


async def run(args) -> dict:
    routers = parse_routers(args.routers)
    rng = random.Random(args.seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            break
        times.append(t)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in times]
    channels: dict = {}
    health = RouterHealth()   # one client process: its streams learn together which router died
    out: list[dict] = []
    loop = asyncio.get_running_loop()
    start, start_wall, cpu_start = time.perf_counter(), time.time(), time.process_time()
    tasks = []
    for i, (at, prompt) in enumerate(zip(times, prompts)):
        delay = start + at - time.perf_counter()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(routers, args.first_index + i, prompt, args, channels,
                                          health, start, start + at, out)))
    send_window = time.perf_counter() - start
    await asyncio.gather(*tasks)
    for channel in channels.values():
        await channel.close()
    # This process's own CPU over the run: a generator near one core binds the rate.
    return dict(offered_rps=args.rate, send_window_s=send_window, start_wall=start_wall,
                elapsed_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu_start,
                records=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--first-index", type=int, default=0, help="request ids start here")
    p.add_argument("--out", required=True,
                   help="the result's JSON file (not stdout: the event loop may leave stdout "
                        "non-blocking, and a pipe then takes only its first 64 KiB)")
    args = p.parse_args(argv)
    try:
        import uvloop
        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
