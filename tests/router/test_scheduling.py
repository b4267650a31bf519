"""Pull, priority, round-robin and least-outstanding placement."""

import asyncio
import contextlib

from common.pb.quadriga.v1 import generation_pb2 as gpb
from tests.support.router_harness import (Replicas, client, collect, make_config, request,
                                          running_router, tokens_of)
from tests.support.scripted_replica import expected_tokens


async def wait_until(predicate, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def submit_in_order(app, stub, reqs):
    """Starts streams one by one, each accepted before the next is sent."""
    tasks = []
    for r in reqs:
        before = app.metrics.accepted.value
        tasks.append(asyncio.create_task(collect(stub, r)))
        await wait_until(lambda: app.metrics.accepted.value > before)
    return tasks


@contextlib.asynccontextmanager
async def one_replica_pulling_by_hand(redis_url, model, reqs):
    """A router with one replica that pulls only when told, and reqs submitted in
    arrival order; yields the replica and, on leaving, waits for every request."""
    async with running_router(make_config(redis_url, model)) as app:
        reps = Replicas(app.address, app.limits.vocab_size)
        rep = await reps.add("r", auto_pull=False)
        async with client(app.address) as stub:
            tasks = await submit_in_order(app, stub, reqs)
            yield rep
            await asyncio.gather(*tasks)
        await reps.close()


def assigned_ids(replica):
    return [a.request_id for a in replica.rec.assignments]


def test_pull_earliest_first_and_only_what_was_asked(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            puller = await reps.add("puller", auto_pull=False)
            idle = await reps.add("idle", auto_pull=False)
            async with client(app.address) as stub:
                reqs = [request([i + 1, 2], 3, request_id=f"q{i}") for i in range(5)]
                tasks = await submit_in_order(app, stub, reqs)
                puller.pull(2)
                await wait_until(lambda: len(puller.rec.assignments) == 2)
                await asyncio.sleep(0.2)
                assert assigned_ids(puller) == ["q0", "q1"]
                assert idle.rec.assignments == []
                puller.pull(3)
                await wait_until(lambda: len(puller.rec.assignments) == 5)
                assert assigned_ids(puller) == ["q0", "q1", "q2", "q3", "q4"]
                for i, t in enumerate(tasks):
                    assert tokens_of(await t) == expected_tokens([i + 1, 2], 3, vocab)
                assert idle.rec.assignments == []
            await reps.close()

    arun(scenario())


def test_pull_token_credit_is_head_of_line_and_overrun_by_one_prompt(redis_url, tiny_model, arun):
    async def scenario():
        reqs = [request([1] * 8, 2, request_id="big0"), request([1] * 5, 2, request_id="mid"),
                request([1], 2, request_id="tiny")]
        async with one_replica_pulling_by_hand(redis_url, tiny_model, reqs) as rep:
            # big0 (8) leaves 2 tokens of credit; mid (5) starts on them, overrunning
            # the grant; then the credit is spent: tiny waits (no skipping ahead).
            rep.pull(3, 10)
            await wait_until(lambda: len(assigned_ids(rep)) == 2)
            await asyncio.sleep(0.2)
            assert assigned_ids(rep) == ["big0", "mid"]
            # The overrun (3) is not carried into the next grant.
            rep.pull(1, 1)
            await wait_until(lambda: len(assigned_ids(rep)) == 3)
            assert assigned_ids(rep) == ["big0", "mid", "tiny"]

    arun(scenario())


def test_a_seat_granted_alone_adds_no_tokens(redis_url, tiny_model, arun):
    """Pull.max_prompt_tokens present and 0 adds seats only; absent means no limit."""
    async def scenario():
        reqs = [request([1] * 3, 2, request_id="a"), request([1] * 3, 2, request_id="b")]
        async with one_replica_pulling_by_hand(redis_url, tiny_model, reqs) as rep:
            rep.pull(1, 3)  # a takes the seat and every token
            await wait_until(lambda: assigned_ids(rep) == ["a"])
            rep.grant_seats(1)
            await asyncio.sleep(0.3)
            assert assigned_ids(rep) == ["a"], "a seat without tokens must not lift the token limit"
            rep.pull(0, 1)
            await wait_until(lambda: assigned_ids(rep) == ["a", "b"])

    arun(scenario())


def test_outstanding_pull_is_served_on_arrival(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r", auto_pull=False)
            rep.pull(1)
            await asyncio.sleep(0.1)
            async with client(app.address) as stub:
                msgs = await collect(stub, request([5, 6], 4))
            assert len(rep.rec.pulls) == 1  # no second Pull was needed
            assert tokens_of(msgs) == expected_tokens([5, 6], 4, app.limits.vocab_size)
            await reps.close()

    arun(scenario())


def test_credit_inside_a_step_is_applied_after_its_deltas(redis_url, tiny_model, arun):
    """A one-seat replica that grants each freed seat inside the step that
    freed it keeps being assigned, as one that sends a Pull after the step
    (what a replica does for a router that did not offer step_credit)."""
    async def scenario(step_credit: bool):
        async with running_router(make_config(redis_url, tiny_model)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            rep = await reps.add("r", capacity=1, step_credit=step_credit)
            assert rep.rec.registered[-1].step_credit
            prompts = [[i + 1, 7] for i in range(6)]
            async with client(app.address) as stub:
                results = await asyncio.gather(*(collect(stub, request(p, 2)) for p in prompts))
            assert [tokens_of(m) for m in results] == [expected_tokens(p, 2, vocab) for p in prompts]
            await reps.close()
            return rep.rec

    rec = arun(scenario(True))
    assert len(rec.pulls) == 1 and len(rec.step_pulls) == 6, (rec.pulls, rec.step_pulls)
    rec = arun(scenario(False))
    assert len(rec.pulls) == 7 and not rec.step_pulls, (rec.pulls, rec.step_pulls)


def test_priority_then_arrival_order(redis_url, tiny_model, arun):
    async def scenario():
        reqs = [request([1], 1, request_id="low", priority=-1), request([2], 1, request_id="mid1"),
                request([3], 1, request_id="high", priority=5), request([4], 1, request_id="mid2")]
        async with one_replica_pulling_by_hand(redis_url, tiny_model, reqs) as rep:
            rep.pull(4)
            await wait_until(lambda: len(rep.rec.assignments) == 4)
            assert assigned_ids(rep) == ["high", "mid1", "mid2", "low"]

    arun(scenario())


def test_round_robin_rotates_over_live_replicas_and_redistributes(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, policy="round_robin")
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            for name in ("a", "b", "c"):
                await reps.add(name, auto_pull=False)
            async with client(app.address) as stub:
                reqs = [request([i + 1], 2, request_id=f"rr{i}") for i in range(6)]
                tasks = await submit_in_order(app, stub, reqs)
                queues = [app.table.requests[f"rr{i}"].queue for i in range(6)]
                assert queues == ["r:a", "r:b", "r:c", "r:a", "r:b", "r:c"]
                await reps.kill("b")
                await wait_until(lambda: app.registry.get("b") is None)
                # Forgotten whole: replica pods come and go under new names.
                assert "b" not in app.scheduler._own_work
                moved = {app.table.requests[r].queue for r in ("rr1", "rr4")}
                assert moved <= {"r:a", "r:c"}
                r = await app.store.redis.zcard(app.store.queue_key("r:b"))
                assert r == 0
                more = await submit_in_order(app, stub, [request([9], 2, request_id="x0"),
                                                         request([9], 2, request_id="x1")])
                assert {app.table.requests["x0"].queue, app.table.requests["x1"].queue} == {"r:a", "r:c"}
                reps["a"].pull(10)
                reps["c"].pull(10)
                for t in tasks + more:
                    assert (await t)[-1].finish_reason == gpb.FINISH_REASON_LENGTH
                served = {a.request_id: n for n in ("a", "c") for a in reps[n].rec.assignments}
                assert all(served[f"rr{i}"] == ("a" if i % 3 == 0 else "c") for i in (0, 2, 3, 5))
            await reps.close()

    arun(scenario())


def test_least_outstanding_picks_lightest(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, policy="least_outstanding")
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("a", auto_pull=False)
            await reps.add("b", auto_pull=False)
            async with client(app.address) as stub:
                reqs = [request([1] * 10, 300, request_id="heavy"),
                        request([1], 5, request_id="light1"),
                        request([1], 5, request_id="light2"),
                        request([1], 5, request_id="light3")]
                tasks = await submit_in_order(app, stub, reqs)
                where = {r: app.table.requests[r].queue for r in ("heavy", "light1", "light2", "light3")}
                assert where == {"heavy": "r:a", "light1": "r:b", "light2": "r:b", "light3": "r:b"}
                reps["a"].pull(10)
                reps["b"].pull(10)
                await asyncio.gather(*tasks)
                assert app.table.load_of("a") == 0
                assert app.table.load_of("b") == 0
            await reps.close()

    arun(scenario())


def test_stream_interval_coalesces(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r", step_delay=0.005)
            async with client(app.address) as stub:
                msgs = await collect(stub, request([3, 4], 10, stream_interval=4))
                default = await collect(stub, request([5], 3))
            assert tokens_of(msgs) == expected_tokens([3, 4], 10, app.limits.vocab_size)
            # The first token goes at once; after it, at least 4 tokens a message.
            assert all(len(m.token_ids) >= 4 for m in msgs[1:-1])
            assert len(msgs) <= 4
            assert "".join(m.text for m in msgs) == "".join(f"<{t}>" for t in tokens_of(msgs))
            # The replica is told the interval, the router's default when the client set none.
            intervals = [a.stream_interval for a in reps["r"].rec.assignments]
            assert intervals == [4, app.config.stream_interval]
            assert tokens_of(default) == expected_tokens([5], 3, app.limits.vocab_size)
            await reps.close()

    arun(scenario())


def test_stream_interval_never_delays_the_first_token(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r", step_delay=0.3)   # a token every 0.3 s
            async with client(app.address) as stub:
                msgs = await collect(stub, request([3, 4], 8, stream_interval=8))
            assert tokens_of(msgs) == expected_tokens([3, 4], 8, app.limits.vocab_size)
            # Waiting for 8 tokens would take 2.4 s; the first message leaves with the first.
            assert len(msgs[0].token_ids) < 4
            await reps.close()

    arun(scenario())


def test_a_pop_that_empties_the_shared_queue_spares_the_other_pullers_a_pop(redis_url, tiny_model, arun):
    """Each request alone in the queue costs one pop, not one per idle puller: the pop
    says how many are left, so the others do not pop a queue known to be empty.
    (Nothing is taken at arrival here, which would spare the pop itself.)"""

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, take_at_arrival=0)) as app:
            vocab = app.limits.vocab_size
            reps = Replicas(app.address, vocab)
            for name in ("a", "b", "c"):
                await reps.add(name)
            pops = []
            store_pop = app.scheduler.store.pop

            def counted(*args, **kw):
                pops.append(args[1])
                return store_pop(*args, **kw)

            app.scheduler.store.pop = counted
            # The reaper's probe of a queue thought empty (one pop a heartbeat, not a
            # request) would add pops with the test's duration on a busy machine.
            app.scheduler.probe_shared_queue = lambda: None
            async with client(app.address) as stub:
                for i in range(6):
                    out = await collect(stub, request([i + 1, 2], 2, request_id=f"s{i}"))
                    assert tokens_of(out) == expected_tokens([i + 1, 2], 2, vocab)
            assert len(pops) == 6, pops
            await reps.close()

    arun(scenario())
