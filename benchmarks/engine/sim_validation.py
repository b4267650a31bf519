"""A simulated replica engine against the real one, on the same workload.

    python -m benchmarks.engine.sim_validation engines [--device cpu] [--profile cpu-tiny] [--out FILE]
    python -m benchmarks.engine.sim_validation runs REAL.csv SIM.csv --out FILE   # two harness runs
    python -m benchmarks.engine.sim_validation offline   # the H200 offline job, simulated in real time

`engines` drives both engines on one thread, requests arriving at their
workload times (harness workload: lengths, arrivals, token ids), in three runs:
  real     the real EngineCore (the tiny model on the CPU, or --model on CUDA);
  pinned   SimulatedEngine with each request added before the very step the real
           run added it: the schedules must be identical (the scheduler and block
           manager are the same code), so the timings differ by step times alone;
  free     SimulatedEngine with arrivals by the clock, as a replica would see them.
Both simulated runs are compared with the real one request by request (TTFT,
mean TBT, end-to-end, each from the request's add) and, pinned, step by step.
`runs` compares two harness CSVs (benchmarks/harness/metrics.py) of the same
workload, request index by request index: the live comparison validate_sim.sh makes.
`offline` runs bench_engine.py's offline job (1000 x 1024 in / 256 out) through
a simulated h200-8b replica and compares its wall time with the H200 run's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import RESULTS, summarize
from benchmarks.harness.workload import PRESETS, WorkloadSpec, generate
from replica_worker.engine.core import EngineCore
from replica_worker.engine.config import engine_config
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.sim.cost_model import load_profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.runner import chunk_signature


@dataclass
class Timeline:
    """One run, in seconds from its start."""

    added_step: dict[str, int] = field(default_factory=dict)
    added_s: dict[str, float] = field(default_factory=dict)
    token_s: dict[str, list[float]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    schedule: list = field(default_factory=list)
    duration_s: float = 0.0

    def request_metrics(self, rid: str) -> dict:
        t, added = self.token_s[rid], self.added_s[rid]
        gaps = [b - a for a, b in zip(t, t[1:])]
        return {"ttft_s": t[0] - added, "tbt_mean_s": sum(gaps) / len(gaps) if gaps else None,
                "e2e_s": t[-1] - added}


def record_schedule(engine) -> list:
    """The chunks of every step the engine's runner executes, appended as it runs."""
    schedule, execute = [], engine.runner.execute

    def recording(chunks):
        schedule.append(chunk_signature(chunks))
        return execute(chunks)

    engine.runner.execute = recording
    return schedule


def drive(engine, requests, pinned: dict[str, int] | None = None) -> Timeline:
    """Adds each request when its arrival time has passed (pinned: before the step
    it names, or at its time when the engine is idle), steps while there is work."""
    tl = Timeline(schedule=record_schedule(engine))
    pending = sorted(requests, key=lambda r: r.arrival_s)
    params = {r.index: SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in pending}
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    while pending or engine.has_unfinished():
        step = len(tl.step_s)
        if not engine.has_unfinished():  # nothing to step: wait for the next arrival, as a replica would
            time.sleep(max(0.0, pending[0].arrival_s - clock()))
        if pinned:
            due = lambda r: pinned[str(r.index)] <= step  # noqa: E731
        else:
            due = lambda r: r.arrival_s <= clock()  # noqa: E731
        # Idle with nothing due (pinned, once the schedules differ): the next one comes anyway.
        while pending and (due(pending[0]) or not engine.has_unfinished()):
            r = pending.pop(0)
            rid = str(r.index)
            engine.add_request(rid, r.prompt_token_ids, params[r.index])
            tl.added_step[rid], tl.added_s[rid], tl.token_s[rid] = step, clock(), []
        if not engine.has_unfinished():
            continue
        t0 = time.perf_counter()
        result = engine.step()
        now = clock()
        tl.step_s.append(time.perf_counter() - t0)
        for d in result.deltas:
            if d.new_token_ids:
                tl.token_s[d.request_id].append(now)
    tl.duration_s = clock()
    return tl


def _rel(a, b):
    return None if a is None or b is None or b == 0 else (a - b) / b


def compare_requests(real: dict[str, dict], sim: dict[str, dict]) -> dict:
    """Per request: each metric's relative error of sim against real, and their summaries."""
    rows = {rid: {k: _rel(sim[rid][k], v) for k, v in m.items()} for rid, m in real.items() if rid in sim}
    out = {"per_request_rel_error": rows}
    for key in ("ttft_s", "tbt_mean_s", "e2e_s"):
        errors = [r[key] for r in rows.values() if r[key] is not None]
        out[key] = {"rel_error": summarize(errors), "abs_rel_error": summarize(abs(e) for e in errors),
                    "real_mean": summarize(m[key] for m in real.values() if m[key] is not None)["mean"],
                    "sim_mean": summarize(m[key] for m in sim.values() if m[key] is not None)["mean"]}
    return out


def compare_runs(real: Timeline, sim: Timeline, pinned: bool) -> dict:
    metrics = lambda tl: {rid: tl.request_metrics(rid) for rid in tl.token_s}  # noqa: E731
    out = {"steps": len(sim.step_s), "duration_s": sim.duration_s,
           "schedule_identical": sim.schedule == real.schedule,
           "requests": compare_requests(metrics(real), metrics(sim))}
    if pinned and out["schedule_identical"]:
        errors = [(s - r) / r for s, r in zip(sim.step_s, real.step_s)]
        out["step_time"] = {"rel_error": summarize(errors), "abs_rel_error": summarize(abs(e) for e in errors),
                            "total_real_s": sum(real.step_s), "total_sim_s": sum(sim.step_s)}
    return out


# ---------------------------------------------------------------- engines
def _scheduler_args(a) -> dict:
    return {"chunk_size": a.chunk_size, "max_num_seqs": a.max_num_seqs, "block_size": a.block_size}


def real_engine(a) -> EngineCore:
    from common.tokenizer import load_tokenizer

    kwargs = {**_scheduler_args(a), "load_format": a.load_format,
              "dtype": a.dtype or ("float32" if a.device == "cpu" else "bfloat16")}
    if a.num_blocks:
        kwargs["num_blocks"] = a.num_blocks
    try:
        tokenizer = load_tokenizer(a.model)  # as the worker does: deltas carry text
    except (OSError, ValueError):
        tokenizer = None
    return EngineCore(engine_config(a.model, a.scheduler, device=a.device, **kwargs), tokenizer)


def simulated_like(a, real: EngineCore) -> SimulatedEngine:
    """A simulated engine with the real one's KV blocks, length limit, vocabulary and scheduler."""
    return SimulatedEngine.from_profile(load_profile(a.profile), a.scheduler, vocab_size=real.vocab_size,
                                        max_model_len=real.max_model_len, num_blocks=real.runner.num_blocks,
                                        **_scheduler_args(a))


def workload(a, vocab_size: int):
    spec = WorkloadSpec(num_requests=a.num_requests, workload=a.workload, scale=a.scale, rate=a.rate,
                        seed=a.seed, vocab_size=vocab_size)
    warm = WorkloadSpec(num_requests=a.warmup, workload="synthetic", prompt_len=32, output_len=8,
                        seed=a.seed + 10_000, vocab_size=vocab_size)
    return spec, generate(spec), generate(warm, rate=0)


def cmd_engines(a) -> dict:
    if a.device == "cpu":
        import torch

        torch.set_num_threads(a.threads)
    real = real_engine(a)
    spec, requests, warmup = workload(a, real.vocab_size)
    runs = {}
    for name in ("real", "pinned", "free"):
        # Each engine starts from the same state: fresh, after the same warm-up.
        engine = real if name == "real" else simulated_like(a, real)
        drive(engine, warmup)
        runs[name] = drive(engine, requests, pinned=runs["real"].added_step if name == "pinned" else None)
    return {"settings": {k: v for k, v in vars(a).items() if k not in ("func", "out")},
            "load_average": os.getloadavg(),
            "num_kv_blocks": real.runner.num_blocks, "workload": spec.describe(),
            "real": {"steps": len(runs["real"].step_s), "duration_s": runs["real"].duration_s},
            "pinned": compare_runs(runs["real"], runs["pinned"], pinned=True),
            "free": compare_runs(runs["real"], runs["free"], pinned=False)}


# ---------------------------------------------------------------- two harness runs
HARNESS_COLUMNS = {"ttft_s": "ttft_s", "tbt_mean_s": "e2e_per_token_s", "e2e_s": "e2e_s"}


def read_harness_csv(path: str) -> dict[str, dict]:
    """index -> the compared metrics of a harness run's per-request CSV (finished requests only)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["ttft_s"] and r["e2e_s"]]
    return {r["index"]: {k: float(r[col]) if r[col] else None for k, col in HARNESS_COLUMNS.items()}
            for r in rows}


def cmd_runs(a) -> dict:
    real, sim = read_harness_csv(a.real_csv), read_harness_csv(a.sim_csv)
    return {"real_csv": a.real_csv, "sim_csv": a.sim_csv, "requests_compared": len(set(real) & set(sim)),
            "note": "tbt_mean_s compares the harness's e2e_per_token_s column (end-to-end over output tokens)",
            "requests": compare_requests(real, sim)}


# ---------------------------------------------------------------- the H200 offline job
def cmd_offline(a) -> dict:
    """bench_engine.py's offline job through a simulated h200-8b replica in real time: its
    wall time against the H200 run's, the engine's own host work (process CPU) included."""
    from replica_worker.sim.h200_profile import offline_engine, run_offline_job

    run = json.loads((RESULTS / "gpu" / "engine_h200_fused_offline.json").read_text())
    off = run["offline"]
    engine = offline_engine(load_profile("h200-8b"), run["startup"]["num_kv_blocks"], time_scale=1.0)
    wall, cpu = time.perf_counter(), time.process_time()
    run_offline_job(engine, off["requests"], off["input_tokens"], off["output_tokens"])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"job": {k: off[k] for k in ("requests", "input_tokens", "output_tokens")},
            "h200_measured_s": off["seconds"], "simulated_wall_s": wall, "modelled_s": engine.runner.modelled_s,
            "host_cpu_s": cpu, "rel_error": (wall - off["seconds"]) / off["seconds"],
            "steps": engine.step_id, "load_average": os.getloadavg()}


# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.sim_validation",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engines", help="the real engine and simulated ones, on one workload")
    e.add_argument("--device", default="cpu")
    e.add_argument("--model", help="default: the tiny model (built offline)")
    e.add_argument("--profile", help="default: cpu-tiny on the CPU, h200-8b on CUDA")
    e.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    e.add_argument("--dtype")
    e.add_argument("--scheduler", default="sarathi")
    e.add_argument("--chunk-size", type=int, default=512)
    e.add_argument("--max-num-seqs", type=int, default=128)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, help="default: the engine's own sizing")
    e.add_argument("--workload", default="sharegpt", choices=("synthetic", *PRESETS))
    e.add_argument("--scale", type=float, default=1.0)
    e.add_argument("--num-requests", "-n", type=int, default=100)
    e.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals, requests/s")
    e.add_argument("--seed", type=int, default=1)
    e.add_argument("--warmup", type=int, default=8, help="short requests through each engine first")
    e.add_argument("--threads", type=int, default=1, help="torch CPU threads (cpu-tiny was measured at 1)")
    e.set_defaults(func=cmd_engines)
    r = sub.add_parser("runs", help="two harness per-request CSVs of one workload")
    r.add_argument("real_csv")
    r.add_argument("sim_csv")
    r.set_defaults(func=cmd_runs)
    o = sub.add_parser("offline", help="the H200 offline job through a simulated h200-8b replica")
    o.set_defaults(func=cmd_offline)
    for q in (e, r, o):
        q.add_argument("--out", help="default: benchmarks/results/sim_validation_<device or runs>.json")
    a = p.parse_args(argv)
    if a.cmd == "engines":
        if a.model is None:
            from replica_worker.sim.cpu_profile import tiny_model_dir

            a.model = str(tiny_model_dir())
        a.profile = a.profile or ("cpu-tiny" if a.device == "cpu" else "h200-8b")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    result = a.func(a)
    tag = {"engines": getattr(a, "device", ""), "runs": "runs", "offline": "h200_offline"}[a.cmd]
    out = Path(a.out or RESULTS / f"sim_validation_{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python -m benchmarks.engine.sim_validation", *map(shlex.quote, sys.argv[1:])]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        **result}, indent=1) + "\n")
    print(json.dumps(headline(result), indent=1))
    print(f"-> {out}")
    return 0


def headline(result: dict) -> dict:
    """The summary lines worth printing: schedule identity and mean errors."""
    out = {}
    for run in ("pinned", "free"):
        if run in result:
            r = result[run]
            out[run] = {"schedule_identical": r["schedule_identical"], "steps": r["steps"],
                        **{k: r["requests"][k]["abs_rel_error"]["mean"] for k in HARNESS_COLUMNS}}
            if "step_time" in r:
                out[run]["step_time_abs_rel_error_mean"] = r["step_time"]["abs_rel_error"]["mean"]
    if "requests" in result:
        out["runs"] = {k: result["requests"][k]["abs_rel_error"]["mean"] for k in HARNESS_COLUMNS}
    for key in ("real", "simulated_wall_s", "h200_measured_s", "host_cpu_s", "rel_error"):
        if key in result:
            out[key] = result[key]
    return out


if __name__ == "__main__":
    sys.exit(main())
