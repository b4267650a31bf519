"""Prefill against the matmul rate, with the GPU's clock and power beside every phase.

The prefill share bench_engine and bench_async report divides by a matmul rate taken
from 20 GEMMs of 8192^3 (about 30 ms of work), while the prefill itself runs for
hundreds of milliseconds back to back. This measures both ways in one process, and
samples the SM clock, power and temperature (nvidia-smi, every 20 ms) so that each
phase's figure sits beside the clock it ran at:

  matmul_burst      the ceiling as bench_engine takes it (3 warm-up, 20 timed GEMMs)
  matmul_sustained  the same GEMM back to back for --sustain-s seconds, before the engine
  prefill_reps      one 2048-token prompt in one chunk (runner.execute, as bench_engine's
                    prefill), each repeat's wall time kept, back to back (and once with
                    --rest-s of idle before each repeat)
  prefill_engine    --prompts fresh prompts of 2048 queued at once through the engine
                    (8192-token steps, async scheduling), as bench_async's prefill
  matmul_beside     after each prefill phase, the GEMM back to back for as long as that
                    phase ran: the same power and heat, so the share of it is the
                    software's, not the clock's (--rounds rounds of both prefills)
  gaps              a profile of an engine run: the device's busy time against the wall
                    time, and the largest idle gaps between kernels

Usage on the device: source benchmarks/gpu/device-env.sh .carry
                     python3 benchmarks/gpu/bench_prefill_clock.py --out $OUT/prefill_clock.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_async as ba  # noqa: E402
import bench_engine as be  # noqa: E402

from replica_worker import LLM, SamplingParams  # noqa: E402
from replica_worker.engine.model_runner import _Chunk  # noqa: E402
from replica_worker.engine.sequence import Sequence  # noqa: E402

N = 2048
PHASES: list[dict] = []


class ClockLog:
    """nvidia-smi sampling the SM clock, power and temperature into a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=path.open("w"), stderr=subprocess.DEVNULL)

    def stop(self) -> list[tuple[float, float, float, float]]:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        rows = []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                rows.append((stamp, float(parts[1]), float(parts[2]), float(parts[3])))
            except (ValueError, IndexError):
                continue
        return rows


def phase(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.time()
            result = fn(*args, **kwargs)
            PHASES.append({"phase": name, "start": start, "end": time.time(), **result})
            print(PHASES[-1], flush=True)
            return result
        return run
    return wrap


def gemm_flops_per_s(seconds: list[float], m: int) -> float:
    return 2 * m**3 / statistics.median(seconds)


@phase("matmul_burst")
def matmul_burst() -> dict:
    return {"TFLOPs": be.ceilings()["bf16_matmul_TFLOPs"]}


def gemm_window(window_s: float) -> dict:
    """8192^3 GEMMs back to back for window_s seconds: their median rate and the count."""
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    events = []
    start = time.perf_counter()
    while time.perf_counter() - start < window_s:
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pair[0].record()
        a @ b
        pair[1].record()
        events.append(pair)
        if len(events) % 8 == 0:
            pair[1].synchronize()  # keeps the host near the device, so the window is device time
    torch.cuda.synchronize()
    seconds = [s.elapsed_time(e) / 1e3 for s, e in events]
    return {"gemms": len(seconds), "TFLOPs": gemm_flops_per_s(seconds, m) / 1e12}


@phase("matmul_sustained")
def matmul_sustained(window_s: float) -> dict:
    return gemm_window(window_s)


def one_prompt(runner) -> list:
    rng = random.Random(1)
    seq = Sequence("p", [rng.randrange(128000) for _ in range(N)], SamplingParams(temperature=0.0))
    seq.block_ids = list(range(-(-N // runner.block_size)))
    return [_Chunk(seq, N)]


@phase("prefill_reps")
def prefill_reps(runner, reps: int, rest_s: float = 0.0) -> dict:
    chunks = one_prompt(runner)
    runner.execute(chunks)
    ms = []
    for _ in range(reps):
        if rest_s:
            time.sleep(rest_s)
        t = time.perf_counter()
        runner.execute(chunks)
        ms.append((time.perf_counter() - t) * 1e3)
    return {"rest_s": rest_s, "ms": ms, "median_ms": statistics.median(ms)}


_PROMPTS = random.Random(5)  # one stream for the whole run: no prompt repeats, so none hits the prefix cache


def engine_prefill(engine, prompts: int, tag: str) -> float:
    return ba.queue_and_drain(engine, [[_PROMPTS.randrange(128000) for _ in range(N)] for _ in range(prompts)],
                              SamplingParams(temperature=0.0, max_tokens=1), tag)


@phase("prefill_engine")
def prefill_engine(engine, prompts: int, tag: str) -> dict:
    seconds = engine_prefill(engine, prompts, tag)
    return {"prompts": prompts, "ms_per_prompt": [seconds / prompts * 1e3], "wall_s": seconds}


@phase("matmul_beside")
def matmul_beside(window_s: float, of: str) -> dict:
    """The matmul rate right after a prefill phase, for as long as it ran: the same power
    and heat, so its share is the software's, not the clock's."""
    return {"of": of, **gemm_window(window_s)}


@phase("gaps")
def gaps(engine, prompts: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = engine_prefill(engine, prompts, "prof")
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, idle, last_end = 0.0, [], None
    for start, end, name in kernels:
        if last_end is not None and start > last_end:
            idle.append((start - last_end, name))
        busy += max(0.0, end - max(start, last_end or start))
        last_end = end if last_end is None else max(last_end, end)
    span_us = kernels[-1][1] - kernels[0][0]
    idle.sort(reverse=True)
    worst = [{"idle_us": round(us, 1), "next_kernel": name[:80]} for us, name in idle[:15]]
    by_name: dict[str, float] = {}
    for start, end, name in kernels:
        by_name[name[:80]] = by_name.get(name[:80], 0.0) + (end - start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"prompts": prompts, "wall_ms": wall * 1e3, "device_span_ms": span_us / 1e3,
            "device_busy_ms": busy / 1e3, "idle_ms": sum(us for us, _ in idle) / 1e3,
            "idle_gaps_over_20us": sum(1 for us, _ in idle if us > 20),
            "largest_gaps": worst, "kernel_ms_per_prompt": {k: v / 1e3 / prompts for k, v in top}}


def summarize(clock: list[tuple[float, float, float, float]]) -> None:
    for p in PHASES:
        inside = [c for c in clock if p["start"] <= c[0] <= p["end"]]
        if inside:
            p["sm_clock_MHz"] = {"median": statistics.median(c[1] for c in inside),
                                 "min": min(c[1] for c in inside), "max": max(c[1] for c in inside)}
            p["power_W_median"] = statistics.median(c[2] for c in inside)
            p["temperature_C_max"] = max(c[3] for c in inside)
            p["samples"] = len(inside)


def shares(result: dict) -> None:
    """Each prefill phase's TFLOP/s over the burst ceiling (the run's first matmul_burst,
    taken on an idle GPU at its full clock, as bench_engine takes it; a later one can
    find the clock still down from the load before) and over the matmul rate measured
    beside it."""
    flops = result.get("prefill_flops_2048")
    bursts = [p["TFLOPs"] for p in PHASES if p["phase"] == "matmul_burst"]
    for i, p in enumerate(PHASES):
        ms = p.get("median_ms") or (p["ms_per_prompt"][0] if "ms_per_prompt" in p else None)
        if not (flops and ms):
            continue
        p["TFLOPs_achieved"] = achieved = flops / (ms / 1e3) / 1e12
        p["share_of_burst"] = achieved / bursts[0]
        beside = PHASES[i + 1] if i + 1 < len(PHASES) and PHASES[i + 1]["phase"] == "matmul_beside" else None
        if beside:
            p["share_of_beside"] = achieved / beside["TFLOPs"]
    for kind in ("prefill_reps", "prefill_engine"):
        paired = [p["share_of_beside"] for p in PHASES if p["phase"] == kind and "share_of_beside" in p]
        burst = [p["share_of_burst"] for p in PHASES if p["phase"] == kind and p.get("rest_s", 0) == 0]
        result[f"{kind}_share_of_beside"] = paired
        result[f"{kind}_share_of_burst"] = burst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rest-s", type=float, default=0.3)
    ap.add_argument("--sustain-s", type=float, default=1.5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    clock = ClockLog(out.with_suffix(".smi.csv"))
    result = {"command": be.RESULTS["command"], "commit": be.RESULTS["commit"], "gpu": torch.cuda.get_device_name(),
              "phases": PHASES}
    try:
        matmul_burst()
        matmul_sustained(args.sustain_s)
        model_dir = be.write_llama31_8b_config(Path(tempfile.mkdtemp()) / "llama31-8b")
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=10240,
                  scheduler="sarathi", chunk_size=8192, max_num_seqs=256, gpu_memory_utilization=0.9)
        runner, engine = llm.engine.runner, llm.engine
        result["prefill_flops_2048"] = ba.prefill_flops(runner.model.shape, N)
        time.sleep(2)
        engine_prefill(engine, 4, "warm")
        matmul_burst()
        prefill_reps(runner, args.reps // 2, args.rest_s)
        for round_ in range(args.rounds):
            r = prefill_reps(runner, args.reps)
            matmul_beside(sum(r["ms"]) / 1e3, "prefill_reps")
            r = prefill_engine(engine, args.prompts, f"round{round_}")
            matmul_beside(r["wall_s"], "prefill_engine")
        gaps(engine, 16)
    finally:
        summarize(clock.stop())
        shares(result)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
