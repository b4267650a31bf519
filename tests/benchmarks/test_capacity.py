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


def test_smaller_growth_brackets_near_a_good_guess():
    best, history = search(lambda r: r <= 11.0, 10.0, max_probes=4, rel_tol=0.0, growth=1.25)
    assert [r for r, _ in history] == [10.0, 12.5, 11.25, 10.625]
    assert best == 10.625
    with pytest.raises(ValueError):
        search(lambda r: True, 1.0, growth=1.0)


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


def test_keep_up_uses_the_arrival_window_when_known():
    s = {"errors": 0, "tbt_s": {"p99": 0.05}, "server_scheduling_delay_s": {"p50": 0.5},
         "throughput_req_s": 5.0}  # a long output tail after the last arrival
    assert probe_passes({**s, "offered_req_s": 9.0, "admitted_req_s": 8.8}, 0.1, offered_rate=10)[0]
    ok, why = probe_passes({**s, "offered_req_s": 9.0, "admitted_req_s": 6.0}, 0.1, offered_rate=10)
    assert not ok and "admitted 6.00 of 9.00" in why


def test_arrival_window_rates():
    from types import SimpleNamespace as R

    from benchmarks.harness.metrics import arrival_window_rates

    # 11 arrivals over 10 s; first tokens keep up until the last, admitted 1 s late.
    rs = [R(scheduled_s=float(i), first_token_s=i + 0.2) for i in range(10)]
    rs.append(R(scheduled_s=10.0, first_token_s=11.0))
    offered, admitted = arrival_window_rates(rs)
    assert offered == pytest.approx(1.0) and admitted == pytest.approx(10 / 11)
    assert arrival_window_rates(rs[:1]) == (None, None)


def _search_result(capacity, rates, slo=0.1):
    probes = [{"rate": r, "passed": r <= capacity,
               "summary": {"tbt_s": {"p99": slo * r / capacity}, "offered_req_s": r,
                           "admitted_req_s": r if r <= capacity else capacity,
                           "server_e2e_s": {"mean": 10.0}}} for r in rates]
    return {"kind": "capacity", "capacity_req_s": capacity, "rule": {"tbt_p99_s": slo}, "probes": probes}


def test_plot_capacity_overlays_searches(tmp_path, capsys):
    import json

    import matplotlib.image

    from benchmarks.harness.cli import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_search_result(4.0, [2, 4, 8, 6])))
    b.write_text(json.dumps(_search_result(9.0, [6, 9, 12])))
    out = tmp_path / "both.png"
    assert main(["plot-capacity", f"sarathi={a}", str(b), "--out", str(out)]) == 0
    assert matplotlib.image.imread(out).shape[1] > 500
    printed = capsys.readouterr().out
    assert "sarathi: capacity 4.0 req/s" in printed and "b: capacity 9.0 req/s" in printed
    # Little's law: 8 req/s offered, 4 admitted, 10 s each -> 40 in flight.
    assert "  8.000 req/s FAIL" in printed and "admitted/offered 0.50" in printed and "in flight 40" in printed

    other_slo = tmp_path / "c.json"
    other_slo.write_text(json.dumps(_search_result(5.0, [5], slo=0.05)))
    with pytest.raises(SystemExit, match="different rules"):
        main(["plot-capacity", str(a), str(other_slo), "--out", str(out)])
    not_a_search = tmp_path / "run.json"
    not_a_search.write_text(json.dumps({"kind": "run", "summary": {}}))
    with pytest.raises(SystemExit, match="not a capacity search"):
        main(["plot-capacity", str(not_a_search), "--out", str(out)])
    no_rule = tmp_path / "old.json"
    no_rule.write_text(json.dumps({k: v for k, v in _search_result(4.0, [4]).items() if k != "rule"}))
    with pytest.raises(SystemExit, match="no rule"):
        main(["plot-capacity", str(no_rule), "--out", str(out)])


def test_a_p99_ttft_bound_fails_a_probe_only_when_given():
    s = {"errors": 0, "tbt_s": {"p99": 0.05}, "server_scheduling_delay_s": {"p50": 0.5},
         "ttft_s": {"p99": 2.5}}
    assert probe_passes(s, 0.1)[0]
    ok, why = probe_passes(s, 0.1, ttft_p99_s=2.0)
    assert not ok and "p99 TTFT 2.5 > 2.0" in why
    assert probe_passes({**s, "ttft_s": {"p99": 1.5}}, 0.1, ttft_p99_s=2.0)[0]


def test_a_multi_turn_search_is_read_in_conversations_per_second(tmp_path, capsys):
    """A multi-turn rate starts conversations (each brings its turns): the listing
    says so, where a request rate would be read three or four times too low."""
    import json

    from benchmarks.harness.cli import main
    from benchmarks.harness.workload import WorkloadSpec, rate_unit

    chat = {**_search_result(4.0, [2, 4, 8]), "workload": {"workload": "multi-turn"}}
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    assert main(["plot-capacity", f"chat={tmp_path / 'chat.json'}", "--out", str(tmp_path / "c.png")]) == 0
    printed = capsys.readouterr().out
    assert "chat: capacity 4.0 conversations/s" in printed and "  8.000 conversations/s FAIL" in printed
    assert WorkloadSpec(workload="multi-turn").rate_unit == "conversations/s"
    assert rate_unit("shared-prefix") == rate_unit(None) == "req/s"
