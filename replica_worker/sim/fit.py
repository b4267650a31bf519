"""Fits cost model profiles by least squares and writes them, with every data point's
residual, to benchmarks/results/sim_cost_model.json.

    python -m replica_worker.sim.cost_model fit          # h200-8b, from the committed H200 JSONs
    python -m replica_worker.sim.cost_model measure-cpu  # cpu-tiny, measured here (cpu_profile.py)

Each command rewrites its own profile and keeps the others. The fit is
weighted by 1 / measured time, so it minimises relative error: decode steps
of 6 ms and a 47 s offline job count alike.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from replica_worker.sim.cost_model import COEFFICIENTS, PROFILES_PATH, CostModel, StepFeatures

MODEL_TEXT = ("step_s = intercept_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_seqs"
              " + per_kv_token_s * kv_tokens + per_attention_pair_s * attention_pairs (replica_worker/sim/"
              "cost_model.py); a point with steps > 1 is a whole job, its features summed over its steps")


@dataclass(frozen=True)
class Point:
    label: str
    source: str
    features: StepFeatures
    measured_s: float


@dataclass(frozen=True)
class Fit:
    cost: CostModel
    points: list[dict]
    rms_rel_error: float
    max_abs_rel_error: float
    held_at_zero: tuple[str, ...] = ()  # coefficients the data wanted negative


def _solve(points: list[Point], fixed: dict[str, float]) -> np.ndarray:
    """Least squares in relative error over the coefficients not in `fixed`."""
    unknown = [i for i, name in enumerate(COEFFICIENTS) if name not in fixed]
    values = np.array([fixed.get(name, 0.0) for name in COEFFICIENTS])
    x = np.array([p.features.vector() for p in points])
    y = np.array([p.measured_s for p in points])
    weight = 1.0 / y
    rhs = (y - x @ values) * weight
    solution, *_ = np.linalg.lstsq(x[:, unknown] * weight[:, None], rhs, rcond=None)
    values[unknown] = solution
    return values


def fit_points(points: list[Point], fixed: dict[str, float] | None = None) -> Fit:
    """Non-negative least squares in relative error: a coefficient the data want
    below zero (noise, or a term the points cannot see) is held at 0 and the rest
    refitted, most negative first."""
    fixed = dict(fixed or {})
    held: list[str] = []
    values = _solve(points, fixed)
    while values.min() < 0:
        name = COEFFICIENTS[int(values.argmin())]
        fixed[name] = 0.0
        held.append(name)
        values = _solve(points, fixed)
    cost = CostModel.from_vector(values)
    rows = []
    for p in points:
        predicted = cost.time_of(p.features)
        rows.append({"label": p.label, "source": p.source, "features": asdict(p.features),
                     "measured_s": p.measured_s, "predicted_s": predicted,
                     "rel_error": (predicted - p.measured_s) / p.measured_s})
    errors = np.array([r["rel_error"] for r in rows])
    return Fit(cost, rows, float(np.sqrt(np.mean(errors ** 2))), float(np.max(np.abs(errors))), tuple(held))


def profile_entry(fit: Fit, *, description: str, shape: dict, fixed_why: dict[str, str],
                  extra: dict | None = None) -> dict:
    return {
        "description": description,
        "coefficients": dict(zip(COEFFICIENTS, fit.cost.vector())),
        "fixed": {**fixed_why, **{name: "fitted below zero; held at 0" for name in fit.held_at_zero}},
        "shape": shape,
        "error": {"rms_rel": fit.rms_rel_error, "max_abs_rel": fit.max_abs_rel_error},
        **(extra or {}),
        "points": fit.points,
    }


def write_profile(name: str, entry: dict, path: Path = PROFILES_PATH) -> Path:
    data = json.loads(path.read_text()) if path.exists() else {}
    profiles = data.get("profiles", {})
    entry = {"command": " ".join(["python -m replica_worker.sim.cost_model",
                                  *(shlex.quote(a) for a in sys.argv[1:])]),
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}
    profiles[name] = entry
    data = {"model": MODEL_TEXT, "profiles": dict(sorted(profiles.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica_worker.sim.cost_model", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit h200-8b to the committed H200 figures")
    f.add_argument("--results", default=str(PROFILES_PATH.parent / "gpu"), help="folder of the H200 JSONs")
    m = sub.add_parser("measure-cpu", help="measure the tiny model here and fit cpu-tiny")
    m.add_argument("--reps", type=int, default=7)
    m.add_argument("--threads", type=int, default=1)
    for q in (f, m):
        q.add_argument("--out", default=str(PROFILES_PATH), help="the profiles file (other profiles are kept)")
    a = p.parse_args(argv)
    if a.cmd == "fit":
        from replica_worker.sim.h200_profile import h200_profile

        name, entry = h200_profile(Path(a.results))
    else:
        from replica_worker.sim.cpu_profile import cpu_profile

        name, entry = cpu_profile(reps=a.reps, threads=a.threads)
    path = write_profile(name, entry, Path(a.out))
    err = entry["error"]
    print(f"{name}: {entry['coefficients']}\n  rms relative error {err['rms_rel']:.3f}, "
          f"max {err['max_abs_rel']:.3f} over {len(entry['points'])} points -> {path}")
    return 0
