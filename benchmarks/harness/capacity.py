"""Capacity as Sarathi-Serve defines it: the highest Poisson rate whose run keeps
p99 TBT within the SLO and median scheduling delay within 2 s (and, when given,
p99 TTFT within a bound), by bracketing and binary search over a bounded number
of probes (each probe a fixed request count)."""

from __future__ import annotations

from typing import Callable

# A probe keeps up when it admits at least this share of the offered rate.
KEEP_UP = 0.9


def probe_passes(summary: dict, tbt_slo_s: float, sched_delay_p50_s: float = 2.0,
                 offered_rate: float | None = None, keep_up: float = KEEP_UP,
                 ttft_p99_s: float | None = None) -> tuple[bool, str]:
    """The pass rule on an aggregate from metrics.aggregate.

    A short probe of an overloaded system can end before its queue makes the
    median scheduling delay exceed the bound, so a probe also fails when the
    system admits less than keep_up of the offered rate: it is not keeping up.
    Both rates are over the arrival window when the summary has them
    (metrics.arrival_window_rates): end-to-end throughput would also count the
    drain of the longest outputs after the last arrival, which fails short
    probes of a system that keeps up.
    """
    if summary["errors"]:
        return False, f"{summary['errors']} errors"
    admitted = summary.get("admitted_req_s") or summary.get("throughput_req_s")
    offered = summary.get("offered_req_s") or offered_rate
    if offered and admitted is not None and admitted < keep_up * offered:
        return False, f"admitted {admitted:.2f} of {offered:.2f} req/s offered"
    tbt = summary["tbt_s"]["p99"]
    sched = summary["server_scheduling_delay_s"]["p50"]
    if tbt is None or tbt > tbt_slo_s:
        return False, f"p99 TBT {tbt} > {tbt_slo_s}"
    if sched is None or sched > sched_delay_p50_s:
        return False, f"p50 scheduling delay {sched} > {sched_delay_p50_s}"
    ttft = summary["ttft_s"]["p99"] if ttft_p99_s is not None else None
    if ttft_p99_s is not None and (ttft is None or ttft > ttft_p99_s):
        return False, f"p99 TTFT {ttft} > {ttft_p99_s}"
    return True, f"p99 TBT {tbt:.4f} s, p50 scheduling delay {sched:.3f} s" + (
        f", p99 TTFT {ttft:.3f} s" if ttft is not None else "")


def search(probe: Callable[[float], bool], initial: float, *, max_probes: int = 8,
           rel_tol: float = 0.05, min_rate: float = 1e-3, max_rate: float = 1e6,
           growth: float = 2.0) -> tuple[float | None, list]:
    """probe(rate) -> passes. Brackets from `initial` (multiplying by `growth` while it
    passes, dividing while it fails), then bisects until the bracket is within rel_tol
    or the probes are spent. A growth below 2 suits an initial rate that is already a
    good guess (an overloaded probe is the slowest kind). Returns (highest passing rate
    or None, [(rate, passed), ...])."""
    if growth <= 1.0:
        raise ValueError("growth must exceed 1")
    history: list[tuple[float, bool]] = []

    def run(rate: float) -> bool:
        ok = bool(probe(rate))
        history.append((rate, ok))
        return ok

    lo, hi = None, None  # highest pass, lowest fail
    rate = initial
    while len(history) < max_probes:
        if run(rate):
            lo = rate
            if hi is not None:
                break
            if rate * growth > max_rate:
                return lo, history
            rate *= growth
        else:
            hi = rate
            if lo is not None:
                break
            if rate / growth < min_rate:
                return None, history
            rate /= growth
    while lo is not None and hi is not None and len(history) < max_probes and (hi - lo) / hi > rel_tol:
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return lo, history
