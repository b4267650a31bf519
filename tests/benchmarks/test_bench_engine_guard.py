"""bench_engine's start: without flashinfer the GPU benchmarks stop before measuring
(the torch fallback is another engine), unless that fallback is asked for; the
ceilings are what its section records; transformers' anchor steps down past a batch
that runs out of memory."""

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


def test_transformers_out_of_memory_steps_down_to_a_batch_that_may_fit():
    oom = bench_engine.torch.OutOfMemoryError("CUDA out of memory")
    assert bench_engine.smaller_batch_after_oom(oom, 256, {256, 384}) == 192
    assert bench_engine.smaller_batch_after_oom(oom, 384, {256, 384}) == 288
    assert bench_engine.smaller_batch_after_oom(oom, 256, {256, 192}) is None   # tried already
    assert bench_engine.smaller_batch_after_oom(oom, 40, {40}) is None          # nothing under 32
    assert bench_engine.smaller_batch_after_oom(RuntimeError("other"), 256, {256}) is None
