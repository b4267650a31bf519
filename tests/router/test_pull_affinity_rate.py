"""Pull affinity's exchange rate between cached tokens and waiting: the puller's
measured prefill speed. The policy on its own, with a real index and a clock
set by hand; and the rate as the router measures it from replicas' steps."""

import dataclasses

import pytest

from common.block_hash import BlockHasher
from router.config import RouterConfig
from router.prefix.index import PrefixIndex
from router.prefix.matcher import PrefixMatcher
from router.replicas.prefill_rate import PrefillRate
from router.scheduling.policies import PolicySettings, make_policy
from router.scheduling.policies import pull as pull_policy
from tests.router.test_pull_affinity_bound import Context, Replica, Req

H16 = BlockHasher(16)
SHARED = list(range(300, 364))   # 64 tokens: 4 blocks, all reusable by a longer prompt
NOW = 1000.0


def pull_with_weight(monkeypatch, weight: float):
    monkeypatch.setattr(pull_policy, "time", type("Clock", (), {"time": staticmethod(lambda: NOW)}))
    index = PrefixIndex(1000)
    index.replace("r0", H16, [])
    index.replace("r1", H16, H16.hashes(SHARED))
    ctx = Context(PrefixMatcher(index))
    return make_policy("pull", ctx, PolicySettings(affinity_max_wait=30.0, affinity_wait_weight=weight))


@pytest.fixture
def policy(monkeypatch):
    # Weight 1 (not the default): a second of waiting is worth exactly the puller's
    # prefill rate in cached tokens, so the numbers below read directly.
    return pull_with_weight(monkeypatch, 1.0)


def queue(policy, *reqs):
    policy.context.queue = list(reqs)


def test_a_second_of_waiting_weighs_the_pullers_prefill_rate_in_cached_tokens(policy):
    r1 = Replica("r1", 1000.0)          # 64 cached tokens are worth 64 ms of waiting
    warm = Req("warm", SHARED + [1, 2], 0, NOW)
    queue(policy, Req("cold", [9] * 30, 0, NOW - 0.010), warm)
    assert [r.id for r, _ in policy.choose(r1, "pending", 1, None, []).picks] == ["warm"]
    queue(policy, Req("cold", [9] * 30, 0, NOW - 0.100), warm)
    assert [r.id for r, _ in policy.choose(r1, "pending", 1, None, []).picks] == ["cold"]
    slow = Replica("r1", 100.0)          # a slower prefill makes the same hit worth 640 ms
    assert [r.id for r, _ in policy.choose(slow, "pending", 1, None, []).picks] == ["warm"]


def test_the_wait_weight_scales_what_a_second_of_waiting_is_worth(monkeypatch):
    default = {f.name: f.default for f in dataclasses.fields(RouterConfig)}["pull_affinity_wait_weight"]
    assert default == PolicySettings().affinity_wait_weight == 0.25   # the router takes the policy default
    policy = pull_with_weight(monkeypatch, default)
    r1 = Replica("r1", 1000.0)          # at 0.25, 64 cached tokens are worth 256 ms of waiting
    warm = Req("warm", SHARED + [1, 2], 0, NOW)
    queue(policy, Req("cold", [9] * 30, 0, NOW - 0.200), warm)
    assert [r.id for r, _ in policy.choose(r1, "pending", 1, None, []).picks] == ["warm"]
    queue(policy, Req("cold", [9] * 30, 0, NOW - 0.300), warm)
    assert [r.id for r, _ in policy.choose(r1, "pending", 1, None, []).picks] == ["cold"]
    r0 = Replica("r0", 1000.0)          # and work r1 holds is left to it for 256 ms
    queue(policy, Req("warm", SHARED + [1, 2], 0, NOW - 0.056))
    assert policy.choose(r0, "pending", 1, None, ["r1"]).retry_in == pytest.approx(0.200)


def test_work_another_live_replica_holds_is_left_until_it_has_waited_its_lead(policy):
    r0 = Replica("r0", 1000.0)          # holds nothing; r1 holds 64 tokens of it: 64 ms
    queue(policy, Req("warm", SHARED + [1, 2], 0, NOW - 0.014))
    left = policy.choose(r0, "pending", 1, None, ["r1"])
    assert left.picks == [] and left.retry_in == pytest.approx(0.050)
    queue(policy, Req("warm", SHARED + [1, 2], 0, NOW - 0.070))
    assert [r.id for r, _ in policy.choose(r0, "pending", 1, None, ["r1"]).picks] == ["warm"]
    # With no other live replica holding anything, the head is popped as under FIFO.
    queue(policy, Req("warm", SHARED + [1, 2], 0, NOW - 0.014))
    assert policy.choose(r0, "pending", 1, None, []) is None


def test_a_replica_not_yet_measured_counts_at_the_stated_default(policy):
    unmeasured = Replica("r0", None)
    lead_s = 64 / pull_policy.UNMEASURED_PREFILL_TOKENS_PER_S
    queue(policy, Req("warm", SHARED + [1], 0, NOW))
    assert policy.choose(unmeasured, "pending", 1, None, ["r1"]).retry_in == pytest.approx(lead_s)


def test_the_prefill_rate_counts_prefill_heavy_steps_only():
    rate = PrefillRate()
    assert not rate.observe(num_tokens=32, batch_size=32, step_time_s=0.01)   # decodes
    assert not rate.observe(num_tokens=40, batch_size=1, step_time_s=0.01)    # under 64 tokens
    assert not rate.observe(num_tokens=100, batch_size=30, step_time_s=0.01)  # 3 a sequence
    assert rate.tokens_per_s is None
    assert rate.observe(num_tokens=512, batch_size=8, step_time_s=0.1)
    assert rate.tokens_per_s == pytest.approx(5120)
    rate.observe(num_tokens=1024, batch_size=8, step_time_s=0.1)
    assert rate.tokens_per_s == pytest.approx(5120 + 0.2 * (10240 - 5120))
    assert not rate.observe(num_tokens=512, batch_size=1, step_time_s=0.0)


@pytest.mark.parametrize("balance_abs, r1_load, left_to_r1", [
    (0, 10_000, True),     # off (the default): the holder is waited for whatever its load
    (100, 10_000, False),  # r1 is 10,000 tokens over r0 (more than 100, and more than 1.5x)
    (100, 90, True),       # within balance_abs of r0
    (100, 160, True),      # over by more than 100, but not 1.5 times r0's 100
])
def test_the_balance_term_stops_waiting_for_a_much_busier_holder(monkeypatch, balance_abs, r1_load,
                                                                 left_to_r1):
    monkeypatch.setattr(pull_policy, "time", type("Clock", (), {"time": staticmethod(lambda: NOW)}))
    index = PrefixIndex(1000)
    index.replace("r0", H16, [])
    index.replace("r1", H16, H16.hashes(SHARED))
    ctx = Context(PrefixMatcher(index))
    loads = {"r0": 0 if r1_load == 10_000 else 100, "r1": r1_load}
    ctx.load_of = loads.__getitem__
    policy = make_policy("pull", ctx, PolicySettings(affinity_max_wait=30.0, affinity_wait_weight=1.0,
                                                     affinity_balance_abs=balance_abs,
                                                     affinity_balance_rel=1.5))
    queue(policy, Req("warm", SHARED + [1, 2], 0, NOW - 0.014))   # r1 leads by 64 ms of r0's prefill
    choice = policy.choose(Replica("r0", 1000.0), "pending", 1, None, ["r1"])
    if left_to_r1:
        assert choice.picks == [] and choice.retry_in == pytest.approx(0.050)
    else:
        assert [r.id for r, _ in choice.picks] == ["warm"]
