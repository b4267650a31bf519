"""The h200-8b profile: one H200, Llama-3.1-8B shape, bf16, flashinfer + CUDA graphs
with the fused Triton kernels (the CUDA default), fitted to the committed
bench_engine.py runs of benchmarks/results/gpu/.

Fitted to: decode steps at batch 1..256 (context 1024) and one-chunk prefills
of 512/2048/8192 tokens, each the wall time of runner.execute (the model's
step, host preparation and the sampled-id sync in), from two runs.

Checked against (not fitted to): the offline job of the second run, 1000 x
1024 in / 256 out. Its steps are replayed through the real sarathi scheduler
and block manager with the run's settings; the replay must have as many
decode-only steps as the run had CUDA graph replays, and the model's sum over
its steps is compared with the job's seconds. That sum leaves out the
engine's own host work per step (scheduling, block tables), which a
simulated replica does for real rather than model.

While every decode row has context 1024, per-sequence and per-KV-token costs
are collinear in the data: per_kv_token_s is then fixed at the KV bytes a
token holds read at the copy bandwidth measured in the same runs (attention
must at least read the KV once), and per_decode_seq_s takes the rest of the
decode slope (the matmuls turn compute-bound as the batch grows). Decode rows
at other contexts (benchmarks/gpu/bench_decode_contexts.py, saved beside the
runs as CONTEXTS_RUN) are fitted too when present, and free it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.sim.cost_model import CostModel, Profile, StepFeatures
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.fit import Point, fit_points, profile_entry

NAME = "h200-8b"
RUNS = ("engine_h200_fused.json", "engine_h200_fused_offline.json")
CONTEXTS_RUN = "engine_h200_decode_contexts.json"
# Llama-3.1-8B: 32 layers, 8 KV heads of 128, K and V in bf16.
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
VOCAB_SIZE = 128256
MAX_MODEL_LEN = 131072
# bench_engine.py's engine: its startup(model_dir, 256, 8192) and offline(...) settings.
OFFLINE_SETTINGS = {"chunk_size": 8192, "max_num_seqs": 256, "block_size": 16}


def _decode_point(row: dict, source: str) -> Point:
    b, ctx = row["batch"], row["context"]
    # bench_engine: each sequence holds ctx + 1 tokens, ctx computed, one decoded.
    features = StepFeatures(steps=1, decode_seqs=b, kv_tokens=b * (ctx + 1))
    return Point(f"decode batch {b} context {ctx}", source, features, row["step_ms"] / 1e3)


def _prefill_point(row: dict, source: str) -> Point:
    n = row["prompt_tokens"]
    features = StepFeatures(steps=1, prefill_tokens=n, attention_pairs=n * (n + 1) / 2)
    return Point(f"prefill {n} tokens", source, features, row["time_ms"] / 1e3)


def run_offline_job(engine: SimulatedEngine, num: int, n_in: int, n_out: int) -> None:
    """bench_engine.offline's job: its prompts, all at once, stepped to the end."""
    rng = random.Random(2)
    params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"offline-{i}", [rng.randrange(128000) for _ in range(n_in)], params)
    while engine.has_unfinished():
        engine.step()


def offline_engine(profile: Profile, num_kv_blocks: int, time_scale: float) -> SimulatedEngine:
    """A simulated engine with the offline run's settings."""
    return SimulatedEngine.from_profile(profile, "sarathi", time_scale=time_scale, record=True,
                                        num_blocks=num_kv_blocks, **OFFLINE_SETTINGS)


def replay_offline(num_kv_blocks: int, num: int, n_in: int, n_out: int) -> tuple[StepFeatures, int]:
    """The offline job's steps through the real scheduler, without waiting: their
    summed features and how many were decode-only (the run's graph replays)."""
    zero = Profile("replay", CostModel(0, 0, 0, 0, 0), VOCAB_SIZE, MAX_MODEL_LEN, num_kv_blocks)
    engine = offline_engine(zero, num_kv_blocks, time_scale=0)
    run_offline_job(engine, num, n_in, n_out)
    steps = engine.runner.steps
    decode_only = sum(1 for s in steps if all(n == 1 for _, n, _ in s.chunks) and len(s.chunks) <= 256)
    return engine.runner.totals, decode_only


def h200_points(results: Path) -> tuple[list[Point], list[float], list[tuple[Point, dict]]]:
    """The fitted points, the measured copy bandwidths, and the offline jobs to check."""
    points, bandwidths, jobs = [], [], []
    for name in RUNS:
        run = json.loads((results / name).read_text())
        source = f"benchmarks/results/gpu/{name}"
        bandwidths.append(run["ceilings"]["copy_bandwidth_TBps"] * 1e12)
        points += [_decode_point(r, source) for r in run["decode"]["rows"]]
        points += [_prefill_point(r, source) for r in run["prefill"]["rows"]]
        off = run.get("offline")
        if off:
            features, decode_only = replay_offline(run["startup"]["num_kv_blocks"], off["requests"],
                                                   off["input_tokens"], off["output_tokens"])
            label = f"offline {off['requests']} x {off['input_tokens']} in / {off['output_tokens']} out"
            jobs.append((Point(label, source, features, off["seconds"]),
                         {"decode_only_steps": decode_only, "graph_replays_measured": off["graph_replays"]}))
    contexts = results / CONTEXTS_RUN
    if contexts.exists():
        run = json.loads(contexts.read_text())
        bandwidths.append(run["ceilings"]["copy_bandwidth_TBps"] * 1e12)
        points += [_decode_point(r, f"benchmarks/results/gpu/{CONTEXTS_RUN}") for key, section in run.items()
                   if key.startswith("decode_context_") for r in section.get("rows", [])]
    return points, bandwidths, jobs


def _job_check(cost: CostModel, job: Point, counts: dict) -> dict:
    modelled = cost.time_of(job.features)
    return {"label": job.label, "source": job.source, "steps": job.features.steps, **counts,
            "measured_s": job.measured_s, "modelled_s": modelled,
            "rel_error": (modelled - job.measured_s) / job.measured_s,
            "note": "modelled = the cost model summed over the replayed steps: runner time only, "
                    "without the engine's host work per step"}


def h200_profile(results: Path) -> tuple[str, dict]:
    points, bandwidths, jobs = h200_points(results)
    bandwidth = sum(bandwidths) / len(bandwidths)
    one_context = len({p.features.kv_tokens / p.features.decode_seqs for p in points if p.features.decode_seqs}) == 1
    fixed = {"per_kv_token_s": KV_BYTES_PER_TOKEN / bandwidth} if one_context else {}
    fit = fit_points(points, fixed=fixed)
    checks = {"offline_jobs": [_job_check(fit.cost, job, counts) for job, counts in jobs]}
    startup = json.loads((results / RUNS[-1]).read_text())["startup"]
    shape = {"vocab_size": VOCAB_SIZE, "max_model_len": MAX_MODEL_LEN,
             "num_kv_blocks": startup["num_kv_blocks"], "block_size": 16}
    why = {"per_kv_token_s": f"{KV_BYTES_PER_TOKEN} KV bytes per token / {bandwidth / 1e12:.3f} TB/s "
                             "measured copy bandwidth: every decode row has one context, so the data "
                             "cannot tell per-sequence from per-KV-token cost"} if fixed else {}
    return NAME, profile_entry(
        fit, description="one H200, Llama-3.1-8B shape, bf16 dummy weights, flashinfer fa2 + CUDA graphs, "
                         "fused Triton kernels; step = runner.execute wall time (host work and the id sync in)",
        shape=shape, fixed_why=why, extra={"checks": checks})
