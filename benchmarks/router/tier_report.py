"""What benchmarks/router/tier.py reports, from the load generator's records
(tier_load.py): a rate's summary, and a failover run's."""

from __future__ import annotations

from benchmarks.router.overhead import pct

# How long p99 TTFT must stay back to normal, before the run ends, to count as recovered.
RECOVERY_HOLD_S = 2.0

DEFINITIONS = {
    "completed_rps": "requests completed with their exact output / the arrival window (first to "
                     "last send)",
    "sustained": "no request lost, the last one finished within 2 s + 2x the median e2e of the "
                 "last send (no backlog built up), p99 added TTFT <= --added-limit-ms",
    "ttft": "client send -> first token at the client",
    "added_ttft": "client TTFT minus the replica's own share (router's TTFT - scheduling delay: "
                  "first scheduled on the replica -> its first token at the router): the client "
                  "and router hops, admission, the queue wait for a seat, the pop and the Assign, "
                  "and for a request accepted by another router than its replica's, the event "
                  "stream hop",
    "cores_busy": "CPU seconds each server process used during the rate's run (user + sys, all "
                  "its threads) / the run's wall time: Redis (one core at most for its commands), "
                  "each router (null once killed), all simulated replicas together (sims) and the "
                  "busiest simulator process (busiest_sim); clients: each load generator process's "
                  "own CPU over its run / its run's length. A process near 1.0 that cannot use "
                  "more binds the rate: a router or Redis is a finding, a simulator or load "
                  "generator is the benchmark's own limit (give it more processes)",
    "per_request": "the live routers' totals over the run / requests sent: replica stream "
                   "messages in (steps, pulls, heartbeats), messages out to replicas (Assigns, "
                   "Acks, Cancels), client stream messages, and Redis round trips",
    "lost": "requests that did not finish with the exact simulated output (the rule of "
            "replica_worker/sim/runner.py)",
    "duplicated_tokens": "tokens a client stream delivered at an offset it already had (0 by "
                         "construction: the client skips a replay after checking it equals what "
                         "it delivered, and a replay that differs fails the request, so it is lost)",
    "replayed_tokens": "tokens routers sent again after a re-attach, checked equal and skipped",
    "send_lag_p99_ms": "how late the load generator sent its requests (TTFT and e2e count from "
                       "the planned send, so a late send adds to them rather than hiding)",
    "recovery_s": "failover: from the kill to the start of the first window after which every "
                  "window's p99 TTFT is within 1.5x (+50 ms) of the p99 before the kill",
    "recovered_within_run": "failover: true only when the windows after recovery_s cover at least "
                            f"{RECOVERY_HOLD_S:g} s of the run (a last good window alone proves nothing)",
}


def _ms(values, q):
    return pct(values, q) * 1e3 if values else None


def _added(rec) -> float | None:
    if rec.get("ttft") is None or "server_ttft" not in rec:
        return None
    return max(0.0, rec["ttft"] - (rec["server_ttft"] - rec["sched_delay"]))


def rate_summary(result: dict, added_limit_ms: float) -> dict:
    recs = result["records"]
    done = [r for r in recs if r["exact"] and not r["error"]]
    lost = len(recs) - len(done)
    first = min((r["sent"] for r in recs), default=0.0)
    window = max((r["sent"] for r in recs), default=0.0) - first
    finished = max((r["sent"] + r["end"] for r in done), default=0.0) - first
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    added = [a for a in map(_added, done) if a is not None]
    completed_rps = len(done) / window if window > 0 else 0.0
    row = dict(offered_rps=result["offered_rps"], sent=len(recs), completed=len(done), lost=lost,
               completed_rps=completed_rps,
               duplicated_tokens=sum(r["duplicated"] for r in recs),
               replayed_tokens=sum(r.get("replayed", 0) for r in recs),
               broken_streams=sum(bool(r["broken"]) for r in recs),
               ttft_p50_ms=_ms(ttft, 0.5), ttft_p99_ms=_ms(ttft, 0.99),
               added_ttft_p50_ms=_ms(added, 0.5), added_ttft_p99_ms=_ms(added, 0.99),
               e2e_p50_ms=_ms([r["end"] for r in done], 0.5),
               e2e_p99_ms=_ms([r["end"] for r in done], 0.99),
               send_lag_p99_ms=_ms([r["send_lag"] for r in recs if "send_lag" in r], 0.99),
               errors=sorted({r["error"] for r in recs if r["error"]})[:5])
    drain = 2.0 + 2 * (row["e2e_p50_ms"] or 0.0) / 1e3
    row["sustained"] = bool(recs) and lost == 0 and finished <= window + drain \
        and (row["added_ttft_p99_ms"] or 0.0) <= added_limit_ms
    return row


def _window_p99(recs, start: float, width: float) -> float | None:
    ttft = [r["ttft"] for r in recs if start <= r["sent"] < start + width and r["ttft"] is not None]
    return pct(ttft, 0.99) if ttft else None


def failover_summary(result: dict, window_s: float) -> dict:
    """Lost and duplicated, and how long p99 TTFT (by send time, windows of
    window_s) stays above its level before the kill."""
    recs, kill = result["records"], result["killed_at_s"]
    summary = rate_summary(result, float("inf"))
    before = [r["ttft"] for r in recs if r["sent"] < kill and r["ttft"] is not None]
    normal = pct(before, 0.99) if before else None
    windows = []
    t = 0.0
    end = max((r["sent"] for r in recs), default=0.0)
    while t + window_s <= end:   # whole windows only: a last partial one holds a few stragglers
        windows.append((t, _window_p99(recs, t, window_s)))
        t += window_s
    recovery = None
    if normal is not None:
        bound = 1.5 * normal + 0.05
        after = [(t, p) for t, p in windows if t + window_s > kill]
        bad = [t for t, p in after if p is None or p > bound]
        last_bad = max(bad, default=None)
        recovery = 0.0 if last_bad is None else round(max(0.0, last_bad + window_s - kill), 3)
    # Back to normal only if it stayed so for RECOVERY_HOLD_S before the run ended.
    recovered = recovery is not None and bool(windows) and \
        windows[-1][0] + window_s - (kill + recovery) >= RECOVERY_HOLD_S - 1e-9
    summary.update(killed_at_s=kill, p99_ttft_before_kill_ms=normal * 1e3 if normal else None,
                   recovery_s=recovery, recovered_within_run=recovered,
                   ttft_p99_windows_ms=[(round(t, 2), None if p is None else round(p * 1e3, 1))
                                        for t, p in windows],
                   requeued=sum(1 for r in recs if r.get("requeues")))
    return summary
