"""The router tier benchmark's arithmetic: the per-router ladder, and when a
failover run counts p99 TTFT as back to normal."""

from argparse import Namespace

from benchmarks.router.tier import ladder_rates
from benchmarks.router.tier_report import failover_summary


def _records(ttft_of, end_s: float, step_s: float = 0.01):
    """One exact request every step_s seconds, its TTFT given by its send time."""
    recs, t = [], 0.0
    while t < end_s:
        recs.append(dict(sent=t, ttft=ttft_of(t), end=0.5, exact=True, error="", duplicated=0,
                         broken=False))
        t += step_s
    return recs


def test_ladder_rates_scale_with_routers_only_when_per_router():
    args = Namespace(rates=[100.0, 150.0], rates_per_router=True)
    assert ladder_rates(args, 1) == [100.0, 150.0]
    assert ladder_rates(args, 4) == [400.0, 600.0]
    args.rates_per_router = False
    assert ladder_rates(args, 4) == [100.0, 150.0]


def test_failover_recovers_when_p99_returns_under_the_bound():
    # 40 ms before the kill at 2 s, 400 ms for a second after it, 40 ms again from 3 s.
    recs = _records(lambda t: 0.4 if 2.0 <= t < 3.0 else 0.04, end_s=6.0)
    s = failover_summary(dict(records=recs, killed_at_s=2.0, offered_rps=100.0), window_s=0.5)
    assert s["lost"] == 0
    assert s["recovered_within_run"] is True
    assert s["recovery_s"] == 1.0
    assert round(s["p99_ttft_before_kill_ms"]) == 40


def test_failover_still_high_at_the_end_is_not_recovered():
    recs = _records(lambda t: 0.04 if t < 2.0 else 0.4, end_s=6.0)
    s = failover_summary(dict(records=recs, killed_at_s=2.0, offered_rps=100.0), window_s=0.5)
    assert s["recovered_within_run"] is False
    # Bad up to the last whole window (5.5-6.0 s is partial and left out).
    assert s["recovery_s"] == 3.5


def test_one_last_good_window_is_not_a_recovery():
    """Back under the bound only in the last whole window: the run ended before
    a recovery could show (the rule wants RECOVERY_HOLD_S of normal windows)."""
    recs = _records(lambda t: 0.4 if 2.0 <= t < 5.0 else 0.04, end_s=6.0)
    s = failover_summary(dict(records=recs, killed_at_s=2.0, offered_rps=100.0), window_s=0.5)
    assert s["recovery_s"] == 3.0
    assert s["recovered_within_run"] is False


def test_a_request_that_failed_counts_as_lost():
    recs = _records(lambda t: 0.04, end_s=1.0)
    recs[3]["exact"] = False
    s = failover_summary(dict(records=recs, killed_at_s=0.5, offered_rps=100.0), window_s=0.5)
    assert s["lost"] == 1


def test_router_benchmark_percentiles_are_numpys():
    """Not the value one rank high (p99 of 1..100 was 100, the median of 1..4 was 3)."""
    from benchmarks.router.overhead import pct

    assert pct(list(range(1, 101)), 0.99) == 99.01 and pct([1, 2, 3, 4], 0.5) == 2.5
