"""cache_aware and pull with affinity against scripted replicas that report a
(fake) prefix cache, over real gRPC and Redis; and the hit metrics."""

import asyncio
import time

import pytest

from common.block_hash import BlockHasher
from router.scheduling.policies import pull as pull_policy
from tests.router.test_scheduling import assigned_ids, submit_in_order, wait_until
from tests.support.router_harness import (Replicas, client, make_config, request,
                                          running_router)

H16 = BlockHasher(16)
SHARED = list(range(300, 300 + 64))      # a 64-token prefix: 4 blocks
# Waiting counts for nothing against cached tokens: the order a test sees
# does not depend on how long its requests happened to wait.
HITS_DECIDE = {"pull_affinity_wait_weight": 0.0}


def with_shared(tail) -> list[int]:
    return SHARED + list(tail)


class SkewedClock:
    """time as pull affinity reads it, moved forward by hand: waits past the bound
    without sleeping through them."""

    def __init__(self):
        self.skew = 0.0

    def time(self) -> float:
        return time.time() + self.skew


@pytest.fixture
def clock(monkeypatch):
    c = SkewedClock()
    monkeypatch.setattr(pull_policy, "time", c)
    return c


def value(app, name, **labels):
    v = app.metrics.registry.get_sample_value(name, labels or None)
    return v or 0.0


async def cached_pair(app, cached_on="r1", **knobs):
    """r0 and r1, pulling only when told; `cached_on` holds SHARED's 4 blocks."""
    reps = Replicas(app.address, app.limits.vocab_size)
    for rid in ("r0", "r1"):
        held = tuple(H16.hashes(SHARED)) if rid == cached_on else ()
        await reps.add(rid, auto_pull=False, prefix_cache=True, cached=held, **knobs)
    return reps


def test_cache_aware_follows_the_cache_until_the_load_is_too_uneven(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, policy="cache_aware", cache_aware_balance_abs=300,
                          cache_aware_balance_rel=1.5)
        async with running_router(cfg) as app:
            reps = await cached_pair(app)
            async with client(app.address) as stub:
                reqs = [request(with_shared([1, 2]), 100, request_id="hit1"),   # r1 holds 64 of 66
                        request([5] * 20, 10, request_id="cold"),               # nobody: least loaded
                        request(with_shared([3]), 100, request_id="hit2"),      # r1: 332 vs 30
                        request(with_shared([4]), 100, request_id="hit3")]      # r1 too far ahead
                tasks = await submit_in_order(app, stub, reqs)
                where = {r.request_id: app.table.requests[r.request_id].queue for r in reqs}
                assert where == {"hit1": "r:r1", "cold": "r:r0", "hit2": "r:r1", "hit3": "r:r0"}
                # Hits of 64, 0, 64, 0 tokens; the best on offer was 64 each time but for cold.
                assert value(app, "quadriga_prefix_hit_tokens_sum") == 128
                assert value(app, "quadriga_prefix_best_hit_tokens_sum") == 192
                assert value(app, "quadriga_prefix_context_tokens_total") == 66 + 20 + 65 + 65
                reps["r0"].pull(10)
                reps["r1"].pull(10)
                await asyncio.gather(*tasks)
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("window", [32, 0])
def test_a_pull_takes_what_the_puller_holds_from_the_window(redis_url, tiny_model, arun, window):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_window=window, **HITS_DECIDE)
        async with running_router(cfg) as app:
            reps = await cached_pair(app)
            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, [
                    request([7] * 30, 4, request_id="cold"),
                    request(with_shared([9]), 4, request_id="warm")])
                reps["r1"].pull(1)
                await wait_until(lambda: assigned_ids(reps["r1"]))
                reps["r0"].pull(1)
                await wait_until(lambda: assigned_ids(reps["r0"]))
                await asyncio.gather(*tasks)
            if window:
                assert (assigned_ids(reps["r1"]), assigned_ids(reps["r0"])) == (["warm"], ["cold"])
                assert value(app, "quadriga_pull_picks_total", reason="affinity") == 1
                assert value(app, "quadriga_prefix_hit_tokens_sum") == 64
            else:   # strict FIFO: the head, whatever the cache (no hashing, no metrics)
                assert (assigned_ids(reps["r1"]), assigned_ids(reps["r0"])) == (["cold"], ["warm"])
                assert value(app, "quadriga_pull_picks_total", reason="fifo") == 2
                assert value(app, "quadriga_prefix_context_tokens_total") == 0
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("window", [32, 0])
def test_a_request_is_left_to_the_puller_holding_more_of_it(redis_url, tiny_model, arun, window):
    """Both replicas have credit when it arrives; r0 pulled first, so strict
    FIFO gives it to r0, affinity to r1, which holds its prefix."""
    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_window=window, **HITS_DECIDE)
        async with running_router(cfg) as app:
            reps = await cached_pair(app)
            reps["r0"].pull(1)
            await asyncio.sleep(0.05)
            reps["r1"].pull(1)
            await wait_until(lambda: all(app.scheduler.credit_of(r).requests == 1 for r in ("r0", "r1")))
            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, [request(with_shared([1]), 4, request_id="warm")])
                await wait_until(lambda: assigned_ids(reps["r0"]) + assigned_ids(reps["r1"]))
                tasks += await submit_in_order(app, stub, [request([8] * 20, 4, request_id="cold")])
                await asyncio.gather(*tasks)
            expected = ("cold", "warm") if window else ("warm", "cold")
            assert (assigned_ids(reps["r0"]), assigned_ids(reps["r1"])) == ([expected[0]], [expected[1]])
            await reps.close()

    arun(scenario())


def test_the_window_and_the_wait_bound_limit_reordering(redis_url, tiny_model, arun, clock):
    """Window 3: a cached request further back is not seen; once the cold head
    has waited past the bound it is taken first, then the rest in order."""
    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_window=3, pull_affinity_max_wait=60.0,
                          **HITS_DECIDE)
        async with running_router(cfg) as app:
            reps = await cached_pair(app)
            r1 = reps["r1"]
            names = ["c0", "c1", "c2", "w0", "w1", "c3", "w2"]
            reqs = [request(with_shared([i]) if n[0] == "w" else [20 + i] * 10, 4, request_id=n)
                    for i, n in enumerate(names)]
            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, reqs)
                order = []
                for _ in range(3):
                    r1.pull(1)
                    await wait_until(lambda: len(assigned_ids(r1)) == len(order) + 1)
                    order = assigned_ids(r1)
                # [c0 c1 c2] w0 ...: nothing cached in the window, so the oldest; then w0
                # enters the window and is taken ahead of c1, c2; then w1 likewise.
                assert order == ["c0", "w0", "w1"]
                clock.skew = 61.0       # c1, c2, c3 and w2 have now waited past the bound
                r1.pull(4)
                await wait_until(lambda: len(assigned_ids(r1)) == 7)
                assert assigned_ids(r1)[3:] == ["c1", "c2", "c3", "w2"]
                await asyncio.gather(*tasks)
            picks = {w: value(app, "quadriga_pull_picks_total", reason=w) for w in ("fifo", "affinity", "overdue")}
            assert picks == {"fifo": 1, "affinity": 2, "overdue": 4}
            await reps.close()

    arun(scenario())


def test_affinity_keeps_priorities_and_token_credit(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, **HITS_DECIDE)) as app:
            reps = await cached_pair(app)
            r1 = reps["r1"]
            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, [
                    request(with_shared([1]), 4, request_id="warm_low", priority=-1),
                    request([9] * 30, 4, request_id="cold_high", priority=3),
                    request(with_shared([2]), 4, request_id="warm1"),
                    request(with_shared([3]), 4, request_id="warm2"),
                    request([8] * 30, 4, request_id="cold")])
                r1.pull(2)
                await wait_until(lambda: len(assigned_ids(r1)) == 2)
                await asyncio.sleep(0.2)
                assert assigned_ids(r1) == ["cold_high", "warm1"]
                # 10 tokens of credit: warm2 (65) starts on it and overruns; then none is left.
                r1.pull(3, 10)
                await wait_until(lambda: len(assigned_ids(r1)) == 3)
                await asyncio.sleep(0.2)
                assert assigned_ids(r1) == ["cold_high", "warm1", "warm2"]
                r1.pull(2)
                await wait_until(lambda: len(assigned_ids(r1)) == 5)
                assert assigned_ids(r1)[3:] == ["cold", "warm_low"]
                await asyncio.gather(*tasks)
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("balance_abs", [0, 100])
def test_a_much_busier_holder_is_waited_for_only_with_the_balance_term_off(redis_url, tiny_model, arun,
                                                                          balance_abs):
    """r1 holds the prefix and runs a 230-token request that never finishes; r0
    runs nothing. Both have a seat when a request sharing the prefix arrives, r0's
    Pull the older. Off (the default), r0 leaves it to r1, which holds it; with
    the balance term on, r1 is too far ahead of r0 (230 tokens over 0: more than
    100 and more than 1.5x) to be waited for, and r0 takes it."""
    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_balance_abs=balance_abs, **HITS_DECIDE)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0", auto_pull=False, prefix_cache=True)
            await reps.add("r1", auto_pull=False, prefix_cache=True, cached=tuple(H16.hashes(SHARED)),
                           hold_on_finish=True)
            async with client(app.address) as stub:
                reps["r1"].pull(1)
                tasks = await submit_in_order(app, stub, [request([7] * 30, 200, request_id="busy")])
                await wait_until(lambda: assigned_ids(reps["r1"]) == ["busy"])
                assert app.table.load_of("r1") == 230 and app.table.load_of("r0") == 0
                reps["r0"].pull(1)
                await asyncio.sleep(0.05)
                reps["r1"].pull(1)
                await wait_until(lambda: all(app.scheduler.credit_of(r).requests == 1 for r in ("r0", "r1")))
                tasks += await submit_in_order(app, stub, [request(with_shared([1]), 4, request_id="warm")])
                await wait_until(lambda: "warm" in assigned_ids(reps["r0"]) + assigned_ids(reps["r1"]))
                assert "warm" in assigned_ids(reps["r0" if balance_abs else "r1"])
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await reps.close()

    arun(scenario())


def test_work_a_busy_holder_leaves_spills_over_once_it_has_waited_its_lead(redis_url, tiny_model, arun):
    """r1 holds the prefix but does not pull; r0 pulls once and is left waiting:
    nothing else happens, yet a second after its arrival (64 cached tokens at
    64 tokens a second, r0's rate unmeasured times the weight) the request goes
    to r0, woken by the scheduler's own timer."""
    from router.scheduling.policies.pull import UNMEASURED_PREFILL_TOKENS_PER_S

    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_max_wait=30.0,
                          pull_affinity_wait_weight=64 / UNMEASURED_PREFILL_TOKENS_PER_S)
        async with running_router(cfg) as app:
            reps = await cached_pair(app)
            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, [request(with_shared([5]), 4, request_id="warm")])
                reps["r0"].pull(1)
                await asyncio.sleep(0.2)
                assert assigned_ids(reps["r0"]) == [], "left for r1, which holds it"
                await wait_until(lambda: assigned_ids(reps["r0"]), timeout=10)
                await asyncio.gather(*tasks)
            assert assigned_ids(reps["r1"]) == []
            assert value(app, "quadriga_prefix_hit_tokens_sum") == 0
            assert value(app, "quadriga_prefix_best_hit_tokens_sum") == 64
            await reps.close()

    arun(scenario())


@pytest.mark.parametrize("window", [32, 0])
def test_an_arrival_is_taken_at_once_by_the_puller_the_pull_would_choose(redis_url, tiny_model,
                                                                          arun, window):
    """Router-made ids with nothing waiting: r0 pulled first, both have a seat.
    A warm arrival goes at once to r1, which holds its prefix, with affinity, to
    r0 (the oldest Pull) without; a cold one then to the one with a seat left.
    With only r0 pulling, a warm arrival waits for r1 with affinity (it is
    queued, and popped by r1's Pull), and is taken by r0 at once without."""
    async def scenario():
        cfg = make_config(redis_url, tiny_model, pull_affinity_window=window, **HITS_DECIDE)
        async with running_router(cfg) as app:
            # The reaper's probe (a pop each tick while a replica has a seat) makes an
            # arrival in the moment its pop is in flight queued and popped, not taken
            # at arrival; only the arrival path is under test here.
            app.scheduler.probe_shared_queue = lambda: None
            reps = await cached_pair(app)
            r0, r1 = reps["r0"], reps["r1"]
            r0.pull(1)
            await asyncio.sleep(0.05)
            r1.pull(1)
            await wait_until(lambda: app.lease.alone and app.writer.pending == 0 and all(
                app.scheduler.credit_of(r).requests == 1 for r in ("r0", "r1")))
            await asyncio.sleep(0.2)   # the pops the Pulls woke found the queue empty
            warm, cold, warm2 = with_shared([1]), [8] * 20, with_shared([2])

            def prompts_of(replica):
                return [list(a.prompt_token_ids) for a in replica.rec.assignments]

            async with client(app.address) as stub:
                tasks = await submit_in_order(app, stub, [request(warm, 4)])
                tasks += await submit_in_order(app, stub, [request(cold, 4)])
                holder, other = (r1, r0) if window else (r0, r1)
                assert (prompts_of(holder), prompts_of(other)) == ([warm], [cold])
                assert value(app, "quadriga_pull_picks_total", reason="arrival") == 2
                await asyncio.gather(*tasks)
                await wait_until(lambda: app.writer.pending == 0)
                r0.pull(1)
                await wait_until(lambda: app.scheduler.credit_of("r0").requests == 1)
                await asyncio.sleep(0.2)
                tasks = await submit_in_order(app, stub, [request(warm2, 4)])
                if window:
                    await asyncio.sleep(0.3)
                    assert prompts_of(r0) == [cold] and len(prompts_of(r1)) == 1
                    r1.pull(1)
                    await wait_until(lambda: len(prompts_of(r1)) == 2)
                    assert prompts_of(r1)[1] == warm2
                    assert value(app, "quadriga_pull_picks_total", reason="arrival") == 2
                else:
                    assert prompts_of(r0) == [warm, warm2]
                    assert value(app, "quadriga_pull_picks_total", reason="arrival") == 3
                await asyncio.gather(*tasks)
            await reps.close()

    arun(scenario())
