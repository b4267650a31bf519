"""Decode step times on one GPU at several contexts: bench_engine.py's decode section
(Llama-3.1-8B shape, dummy bf16 weights) run once per context.

    python3 benchmarks/gpu/bench_decode_contexts.py --out $OUT/engine_h200_decode_contexts.json

bench_engine.py measures decode at context 1024 only, where per-sequence and
per-KV-token costs cannot be told apart; with these rows beside it in
benchmarks/results/gpu/, `python -m replica_worker.sim.cost_model fit` fits
the cost model's per_kv_token_s instead of fixing it from the bandwidth.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

CONTEXTS = (256, 1024, 4096)
BATCHES = (1, 32, 128, 256)


def load_bench_engine():
    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).with_name("bench_engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    be = load_bench_engine()
    be.OUT = Path(args.out)
    model_dir = be.write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b-shape")
    ceil = be.ceilings()
    holder: dict = {}
    be.section("startup")(be.startup)(str(model_dir), max(BATCHES), 2048, holder)
    if "llm" not in holder:
        return
    num_blocks = holder["llm"].engine.runner.num_blocks
    for ctx in CONTEXTS:
        be.CTX = ctx  # decode() reads the context from the module
        blocks_per_seq = -(-(ctx + 1) // holder["llm"].engine.runner.block_size)
        batches = [b for b in BATCHES if b * blocks_per_seq <= num_blocks]
        be.section(f"decode_context_{ctx}")(be.decode)(holder, batches, ceil, args.steps, False)


if __name__ == "__main__":
    main()
