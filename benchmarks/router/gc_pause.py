"""The pause of a full (generation 2) garbage collection in a process holding what
a router holds after its start (its modules, grpc, FastAPI, transformers'
tokenizer of a model with a chat template), before and after gc.freeze(), which
the router calls once started (router/server.py). Python runs a full collection
on its own when enough objects have outlived the younger generations; each one
walks every tracked object, so at steady state it is a loop stall as long as
the collect timed here.

    .venv/bin/python -m benchmarks.router.gc_pause --out benchmarks/results/router_gc_pause.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def timed_collects(times: int) -> list[float]:
    out = []
    for _ in range(times):
        start = time.perf_counter()
        gc.collect()
        out.append(round((time.perf_counter() - start) * 1e3, 2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collects", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_gc_pause.json"))
    a = p.parse_args(argv)
    import router.frontends.openai_http  # noqa: F401  (FastAPI, uvicorn, pydantic)
    import router.server  # noqa: F401  (grpc, redis, the router's modules)
    from common.tiny_model import build_tokenizer_and_config
    from common.tokenizer import load_tokenizer

    folder = Path(tempfile.mkdtemp()) / "model"
    build_tokenizer_and_config(folder)
    load_tokenizer(str(folder))   # transformers and torch, as chat templates need
    tracked = len(gc.get_objects())
    before = timed_collects(a.collects)
    gc.freeze()
    after = timed_collects(a.collects)
    row = {"tracked_objects": tracked, "frozen": gc.get_freeze_count(),
           "full_collect_ms_before_freeze": before, "full_collect_ms_after_freeze": after,
           "median_before_ms": statistics.median(before), "median_after_ms": statistics.median(after)}
    print(json.dumps(row))
    out = {"command": "python -m benchmarks.router.gc_pause " + shlex.join(argv or sys.argv[1:]),
           "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"), **row}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
