"""Aggregation, goodput, CSV and load timeline on hand-built requests."""

import csv

import pytest

from benchmarks.common import percentile
from benchmarks.harness.loadgen import Result
from benchmarks.harness.metrics import SLO, aggregate, inflight_timeline, meets_slo, write_csv, write_summary_csv


def make(i, sent, first, gaps, replica="r0", out=None, error="", planned=None):
    """planned: its arrival in the plan (default: sent on time)."""
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    n = len(times)
    r = Result(i, 10, out or n, sent if planned is None else planned, sent_s=sent, first_token_s=first, finished_s=times[-1],
               token_times=times, output_tokens=n, finish_reason="error" if error else "length", error=error,
               server_queue_s=0.01 * i, server_sched_delay_s=0.02 * i, server_ttft_s=first - sent,
               server_e2e_s=times[-1] - sent, replica=replica, preemptions=i % 2, requeues=0)
    return r


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([], 50) is None


def test_goodput_rule():
    slo = SLO(ttft_s=0.5, tbt_s=0.1, tbt_stat="max")
    assert meets_slo(0.4, [0.05, 0.1], slo)
    assert not meets_slo(0.6, [0.05], slo)
    assert not meets_slo(0.4, [0.05, 0.2], slo)
    assert meets_slo(0.4, [0.05] * 99 + [0.2], SLO(0.5, 0.1, "mean"))


def test_aggregate():
    rs = [make(0, 0.0, 0.2, [0.05] * 4, "r0"),     # ttft .2, e2e .4, 5 tokens
          make(1, 1.0, 1.5, [0.1] * 4, "r1"),      # ttft .5, e2e .9
          make(2, 2.0, 3.0, [0.3] * 4, "r0"),      # ttft 1.0 (misses), e2e 2.2, tbt .3 (misses)
          make(3, 2.5, 2.6, [], "r1", error="boom")]
    s = aggregate(rs, 5.0, SLO(ttft_s=0.6, tbt_s=0.15, tbt_stat="max"))
    assert s["requests"] == 4 and s["finished"] == 3 and s["errors"] == 1 and s["error_samples"] == ["boom"]
    assert s["duration_s"] == pytest.approx(4.2)          # first send 0.0 to last finish 4.2
    assert s["throughput_req_s"] == pytest.approx(3 / 4.2)
    assert s["throughput_output_tok_s"] == pytest.approx(15 / 4.2)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_s"]["max"] == pytest.approx(1.0)
    assert s["e2e_s"]["p50"] == pytest.approx(0.9)
    assert s["tbt_s"]["n"] == 12 and s["tbt_s"]["p50"] == pytest.approx(0.1)
    assert s["e2e_per_output_token_s"]["p50"] == pytest.approx(0.9 / 5)
    assert s["goodput"]["share"] == pytest.approx(2 / 4) and s["goodput"]["req_s"] == pytest.approx(2 / 4.2)
    assert s["requests_per_replica"] == {"r0": 2, "r1": 1}
    assert s["preemptions"] == 1
    assert s["server_scheduling_delay_s"]["p50"] == pytest.approx(0.02)


def test_latency_counts_from_the_planned_arrival():
    """A load generator that sent late (its loop stalled) does not shorten the
    TTFT a client arriving on time sees; the lag is reported beside it."""
    late = make(0, 0.3, 0.35, [0.05], planned=0.0)
    s = aggregate([late], 1.0, SLO(ttft_s=1.0, tbt_s=1.0, tbt_stat="max"))
    assert late.ttft == pytest.approx(0.35) and late.e2e == pytest.approx(0.4)
    assert s["ttft_s"]["max"] == pytest.approx(0.35) and s["send_lag_s"]["max"] == pytest.approx(0.3)


def test_csv_and_timeline(tmp_path):
    rs = [make(0, 0.0, 0.2, [0.1] * 8, "r0"), make(1, 0.5, 0.6, [0.1] * 2, "r1"),
          make(2, 0.5, 0.7, [0.1] * 2, "r0")]
    rows = list(csv.DictReader(open(write_csv(tmp_path / "x.csv", rs))))
    assert len(rows) == 3 and rows[1]["replica"] == "r1" and float(rows[0]["ttft_s"]) == pytest.approx(0.2)
    assert float(rows[0]["tbt_max_s"]) == pytest.approx(0.1)
    times, series = inflight_timeline(rs, step=0.1)
    assert times[:3] == pytest.approx([0.0, 0.1, 0.2])
    # At 0.72 s: r0 runs requests 0 (0.2-1.0 s) and 2 (0.7-0.9 s), r1 runs request 1 (0.6-0.8 s).
    assert series["r0"][7] == 2 and series["r1"][7] == 1
    assert series["r0"][1] == 0 and series["r1"][4] == 0
    assert max(series["r0"]) == 2 and max(series["r1"]) == 1


def test_summary_csv_has_every_distribution_and_rate(tmp_path):
    rs = [make(0, 0.0, 0.2, [0.1] * 8, "r0"), make(1, 0.5, 0.6, [0.1] * 2, "r1"),
          make(2, 0.5, 0.7, [0.3] * 2, "r0", error="boom")]
    s = aggregate(rs, 2.0, SLO())
    rows = {r["metric"]: r for r in csv.DictReader(open(write_summary_csv(tmp_path / "s.csv", s)))}
    for name in ("ttft_s", "tbt_s", "e2e_s", "e2e_per_output_token_s", "server_queue_s",
                 "server_scheduling_delay_s", "server_ttft_s", "server_e2e_s"):
        assert name in rows, name
    assert int(rows["ttft_s"]["n"]) == 2
    assert float(rows["ttft_s"]["p50"]) == pytest.approx(s["ttft_s"]["p50"])
    assert float(rows["tbt_s"]["p99"]) == pytest.approx(s["tbt_s"]["p99"])
    assert rows["errors"]["mean"] == "1" and rows["finished"]["mean"] == "2"
    assert float(rows["throughput_req_s"]["mean"]) == pytest.approx(s["throughput_req_s"])
    assert float(rows["goodput_share"]["mean"]) == pytest.approx(s["goodput"]["share"])

