"""What benchmarks/router/peers.py writes beside the raw wrk results: the
machine and versions, the per-setting summary with its spread over repeats,
and the targets checked against sglang-router."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from collections import defaultdict
from importlib import metadata

from benchmarks.common import tree_commit
from benchmarks.router.local_router import ROOT

# Quadriga's HTTP path against sglang-router: at most this many times its added
# p50 at the lowest concurrency, at least this share of its req/s at the highest.
P50_RATIO_MAX = 2.0
RPS_SHARE_MIN = 0.4
QUADRIGA, REFERENCE = "quadriga-http", "sglang-router"
COMPANION_CPU = ("mock_cpu_ms_per_request", "redis_cpu_ms_per_request")


def _read(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _command_output(cmd) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def environment(args, wrk_version: str, peer_env, load_before, load_after) -> dict:
    from common.redis_server import redis_server_binary

    return {
        "machine": {
            "cpus": os.cpu_count(), "cpu_model": _read("/proc/cpuinfo", "model name"),
            "memory": _read("/proc/meminfo", "MemTotal"), "kernel": platform.release(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "note": args.machine_note,
        },
        "versions": {
            "quadriga_commit": tree_commit(ROOT),
            "python": sys.version.split()[0],
            **{name: peer_env.version(name) if peer_env else None
               for name in ("sglang-router", "vllm-router")},
            "wrk": wrk_version,
            "redis_server": _command_output([redis_server_binary(), "--version"]),
            **{dist: _version(dist) for dist in ("fastapi", "starlette", "pydantic", "uvicorn",
                                                 "httptools", "uvloop", "grpcio", "hiredis")},
        },
    }


def _spread(values) -> dict:
    values = [round(v, 4) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_repeat": values}


def _key(row) -> tuple:
    return row["target"], row["concurrency"], row["max_tokens"]


def summarize(raw: list[dict]) -> tuple[list[dict], dict]:
    direct = {(r["repeat"], r["concurrency"], r["max_tokens"]): r for r in raw if r["target"] == "direct"}
    groups = defaultdict(list)
    for r in raw:
        groups[_key(r)].append(r)
    summary = []
    for (target, c, n), rows in groups.items():
        p50 = [r["latency_us"]["percentiles"]["50"] / 1e3 for r in rows]
        p99 = [r["latency_us"]["percentiles"]["99"] / 1e3 for r in rows]
        entry = {"target": target, "concurrency": c, "max_tokens": n,
                 "p50_ms": _spread(p50), "p99_ms": _spread(p99),
                 "requests_per_s": _spread([r["requests_per_s"] for r in rows]),
                 "cpu_ms_per_request": _spread([r["cpu_ms_per_request"] for r in rows]),
                 **{k: _spread([r[k] for r in rows]) for k in COMPANION_CPU if k in rows[0]},
                 "errors": sum(r["error_count"] for r in rows)}
        if target != "direct":
            base = [direct[(r["repeat"], c, n)]["latency_us"]["percentiles"] for r in rows]
            entry["added_p50_ms"] = _spread([x - b["50"] / 1e3 for x, b in zip(p50, base)])
            entry["added_p99_ms"] = _spread([x - b["99"] / 1e3 for x, b in zip(p99, base)])
        summary.append(entry)
    return summary, check_targets(summary)


def check_targets(summary: list[dict]) -> dict:
    by = {(e["target"], e["concurrency"], e["max_tokens"]): e for e in summary}
    if not any(t == QUADRIGA for t, _, _ in by) or not any(t == REFERENCE for t, _, _ in by):
        return {"checked": False, "why": f"needs both {QUADRIGA} and {REFERENCE} measured"}
    lo = min(c for _, c, _ in by)
    hi = max(c for _, c, _ in by)
    checks = {"checked": True, "p50_ratio_max": P50_RATIO_MAX, "rps_share_min": RPS_SHARE_MIN,
              "rows": []}
    for n in sorted({n for _, _, n in by}):
        q, ref = by[(QUADRIGA, lo, n)], by[(REFERENCE, lo, n)]
        qa, ra = q["added_p50_ms"]["median"], ref["added_p50_ms"]["median"]
        ratio = qa / ra if ra > 0 else None
        q_hi, ref_hi = by[(QUADRIGA, hi, n)], by[(REFERENCE, hi, n)]
        share = q_hi["requests_per_s"]["median"] / ref_hi["requests_per_s"]["median"]
        checks["rows"].append({
            "max_tokens": n,
            f"added_p50_ms_c{lo}": {QUADRIGA: qa, REFERENCE: ra},
            "p50_ratio": None if ratio is None else round(ratio, 2),
            "p50_met": ratio is not None and ratio <= P50_RATIO_MAX,
            f"requests_per_s_c{hi}": {QUADRIGA: q_hi["requests_per_s"]["median"],
                                      REFERENCE: ref_hi["requests_per_s"]["median"]},
            "rps_share": round(share, 3), "rps_met": share >= RPS_SHARE_MIN,
        })
    return checks


def _fmt(s: dict | None, digits: int = 3) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(summary: list[dict], checks: dict) -> None:
    print(f"\n{'target':14s} {'c':>3s} {'n':>3s}  {'p50 ms':>24s}  {'p99 ms':>24s}  "
          f"{'added p50 ms':>24s}  {'added p99 ms':>24s}  {'req/s':>26s}  cpu/req ms: router backend redis")
    for e in sorted(summary, key=lambda e: (e["concurrency"], e["max_tokens"], e["target"])):
        print(f"{e['target']:14s} {e['concurrency']:3d} {e['max_tokens']:3d}  {_fmt(e['p50_ms']):>24s}  "
              f"{_fmt(e['p99_ms']):>24s}  {_fmt(e.get('added_p50_ms')):>24s}  "
              f"{_fmt(e.get('added_p99_ms')):>24s}  {_fmt(e['requests_per_s'], 0):>26s}  "
              f"{e['cpu_ms_per_request']['median']:.3f} "
              + " ".join(f"{e[k]['median']:.3f}" if k in e else "-" for k in COMPANION_CPU))
    if not checks.get("checked"):
        print("targets not checked:", checks.get("why"))
        return
    for row in checks["rows"]:
        print(f"n={row['max_tokens']}: added p50 ratio to {REFERENCE} {row['p50_ratio']} "
              f"(target <= {P50_RATIO_MAX}: {'met' if row['p50_met'] else 'NOT met'}); "
              f"req/s share {row['rps_share']} (target >= {RPS_SHARE_MIN}: "
              f"{'met' if row['rps_met'] else 'NOT met'})")
