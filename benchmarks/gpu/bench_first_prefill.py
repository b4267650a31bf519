"""The first prefill of a process against its later ones (Llama-3.1-8B shape, dummy bf16,
as bench_engine starts it): start-up phases, then per length the first call's time and the
median of 5 more. Usage on the device (about a minute):
  source benchmarks/gpu/device-env.sh .carry
  python3 benchmarks/gpu/bench_first_prefill.py --out $OUT/first_prefill_h200.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine as be  # noqa: E402

from replica_worker import LLM, SamplingParams  # noqa: E402
from replica_worker.engine.model_runner import _Chunk  # noqa: E402
from replica_worker.engine.sequence import Sequence  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    be.OUT = Path(args.out)
    torch.set_num_threads(1)
    model_dir = be.write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
              scheduler="sarathi", chunk_size=8192, max_num_seqs=256, gpu_memory_utilization=0.9)
    runner = llm.engine.runner
    be.RESULTS["startup_s"] = runner.startup_seconds
    be.RESULTS["prefill_kernels"] = getattr(runner.backend, "prefill_kernels", None)
    rng = random.Random(1)
    rows = []
    for n in (512, 2048, 1000):
        seq = Sequence(f"p{n}", [rng.randrange(128000) for _ in range(n)], SamplingParams(temperature=0.0))
        seq.block_ids = list(range(-(-n // runner.block_size)))
        chunks = [_Chunk(seq, n)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.execute(chunks)
        first = time.perf_counter() - t
        later = []
        for _ in range(5):
            t = time.perf_counter()
            runner.execute(chunks)
            later.append(time.perf_counter() - t)
        row = {"prompt_tokens": n, "first_call_ms": first * 1e3, "later_median_ms": statistics.median(later) * 1e3}
        print(row, flush=True)
        rows.append(row)
    be.RESULTS["rows"] = rows
    be.save()


if __name__ == "__main__":
    main()
