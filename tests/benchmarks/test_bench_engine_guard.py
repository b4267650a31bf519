"""bench_engine's start: without flashinfer the GPU benchmarks stop before measuring
(the torch fallback is another engine), unless that fallback is asked for; and the
ceilings are what its section records."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import bench_engine  # noqa: E402  (imports on the CPU: torch, the engine, no CUDA call)


def test_without_flashinfer_the_benchmark_stops_with_a_reason(monkeypatch):
    monkeypatch.delenv("QUADRIGA_ATTENTION_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "flashinfer", None)   # import fails as when absent
    with pytest.raises(SystemExit) as stop:
        bench_engine.require_flashinfer()
    assert "flashinfer is not importable" in str(stop.value)


def test_the_torch_fallback_may_be_measured_on_purpose(monkeypatch):
    monkeypatch.setenv("QUADRIGA_ATTENTION_BACKEND", "torch")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    bench_engine.require_flashinfer()   # returns


def test_the_ceilings_section_records_the_ceilings(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_engine, "OUT", tmp_path / "r.json")
    monkeypatch.setattr(bench_engine, "RESULTS", {})
    monkeypatch.setattr(bench_engine, "cuda_time", lambda fn, reps: 1e-3)
    monkeypatch.setattr(bench_engine.torch, "randn", lambda *a, **kw: bench_engine.torch.zeros(4))
    monkeypatch.setattr(bench_engine.torch.cuda, "get_device_name", lambda: "card", raising=False)
    got = bench_engine.ceilings()
    assert bench_engine.RESULTS["ceilings"] == got and got["gpu"] == "card"
