"""Capacity search's bracketing and bisection against a synthetic monotone system."""

import pytest

from benchmarks.harness.capacity import probe_passes, search


@pytest.mark.parametrize("true_cap,initial", [(7.3, 2.0), (0.3, 2.0), (50.0, 1.0), (2.0, 2.0)])
def test_finds_capacity_of_monotone_system(true_cap, initial):
    calls = []

    def probe(rate):
        calls.append(rate)
        return rate <= true_cap

    best, history = search(probe, initial, max_probes=20, rel_tol=0.01)
    assert best <= true_cap and best >= true_cap * 0.99
    assert len(history) == len(calls) <= 20
    assert all(ok == (r <= true_cap) for r, ok in history)


def test_bounded_probes_return_best_pass_so_far():
    best, history = search(lambda r: r <= 7.3, 2.0, max_probes=4, rel_tol=0.0)
    assert len(history) == 4
    assert best == 6.0          # 2 pass, 4 pass, 8 fail, 6 pass
    assert [r for r, _ in history] == [2.0, 4.0, 8.0, 6.0]


def test_nothing_passes():
    best, history = search(lambda r: False, 1.0, max_probes=5)
    assert best is None and len(history) == 5


def test_probe_rule():
    s = {"errors": 0, "tbt_s": {"p99": 0.05}, "server_scheduling_delay_s": {"p50": 1.0}}
    assert probe_passes(s, 0.1)[0]
    assert not probe_passes({**s, "tbt_s": {"p99": 0.2}}, 0.1)[0]
    assert not probe_passes({**s, "server_scheduling_delay_s": {"p50": 2.5}}, 0.1)[0]
    assert not probe_passes({**s, "errors": 1}, 0.1)[0]
    assert probe_passes({**s, "throughput_req_s": 9.5}, 0.1, offered_rate=10)[0]
    assert not probe_passes({**s, "throughput_req_s": 6.0}, 0.1, offered_rate=10)[0]
