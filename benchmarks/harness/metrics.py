"""Per-request records and aggregates (the seed's MetricsStore, from the client's side)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import percentile, summarize


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tbt_s: float = 0.1
    tbt_stat: str = "p99"          # which per-request TBT statistic must meet tbt_s: p99 | max | mean
    sched_delay_p50_s: float = 2.0  # capacity: median scheduling delay bound (Sarathi-Serve)
    ttft_p99_s: float | None = None  # capacity: p99 TTFT bound too, when set


def request_tbt_stat(tbts: list[float], stat: str) -> float:
    if not tbts:
        return 0.0
    if stat == "max":
        return max(tbts)
    if stat == "mean":
        return sum(tbts) / len(tbts)
    return percentile(tbts, 99)


def meets_slo(ttft: float | None, tbts: list[float], slo: SLO) -> bool:
    return ttft is not None and ttft <= slo.ttft_s and request_tbt_stat(tbts, slo.tbt_stat) <= slo.tbt_s


def _stats(values) -> dict:
    return summarize([v for v in values if v is not None])


def arrival_window_rates(results) -> tuple[float | None, float | None]:
    """(offered, admitted) req/s over the arrival window, blind to the output-length tail.

    offered: the requests' planned arrivals, first to last (the realised Poisson rate,
    which strays from the nominal one by about 1/sqrt(n)). admitted: the same requests
    from the first arrival to the last first token. A system that keeps up admits at
    the offered rate; an overloaded one admits at its own rate while its queue grows.
    """
    planned = [r.scheduled_s for r in results]
    firsts = [r.first_token_s for r in results if r.first_token_s is not None]
    if len(planned) < 2 or max(planned) <= min(planned):
        return None, None
    offered = (len(planned) - 1) / (max(planned) - min(planned))
    admitted = ((len(firsts) - 1) / (max(firsts) - min(planned))
                if len(firsts) >= 2 and max(firsts) > min(planned) else None)
    return offered, admitted


def aggregate(results, wall_s: float, slo: SLO) -> dict:
    """Aggregates over finished requests; `results` are loadgen.Result (or alike)."""
    ok = [r for r in results if r.ok]
    exact = [r for r in ok if r.output_tokens == r.output_len]
    tbts = [g for r in ok for g in r.tbts]
    span = wall_s
    if ok:
        span = max(r.finished_s for r in ok) - min(r.sent_s for r in results)
    span = span if span and span > 0 else float("nan")
    good = [r for r in ok if meets_slo(r.ttft, r.tbts, slo)]
    offered, admitted = arrival_window_rates(results)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    return {
        "requests": len(results),
        "finished": len(ok),
        "exact_output_length": len(exact),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "duration_s": span,
        "throughput_req_s": len(ok) / span,
        "throughput_output_tok_s": out_tokens / span,
        "throughput_total_tok_s": (out_tokens + prompt_tokens) / span,
        "offered_req_s": offered,
        "admitted_req_s": admitted,
        "goodput": {"slo": slo.__dict__, "share": len(good) / len(results) if results else None,
                    "req_s": len(good) / span},
        "ttft_s": _stats(r.ttft for r in ok),   # from the planned arrival (loadgen.Result.ttft)
        "send_lag_s": _stats(getattr(r, "send_lag", None) for r in results if r.sent_s),
        "tbt_s": summarize(tbts),
        "e2e_s": _stats(r.e2e for r in ok),
        "e2e_per_output_token_s": _stats(r.e2e / r.output_tokens for r in ok if r.output_tokens),
        "server_queue_s": _stats(r.server_queue_s for r in ok),
        "server_scheduling_delay_s": _stats(r.server_sched_delay_s for r in ok),
        "server_ttft_s": _stats(r.server_ttft_s for r in ok),
        "server_e2e_s": _stats(r.server_e2e_s for r in ok),
        "preemptions": sum(r.preemptions for r in ok),
        "requeues": sum(r.requeues for r in ok),
        "requests_per_replica": dict(sorted(per_replica.items())),
        "prompt_tokens": _stats(r.prompt_len for r in results),
        "output_tokens": _stats(r.output_len for r in results),
    }


CSV_FIELDS = ["index", "prompt_len", "output_len", "output_tokens", "finish_reason", "error", "replica",
              "scheduled_s", "sent_s", "first_token_s", "finished_s", "ttft_s", "e2e_s",
              "e2e_per_token_s", "tbt_p50_s", "tbt_p99_s", "tbt_max_s", "server_queue_s",
              "server_sched_delay_s", "server_ttft_s", "server_e2e_s", "preemptions", "requeues",
              "server_prompt_tokens"]


def write_csv(path: Path, results) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            t = r.tbts
            e2e = r.e2e
            w.writerow([r.index, r.prompt_len, r.output_len, r.output_tokens, r.finish_reason, r.error,
                        r.replica, _f(r.scheduled_s), _f(r.sent_s), _f(r.first_token_s), _f(r.finished_s),
                        _f(r.ttft), _f(e2e), _f(e2e / r.output_tokens if e2e and r.output_tokens else None),
                        _f(percentile(t, 50)), _f(percentile(t, 99)), _f(max(t) if t else None),
                        _f(r.server_queue_s), _f(r.server_sched_delay_s), _f(r.server_ttft_s),
                        _f(r.server_e2e_s), r.preemptions, r.requeues, r.server_prompt_tokens])
    return path


SUMMARY_CSV_FIELDS = ["metric", "n", "mean", "p50", "p90", "p99", "max"]


def write_summary_csv(path: Path, summary: dict) -> Path:
    """The aggregates as a table: one row per latency distribution (n, mean, p50, p90,
    p99, max), then one row per rate or count, its value under `mean`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scalars = ["requests", "finished", "errors", "exact_output_length", "duration_s", "throughput_req_s",
               "throughput_output_tok_s", "throughput_total_tok_s", "offered_req_s", "admitted_req_s",
               "preemptions", "requeues"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_CSV_FIELDS)
        for key, value in summary.items():
            if isinstance(value, dict) and "p99" in value:
                w.writerow([key, value.get("n", 0), *(_f(value.get(k)) for k in SUMMARY_CSV_FIELDS[2:])])
        goodput = summary.get("goodput", {})
        rows = [(k, summary.get(k)) for k in scalars]
        rows += [("goodput_share", goodput.get("share")), ("goodput_req_s", goodput.get("req_s"))]
        for key, value in rows:
            w.writerow([key, "", _f(value) if isinstance(value, float) else value, "", "", "", ""])
    return path


def _f(x) -> str:
    return "" if x is None else f"{x:.6f}"


def inflight_timeline(results, step: float = 0.25) -> tuple[list[float], dict[str, list[int]]]:
    """Requests in flight per replica from the client's view: a request counts on its
    replica from its first token to its last (the replica is known from the final message)."""
    spans = [(r.first_token_s, r.finished_s, r.replica) for r in results
             if r.ok and r.first_token_s is not None and r.replica]
    if not spans:
        return [], {}
    end = max(s[1] for s in spans)
    n = int(end / step) + 2
    times = [i * step for i in range(n)]
    series = {rep: [0] * n for rep in sorted({s[2] for s in spans})}
    for a, b, rep in spans:
        for i in range(int(a / step), min(n, int(b / step) + 1)):
            series[rep][i] += 1
    return times, series
