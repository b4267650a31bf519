"""Per-call cost of pieces on the router's per-request path, each beside what it
replaced, in one process, sides alternating over repeats:

  metrics   prometheus_client's Counter.inc, labels(...).inc and Histogram.observe
            against router/loop_metrics.py's (about ten updates a request)
  json      json.dumps (Starlette's JSONResponse settings) against pydantic_core's
            to_json, on a completion's answer body and on a request's sampling fields
  tokenize  tokenizers' encode(...).ids against encode_batch_fast([...])[0].ids on
            benchmarks/router/peers.py's prompt, with the tiny model's tokenizer
            (process CPU, so a thread pool's share would count)

    .venv/bin/python -m benchmarks.router.hot_path_pieces --out benchmarks/results/router_hot_path_pieces.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: E402
from pydantic_core import to_json  # noqa: E402

from benchmarks.router.peers import PROMPT  # noqa: E402
from router.loop_metrics import LoopCounter, LoopHistogram  # noqa: E402

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ANSWER = {"id": "cmpl-" + "ab" * 16, "object": "text_completion", "created": 1765000000,
          "model": "mock-model",
          "choices": [{"index": 0, "text": "<7>", "logprobs": None, "finish_reason": "length"}],
          "usage": {"prompt_tokens": 36, "completion_tokens": 1, "total_tokens": 37}}
SAMPLING = {"max_tokens": 1, "temperature": 0.0}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_call_us(fn, calls: int) -> float:
    """Process CPU a call, in microseconds."""
    for _ in range(min(calls // 10, 2000)):
        fn()
    start = cpu_s()
    for _ in range(calls):
        fn()
    return (cpu_s() - start) / calls * 1e6


def metric_sides():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    c_ref, c = Counter("q_a_total", "a", registry=theirs), LoopCounter("q_a_total", "a", registry=ours)
    l_ref = Counter("q_b_total", "b", ["k"], registry=theirs).labels("x")
    lab = LoopCounter("q_b_total", "b", ["k"], registry=ours).labels("x")
    h_ref = Histogram("q_c_seconds", "c", buckets=BUCKETS, registry=theirs)
    h = LoopHistogram("q_c_seconds", "c", buckets=BUCKETS, registry=ours)
    return {
        "counter_inc": (c_ref.inc, c.inc),
        "labelled_child_inc": (l_ref.inc, lab.inc),
        "histogram_observe_0.03": (lambda: h_ref.observe(0.03), lambda: h.observe(0.03)),
        "histogram_observe_7": (lambda: h_ref.observe(7.0), lambda: h.observe(7.0)),
    }


def json_sides():
    dumps = lambda o: json.dumps(o, ensure_ascii=False, allow_nan=False, indent=None,  # noqa: E731
                                 separators=(",", ":")).encode()
    compact = json.JSONEncoder(separators=(",", ":"))
    return {
        "answer_body": (lambda: dumps(ANSWER), lambda: to_json(ANSWER, inf_nan_mode="null")),
        "sampling_fields": (lambda: compact.encode(SAMPLING), lambda: to_json(SAMPLING).decode()),
    }


def tokenize_sides():
    from common.tiny_model import build_tokenizer_and_config
    from common.tokenizer import load_encoder

    folder = Path(tempfile.mkdtemp()) / "model"
    build_tokenizer_and_config(folder)
    backend = load_encoder(str(folder))
    a = backend.encode(PROMPT, add_special_tokens=True).ids
    b = backend.encode_batch_fast([PROMPT], add_special_tokens=True)[0].ids
    assert a == b, "encode_batch_fast gave other ids"
    return {"peers_prompt": (lambda: backend.encode(PROMPT, add_special_tokens=True).ids,
                             lambda: backend.encode_batch_fast([PROMPT], add_special_tokens=True)[0].ids)}


SIDES = {"metrics": ("prometheus_client", "loop_metrics", metric_sides, 200_000),
         "json": ("json.dumps", "pydantic_core.to_json", json_sides, 100_000),
         "tokenize": ("encode", "encode_batch_fast", tokenize_sides, 20_000)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every call count")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_hot_path_pieces.json"))
    a = p.parse_args(argv)
    rows = []
    for group, (before, after, make, calls) in SIDES.items():
        for piece, (old, new) in make().items():
            n = max(1000, int(calls * a.scale))
            runs = {before: [], after: []}
            for rep in range(a.repeats):
                order = [(before, old), (after, new)] if rep % 2 == 0 else [(after, new), (before, old)]
                for name, fn in order:
                    runs[name].append(per_call_us(fn, n))
            med_old, med_new = statistics.median(runs[before]), statistics.median(runs[after])
            rows.append({"group": group, "piece": piece, "calls_per_run": n,
                         "before": before, "after": after,
                         "before_us": [round(x, 3) for x in runs[before]],
                         "after_us": [round(x, 3) for x in runs[after]],
                         "before_median_us": round(med_old, 3), "after_median_us": round(med_new, 3),
                         "ratio_median": round(med_new / med_old, 3)})
            print(f"{group:9s} {piece:24s} {before:18s} {med_old:7.2f} us  {after:22s} "
                  f"{med_new:7.2f} us  x{med_new / med_old:.2f}  "
                  f"(spread {min(runs[before]):.2f}-{max(runs[before]):.2f} / "
                  f"{min(runs[after]):.2f}-{max(runs[after]):.2f})")
    out = {"command": "python -m benchmarks.router.hot_path_pieces " + shlex.join(argv or sys.argv[1:]),
           "machine": f"{platform.node()}, {platform.processor() or platform.machine()}",
           "python": platform.python_version(),
           "definitions": {"*_us": "process CPU (user+sys) per call, microseconds; one value a "
                                   "repeat, the two sides alternating and the order turned each "
                                   "repeat",
                           "ratio_median": "after's median / before's median"},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
