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
    """One seat, so requests run one after another. A cold request arrives ahead
    of 8 that share a cached prefix. Cached tokens alone decide
    (--pull-affinity-wait-weight 0), so a cached one passes the cold one while
    it has waited less than the bound (1 s); once it has waited longer, it is
    served next. Strict FIFO would serve it first; affinity without the bound,
    last. So the order is w0, cold, w1, ..., w7.

    The two picks are placed in time by pausing the engine, not by how fast the
    machine steps: the nine queue while it is paused (the seat holder has few
    steps left, so the first pick comes well inside the bound even on a loaded
    box), and it is paused again, w0 holding the seat, until the cold one has
    waited past the bound. Timed by sleeps alone, a loaded CI box served the
    cold one first and an idle one last."""
    bound = 1.0
    stack = live_stack("pull", ["--pull-affinity-max-wait", str(bound), "--pull-affinity-wait-weight", "0"])
    stack.start_replica("r0", "--max-num-seqs", "1")
    cold = [300 + (7 * i) % 200 for i in range(101)]
    warm = [prefixed(i) for i in range(1, 9)]

    async def scenario():
        first_token = {}

        async def one(name, prompt, n=150):
            out = await generate(stack.address, prompt, n, progress=progress[name])
            return name, prompt, n, out

        def note_first_tokens():
            for name, p in progress.items():
                if p[0] and name not in first_token and name != "busy":
                    first_token[name] = time.monotonic()

        progress = {"busy": [0], "cold": [0], **{f"w{i}": [0] for i in range(len(warm))}}
        # Holds the one seat (and caches the prefix) while the others queue.
        busy = asyncio.create_task(one("busy", prefixed(0), 40))
        while not progress["busy"][0]:
            await asyncio.sleep(0.01)
        with stack.engines_paused("r0"):
            cold_sent = time.monotonic()
            tasks = [asyncio.create_task(one("cold", cold))]
            await asyncio.sleep(0.05)
            for i, prompt in enumerate(warm):
                tasks.append(asyncio.create_task(one(f"w{i}", prompt)))
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)   # every submit admitted before the seat can free
        # The first pick, inside the cold one's bound: the seat holder ends soon.
        while not first_token:
            note_first_tokens()
            await asyncio.sleep(0.005)
        assert time.monotonic() - cold_sent < bound, "the first pick came too late to test the bound"
        with stack.engines_paused("r0"):
            await asyncio.sleep(cold_sent + bound + 0.3 - time.monotonic())
        while len(first_token) < len(tasks):
            note_first_tokens()
            await asyncio.sleep(0.005)
        return await asyncio.gather(busy, *tasks), sorted(first_token, key=first_token.get)

    results, order = asyncio.run(scenario())
    for name, prompt, n, (tokens, _) in results:
        assert tokens == hf_reference(prompt, n), name
    assert order == ["w0", "cold"] + [f"w{i}" for i in range(1, len(warm))], order
