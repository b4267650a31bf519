"""bench_prefill_clock.shares: each prefill phase over the run's first burst ceiling
(taken on an idle GPU) and over the GEMM measured right after it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import bench_prefill_clock  # noqa: E402  (imports on the CPU: torch, the engine, no CUDA call)


def test_a_phase_is_shared_against_the_first_burst_and_the_gemm_beside_it(monkeypatch):
    phases = [
        {"phase": "matmul_burst", "TFLOPs": 800.0},
        {"phase": "matmul_burst", "TFLOPs": 700.0},          # the clock still down: not the ceiling
        {"phase": "prefill_reps", "rest_s": 0.3, "median_ms": 50.0},
        {"phase": "prefill_reps", "rest_s": 0.0, "median_ms": 100.0},
        {"phase": "matmul_beside", "of": "prefill_reps", "TFLOPs": 500.0},
        {"phase": "prefill_engine", "ms_per_prompt": [80.0]},
        {"phase": "matmul_beside", "of": "prefill_engine", "TFLOPs": 625.0},
    ]
    monkeypatch.setattr(bench_prefill_clock, "PHASES", phases)
    result = {"prefill_flops_2048": 40e12}   # 40 TFLOP a prompt: 400 TFLOP/s at 100 ms
    bench_prefill_clock.shares(result)
    assert phases[3]["TFLOPs_achieved"] == pytest.approx(400.0)
    assert result["prefill_reps_share_of_burst"] == [pytest.approx(0.5)]     # the rested one left out
    assert result["prefill_reps_share_of_beside"] == [pytest.approx(0.8)]
    assert result["prefill_engine_share_of_burst"] == [pytest.approx(500 / 800)]
    assert result["prefill_engine_share_of_beside"] == [pytest.approx(0.8)]
    assert "share_of_beside" not in phases[2]                                # no GEMM right after it
