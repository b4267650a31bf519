"""A simulated replica modelling async scheduling: a step that follows another at
once has its host work overlap the previous step on the device, so the step period
is about max(device, host), not their sum; after an idle engine, nothing overlaps.
A fake clock makes it exact."""

from __future__ import annotations

import pytest

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.sim import runner as runner_module
from replica_worker.sim.cost_model import CostModel, Profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.runner import SimulatedRunner

STEP_S = 0.010   # every step, whatever it holds


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(runner_module.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(runner_module.time, "sleep", fake.sleep)
    return fake


def runner(overlap: bool) -> SimulatedRunner:
    return SimulatedRunner(CostModel(STEP_S, 0, 0, 0, 0), num_blocks=64, max_model_len=256,
                           vocab_size=100, time_scale=2.0, overlap=overlap)


@pytest.mark.parametrize("host_s, waited_s", [(0.004, 0.016), (0.030, 0.0), (0.0, 0.020)])
def test_a_back_to_back_step_waits_only_what_its_host_work_left(clock, host_s, waited_s):
    r = runner(overlap=True)
    r.execute([])                      # the first step: all of it (2 x 10 ms, stretched)
    assert clock.slept == [pytest.approx(0.020)]
    clock.now += host_s                # resolving, sending, scheduling the next step
    r.follows_previous(True)
    clock.slept.clear()
    r.execute([])
    assert sum(clock.slept) == pytest.approx(waited_s)


def test_without_overlap_or_after_idle_the_host_work_adds(clock):
    for overlap, back_to_back in ((False, True), (True, False)):
        r = runner(overlap)
        r.execute([])
        clock.now += 0.004
        r.follows_previous(back_to_back)
        clock.slept.clear()
        r.execute([])
        assert sum(clock.slept) == pytest.approx(0.020)


def test_on_a_shared_device_the_head_start_counts_at_the_share_of_the_moment(clock, monkeypatch, tmp_path):
    from replica_worker.sim import shared_device as shared_module

    monkeypatch.setattr(shared_module.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(shared_module.time, "sleep", clock.sleep)
    device = shared_module.SharedDevice(str(tmp_path / "device"))
    r = SimulatedRunner(CostModel(STEP_S, 0, 0, 0, 0), num_blocks=64, max_model_len=256,
                        vocab_size=100, time_scale=2.0, overlap=True, shared_device=device)
    r.execute([])
    assert sum(clock.slept) == pytest.approx(0.020)   # alone on the device: at full speed
    # running_count held at k: the 4 ms ahead count 4 / 2 (time scale) / (1 + k) modelled
    # ms, and run_step then advances at 1 / max(1, k): k = 1 leaves 9 ms at full speed.
    for k, waited_s in ((0, 0.016), (1, 0.018)):
        monkeypatch.setattr(device, "running_count", lambda k=k: k)
        clock.now += 0.004
        r.follows_previous(True)
        clock.slept.clear()
        r.execute([])
        assert sum(clock.slept) == pytest.approx(waited_s)


def test_the_engine_marks_steps_that_follow_one_with_work_left(clock):
    profile = Profile("flat", CostModel(STEP_S, 0, 0, 0, 0), vocab_size=100, max_model_len=256,
                      num_kv_blocks=64)
    engine = SimulatedEngine.from_profile(profile, time_scale=1.0, overlap=True, block_size=16)
    seen = []
    step = engine.runner.execute
    engine.runner.execute = lambda chunks: seen.append(engine.runner.back_to_back) or step(chunks)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # a: prefill (after idle), 2 decodes; b: prefill after the engine ran dry, 1 decode
    assert seen == [False, True, True, False, True]
