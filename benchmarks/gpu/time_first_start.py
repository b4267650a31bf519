"""Where a process's first engine start goes, stage by stage (Llama-3.1-8B shape, dummy
bf16, as the GPU benches start it): imports, CUDA's first context, LLM() and its own
phases, then the engine's first steps (one prefill of four 2048-token prompts, a few
decode steps), each stage's seconds printed as it ends. Run it twice on one machine to
see what a warm cache saves. Usage on the device:
  source benchmarks/gpu/device-env.sh .carry
  python3 benchmarks/gpu/time_first_start.py --out $OUT/first_start.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()
STAGES: list[tuple[str, float]] = []   # (stage, seconds since the stage before it ended)


def stage(name: str) -> None:
    now = time.perf_counter()
    took = now - T0 - sum(s for _, s in STAGES)
    STAGES.append((name, took))
    print(f"{now - T0:8.1f}s  {name}: {took:.2f}s", flush=True)


def sample_stacks(path: str, every: float) -> None:
    """Writes every other thread's stack into `path` every `every` seconds, in
    faulthandler's dump format (stack_summary.py reads it), from a Python
    thread: faulthandler's own timed dump reads the frames from a C thread
    without the GIL, and with it a start on an H100 died of a segmentation
    fault at the second dump (runs without it never did). A sample waits
    while another thread holds the GIL."""
    out = open(path, "w")   # kept open for the process's life

    def run() -> None:
        me, n = threading.get_ident(), 0
        while True:
            time.sleep(every)
            n += 1
            lines = [f"Timeout ({n * every:.0f} s)!"]
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                lines.append(f"Thread 0x{ident:016x} (most recent call first):")
                lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}'
                          for f in reversed(traceback.extract_stack(frame))]
                lines.append("")
            out.write("\n".join(lines) + "\n")
            out.flush()

    threading.Thread(target=run, name="stack-sampler", daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stacks", help="dump every thread's stack into this file every --stack-every "
                    "seconds: where a slow stage spends its time")
    ap.add_argument("--stack-every", type=float, default=5.0)
    args = ap.parse_args()
    if args.stacks:
        sample_stacks(args.stacks, args.stack_every)
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)9.0fms %(name)s: %(message)s")
    import torch
    stage("import torch")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    stage("CUDA context")
    # Kernels built for the GPU's own arch load as they are; any other arch's PTX is
    # compiled by the driver on first use, into its cache (CUDA_CACHE_PATH, default
    # ~/.nv/ComputeCache, at most CUDA_CACHE_MAXSIZE bytes): a first start's suspect.
    cuda_build = {"torch_arch_list": torch.cuda.get_arch_list(),
                  "device_capability": list(torch.cuda.get_device_capability()),
                  "torch_cuda": torch.version.cuda,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}}
    print(json.dumps(cuda_build), flush=True)
    import flashinfer  # noqa: F401
    stage("import flashinfer")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_engine as be
    from replica_worker import LLM, SamplingParams
    stage("import the engine")
    model_dir = be.write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
              scheduler="sarathi", chunk_size=8192, max_num_seqs=256, gpu_memory_utilization=0.9)
    stage("LLM()")
    engine = llm.engine
    rng = random.Random(7)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i in range(4):
        engine.add_request(f"s{i}", [rng.randrange(128000) for _ in range(2048)], params)
    engine.step()
    torch.cuda.synchronize()
    stage("first engine step (prefill of 4 x 2048)")
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    stage("decode steps to the end")
    seeded = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1, max_tokens=4)
    engine.add_request("sampled", [rng.randrange(128000) for _ in range(512)], seeded)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    stage("first sampled request")
    result = {"stages_s": dict(STAGES), "startup_phases_s": engine.runner.startup_seconds,
              "total_s": time.perf_counter() - T0, "gpu": torch.cuda.get_device_name(),
              "cuda_build": cuda_build,
              "command": be.RESULTS["command"], "commit": be.RESULTS["commit"]}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["startup_phases_s"]))


if __name__ == "__main__":
    main()
