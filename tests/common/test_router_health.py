"""common.router_health: which router to dial, for clients and replica workers."""

import random
import time
from collections import Counter

from common.router_health import RouterHealth
from tests.worker.fakes import FakeEngine, make_worker

ROUTERS = ["r0:1", "r1:1", "r2:1", "r3:1"]


def test_failures_in_a_row_pass_a_router_over_longer_until_it_serves():
    health = RouterHealth(down_for=0.2)
    health.failed("r0:1")
    health.failed("r0:1")   # the second in a row: 0.4 s
    time.sleep(0.25)
    assert not health.usable("r0:1") and health.usable("r1:1")
    assert health.first(ROUTERS) != "r0:1"
    health.served("r0:1")
    assert health.usable("r0:1") and health.first(ROUTERS) == "r0:1"


def test_when_a_pass_over_ends_one_caller_tries_the_router_and_the_others_wait_for_it():
    # A router that still does not answer (frozen) would otherwise hold up every
    # new request meant for it until the first of them fails.
    health = RouterHealth(down_for=0.05, max_down_for=0.05)
    health.failed("r0:1")
    time.sleep(0.06)
    assert health.first(ROUTERS) == "r0:1"            # the trial
    assert [health.first(ROUTERS) for _ in range(20)].count("r0:1") == 0
    health.served("r0:1")                             # it answered: cleared for all
    assert health.first(ROUTERS) == "r0:1" and health.first(ROUTERS) == "r0:1"
    health.failed("r0:1")
    time.sleep(0.06)
    assert health.first(ROUTERS) == "r0:1"            # the next trial
    health.failed("r0:1")                             # failed: passed over again
    assert health.first(ROUTERS) != "r0:1"
    assert health.first(["r1:1", "r0:1"]) == "r1:1"   # a router never failed is no trial


def test_new_work_meant_for_a_router_that_is_down_spreads_over_the_others():
    # A load generator starts request i at router i mod 4: with r1 down, the
    # requests meant for it must not all land on r2 (r2 would carry double).
    health = RouterHealth()
    health.failed("r1:1")
    rng = random.Random(7)
    picks = Counter()
    for i in range(400):
        order = ROUTERS[i % 4:] + ROUTERS[:i % 4]
        picks[health.first(order, rng)] += 1
    assert picks["r1:1"] == 0
    assert all(90 < picks[r] < 180 for r in ("r0:1", "r2:1", "r3:1")), picks   # 133 each; in order r2 gets 200
    assert health.first(ROUTERS[2:] + ROUTERS[:2], rng) == "r2:1"   # a live first router keeps its work


def test_after_a_failure_another_live_router_at_random_and_no_wait():
    health = RouterHealth()
    health.failed("r0:1")
    picks = Counter()
    for seed in range(300):
        address, wait = health.after(ROUTERS, "r0:1", random.Random(seed))
        assert not wait
        picks[address] += 1
    assert set(picks) == {"r1:1", "r2:1", "r3:1"}
    assert min(picks.values()) > 60   # about 100 each; in list order all 300 would be r1


def test_with_every_router_down_the_next_in_order_after_a_wait():
    health = RouterHealth()
    for r in ROUTERS:
        health.failed(r)
    assert health.after(ROUTERS, "r3:1", random.Random(0)) == ("r0:1", True)
    single = ["only:1"]
    assert health.after(single, "only:1", random.Random(0)) == ("only:1", True)


def test_replicas_of_a_router_that_died_spread_over_the_others():
    moved = Counter()
    for i in range(40):
        worker = make_worker(FakeEngine(), replica_id=f"sim{i}", router=",".join(ROUTERS))
        assert worker._next_router() == "r0:1"
        worker._health.failed("r0:1")   # what a broken session records
        moved[worker._next_router()] += 1
    assert set(moved) == {"r1:1", "r2:1", "r3:1"} and min(moved.values()) >= 5, moved
