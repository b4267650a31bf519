"""The committed cost model profiles reproduce their data points within the error
they state, the h200-8b fit is reproducible from the committed H200 figures, and
the fit and the step features do what they say."""

from __future__ import annotations

import json
import math

import pytest

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from replica_worker.sim.cost_model import COEFFICIENTS, PROFILES_PATH, CostModel, StepFeatures, features_of, load_profile
from replica_worker.sim.fit import Point, fit_points
from replica_worker.sim.h200_profile import h200_profile

PROFILES = json.loads(PROFILES_PATH.read_text())["profiles"]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_profile_reproduces_its_points_within_its_stated_error(name):
    entry = PROFILES[name]
    cost = load_profile(name).cost
    errors = []
    for point in entry["points"]:
        predicted = cost.time_of(StepFeatures(**point["features"]))
        assert math.isclose(predicted, point["predicted_s"], rel_tol=1e-9), point["label"]
        errors.append((predicted - point["measured_s"]) / point["measured_s"])
    assert max(abs(e) for e in errors) <= entry["error"]["max_abs_rel"] + 1e-12
    assert math.isclose(math.sqrt(sum(e * e for e in errors) / len(errors)), entry["error"]["rms_rel"],
                        rel_tol=1e-9)
    assert entry["error"]["max_abs_rel"] < 0.15, "the model no longer fits its data"
    assert len(entry["points"]) >= 2 * len(COEFFICIENTS)


def test_the_h200_fit_is_reproduced_from_the_committed_figures():
    name, entry = h200_profile(PROFILES_PATH.parent / "gpu")
    committed = PROFILES[name]
    for key in COEFFICIENTS:
        assert math.isclose(entry["coefficients"][key], committed["coefficients"][key], rel_tol=1e-9), key
    # The replayed offline job has exactly as many decode-only steps as the run
    # had CUDA graph replays: the scheduler the simulator runs is the one measured.
    for job in entry["checks"]["offline_jobs"]:
        assert job["decode_only_steps"] == job["graph_replays_measured"]


def test_the_fit_recovers_known_coefficients_and_holds_negative_ones_at_zero():
    truth = CostModel(0.002, 3e-5, 1e-5, 4e-8, 1e-9)
    shapes = [StepFeatures(1, p, d, k, a) for p, d, k, a in
              [(0, 1, 100, 0), (0, 8, 8000, 0), (0, 32, 2000, 0), (512, 0, 0, 131328),
               (2048, 0, 0, 2098176), (64, 16, 4000, 2080), (256, 4, 900, 40000)]]
    fit = fit_points([Point(str(i), "synthetic", f, truth.time_of(f)) for i, f in enumerate(shapes)])
    for got, want in zip(fit.cost.vector(), truth.vector()):
        assert math.isclose(got, want, rel_tol=1e-6)
    assert fit.max_abs_rel_error < 1e-9

    # Step times that fall with batch size ask for a negative per-sequence cost.
    falling = [Point(str(d), "synthetic", StepFeatures(1, 0, d, 0, 0), 0.01 - 1e-4 * d) for d in (1, 8, 32)]
    fit = fit_points(falling)
    assert fit.held_at_zero and min(fit.cost.vector()) >= 0


def _chunk(num_prompt: int, computed: int, num_tokens: int, outputs: int = 0):
    seq = Sequence("s", list(range(1, num_prompt + 1)), SamplingParams(), resume_token_ids=[1] * outputs)
    seq.num_computed_tokens = computed

    class Chunk:
        pass

    c = Chunk()
    c.seq, c.num_tokens = seq, num_tokens
    return c


def test_step_features_count_prefill_decode_kv_and_attention_pairs():
    chunks = [
        _chunk(100, 0, 40),              # a first prefill chunk
        _chunk(100, 64, 36),             # the end of a prefill after 64 cached tokens
        _chunk(50, 60, 1, outputs=11),   # a decode at context 61
        _chunk(20, 24, 1, outputs=5),    # a decode at context 25
    ]
    f = features_of(chunks)
    assert f == StepFeatures(steps=1, prefill_tokens=76, decode_seqs=2, kv_tokens=86,
                             attention_pairs=40 * 41 / 2 + 36 * 64 + 36 * 37 / 2)
