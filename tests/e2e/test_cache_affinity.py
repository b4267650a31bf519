"""Cache-affine scheduling with real engines: requests sharing a long prefix go
to the replica that has it cached, the pull bound serves an uncached request
once it has waited its bound, and every output equals transformers' greedy
output token for token."""

import asyncio
import time
import urllib.request

import pytest

from common.redis_server import free_port
from tests.e2e.test_end_to_end import generate

PREFIX = [7 + (13 * i) % 400 for i in range(96)]     # 6 blocks of 16


def prefixed(i: int) -> list[int]:
    return PREFIX + [450 + i, 20 + i, 33, 41 + i, 5]


def prefix_cache_hits(port: int) -> tuple[float, float]:
    """(queries, hits) in tokens, from a replica's vllm:prefix_cache_* counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


@pytest.mark.parametrize("policy", ["pull", "cache_aware"])
def test_requests_sharing_a_prefix_go_where_it_is_cached(live_stack, hf_reference, policy):
    stack = live_stack(policy)
    ports = {rid: free_port() for rid in ("r0", "r1")}
    for rid, port in ports.items():
        stack.start_replica(rid, "--metrics-port", str(port), wait=False)
    stack.wait_registered(*ports)

    async def scenario():
        tokens, last = await generate(stack.address, prefixed(0), 8)
        assert tokens == hf_reference(prefixed(0), 8)
        home = last.timings.replica_id
        served = []
        for i in range(1, 7):
            # One at a time, both replicas idle each time: strict FIFO would give
            # each to whichever pulled first, and least_outstanding to either.
            await asyncio.sleep(0.1)
            tokens, last = await generate(stack.address, prefixed(i), 8)
            assert tokens == hf_reference(prefixed(i), 8)
            served.append(last.timings.replica_id)
        return home, served

    home, served = asyncio.run(scenario())
    assert served == [home] * 6
    other = "r1" if home == "r0" else "r0"
    queries, hits = prefix_cache_hits(ports[home])
    # Each of the six found the 96 shared tokens; nothing else is shared.
    assert hits == 6 * 96 and queries == 7 * 101
    assert prefix_cache_hits(ports[other]) == (0, 0)


def test_an_uncached_request_is_served_once_it_has_waited_its_bound(live_stack, hf_reference):
    """One seat, so requests run one after another, each of the cached ones for
    150 steps. A cold request arrives ahead of 8 that share a cached prefix.
    Cached tokens alone decide (--pull-affinity-wait-weight 0), so the cached
    ones pass it until it has waited 0.5 s: then it is served next. Strict FIFO
    would serve it first; affinity without the bound, last. (Six of the cached
    ones must take well over the bound: at 60 steps each, about 0.1 s here,
    all eight ran within a 1 s bound, and the cold one was rightly last.)"""
    stack = live_stack("pull", ["--pull-affinity-max-wait", "0.5", "--pull-affinity-wait-weight", "0"])
    stack.start_replica("r0", "--max-num-seqs", "1")
    cold = [300 + (7 * i) % 200 for i in range(101)]
    warm = [prefixed(i) for i in range(1, 9)]

    async def scenario():
        first_token = {}

        async def one(name, prompt, n=150):
            out = await generate(stack.address, prompt, n, progress=progress[name])
            return name, prompt, n, out

        progress = {"busy": [0], "cold": [0], **{f"w{i}": [0] for i in range(len(warm))}}
        # Holds the one seat (and caches the prefix) while the others queue.
        busy = asyncio.create_task(one("busy", prefixed(0), 60))
        while not progress["busy"][0]:
            await asyncio.sleep(0.01)
        tasks = [asyncio.create_task(one("cold", cold))]
        await asyncio.sleep(0.05)
        for i, prompt in enumerate(warm):
            tasks.append(asyncio.create_task(one(f"w{i}", prompt)))
            await asyncio.sleep(0.02)
        while len(first_token) < len(tasks):
            for name, p in progress.items():
                if p[0] and name not in first_token and name != "busy":
                    first_token[name] = time.monotonic()
            await asyncio.sleep(0.005)
        return await asyncio.gather(busy, *tasks), sorted(first_token, key=first_token.get)

    results, order = asyncio.run(scenario())
    for name, prompt, n, (tokens, _) in results:
        assert tokens == hf_reference(prompt, n), name
    position = order.index("cold")
    assert 1 <= position <= len(warm) - 2, order
    assert order[:position] == [f"w{i}" for i in range(position)], "cached ones in arrival order"
