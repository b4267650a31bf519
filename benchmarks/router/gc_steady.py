"""Garbage-collection pauses of a router under load, router trees in turn in one
run: Quadriga's OpenAI path as benchmarks/router/peers.py drives it (wrk POSTing
/v1/completions, Redis, 2 scripted replicas that answer at once), one long wrk
run a tree, with gc_trace/sitecustomize.py on the router's path. Reports the
collections that started inside wrk's run, by generation: how many, their
summed and longest pause.

    .venv/bin/python -m benchmarks.router.gc_steady --side freeze=. --side before=/tmp/tree \\
        --concurrency 32 --max-tokens 64 --duration 60
"""

from __future__ import annotations

import argparse
import glob
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.router import peer_routers as peers  # noqa: E402
from benchmarks.router.local_router import LocalRouter, cpu_seconds  # noqa: E402
from benchmarks.router.mock_openai_backend import MODEL  # noqa: E402
from benchmarks.router.peers import PROMPT  # noqa: E402
from benchmarks.router.wrk_runner import WrkSettings, find_wrk, run_wrk  # noqa: E402

TRACE = ROOT / "benchmarks/router/gc_trace"


def read_trace(prefix: str) -> list[tuple[int, float, float]]:
    rows = []
    for path in glob.glob(prefix + ".*"):
        for line in Path(path).read_text().splitlines():
            gen, start, pause = line.split()
            rows.append((int(gen), float(start), float(pause)))
    return sorted(rows, key=lambda r: r[1])


def summarize(rows, start: float, end: float) -> dict:
    inside = [r for r in rows if start <= r[1] <= end]
    out = {}
    for gen in (0, 1, 2):
        pauses = [p for g, _, p in inside if g == gen]
        out[f"gen{gen}"] = {"collections": len(pauses), "summed_ms": round(sum(pauses), 1),
                            "longest_ms": round(max(pauses), 2) if pauses else 0.0}
    out["gen2_pauses_ms"] = [round(p, 2) for g, _, p in inside if g == 2]
    return out


def measure(name: str, tree: Path, a, work: Path) -> dict:
    prefix = str(work / name)
    # A copy outside this tree: LocalRouter points this tree's paths at a router_tree's.
    trace = work / "gc_trace"
    trace.mkdir(exist_ok=True)
    (trace / "sitecustomize.py").write_text((TRACE / "sitecustomize.py").read_text())
    env = {"QUADRIGA_GC_TRACE": prefix, "PYTHONPATH": str(trace)}
    with LocalRouter(work / f"{name}-stack", replicas=2, http=True, model_name=MODEL,
                     router_env=env, router_tree=tree) as lr:
        url = f"http://127.0.0.1:{lr.http_port}"
        peers.wait_until_serving(url, lr.router, MODEL, PROMPT)
        peers.post_chat(url, MODEL, PROMPT, 1, timeout=180)   # transformers' tokenizer loaded
        settings = WrkSettings(a.concurrency, a.max_tokens, a.duration, a.wrk_threads, MODEL, PROMPT)
        run_wrk(find_wrk(None), url, WrkSettings(a.concurrency, a.max_tokens, 2, a.wrk_threads,
                                                 MODEL, PROMPT))   # warm-up
        cpu0, start = cpu_seconds(lr.router.pid), time.monotonic()
        row = run_wrk(find_wrk(None), url, settings)
        end, cpu1 = time.monotonic(), cpu_seconds(lr.router.pid)
    lat = row["latency_us"]["percentiles"]
    return {"name": name, "tree": str(tree), "requests_per_s": round(row["requests_per_s"], 1),
            "p50_ms": lat["50"] / 1e3, "p99_ms": lat["99"] / 1e3, "p99_9_ms": lat["99.9"] / 1e3,
            "errors": row["error_count"],
            "router_cpu_ms_per_request": round((cpu1 - cpu0) / max(row["requests"], 1) * 1e3, 3),
            **summarize(read_trace(prefix), start, end)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", action="append", required=True, metavar="NAME=TREE")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--duration", type=int, default=60)
    p.add_argument("--wrk-threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_gc_steady.json"))
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gc-steady-"))
    sides = []
    for spec in a.side:
        name, _, tree = spec.partition("=")
        sides.append(measure(name, Path(tree).resolve(), a, work))
        print(json.dumps({k: v for k, v in sides[-1].items() if k != "tree"}))
    out = {"command": "python -m benchmarks.router.gc_steady " + shlex.join(argv or sys.argv[1:]),
           "definitions": {"genN": "collections of generation N that started during the measured "
                                   "wrk run, with their summed and longest pause (gc.callbacks)",
                           "p50_ms, p99_ms, p99_9_ms": "wrk's latency percentiles of that run"},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sides": sides}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
