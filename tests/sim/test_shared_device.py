"""Simulated replicas that share one modelled device share its time: while two are
in a step, each advances at half speed, across processes as within one; a replica
that died in a step slows no one."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.sim.cost_model import load_profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.shared_device import SharedDevice

STEP_S = 0.4


def _one_step(path: str, start, out) -> None:
    device = SharedDevice(path)
    start.wait(60)   # every process up (a spawned one may take seconds to import), then at once
    t0 = time.monotonic()
    device.run_step(STEP_S, 1.0)
    out.append(time.monotonic() - t0)


def _steps_at_once(path: str, processes: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    with multiprocessing.Manager() as manager:
        out = manager.list()
        start = ctx.Barrier(processes)
        procs = [ctx.Process(target=_one_step, args=(path, start, out)) for _ in range(processes)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return list(out)


def test_two_processes_in_a_step_at_once_each_take_twice_as_long(tmp_path):
    [alone] = _steps_at_once(str(tmp_path / "alone"), 1)
    together = _steps_at_once(str(tmp_path / "shared"), 2)
    assert STEP_S <= alone < 1.4 * STEP_S
    assert len(together) == 2
    assert all(t > 1.6 * STEP_S for t in together), together


def _die_in_a_step(path: str, ready) -> None:
    device = SharedDevice(path)
    device._set_running(True)
    ready.set()
    time.sleep(60)


def test_a_replica_killed_in_a_step_slows_no_one(tmp_path):
    path = str(tmp_path / "device")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_die_in_a_step, args=(path, ready))
    victim.start()
    assert ready.wait(30)
    device = SharedDevice(path)
    assert device.running_count() == 1   # the victim's step counts while it lives
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    device._checked_at = 0.0   # re-read the owners now rather than within the second
    assert device.running_count() == 0
    t0 = time.monotonic()
    device.run_step(STEP_S, 1.0)
    assert time.monotonic() - t0 < 1.4 * STEP_S


def _engine(shared: SharedDevice | None, time_scale: float) -> SimulatedEngine:
    engine = SimulatedEngine.from_profile(load_profile("cpu-tiny"), "sarathi", time_scale=time_scale,
                                          shared_device=shared)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    return engine


def test_an_engine_step_shares_the_device_with_another_replicas_step(tmp_path):
    path = str(tmp_path / "device")
    scale = 100.0   # the tiny profile's step is about 2 ms
    sharing = _engine(SharedDevice(path), scale)
    other_replica = SharedDevice(path)
    with other_replica._running():   # the other replica is in a step all along
        t0 = time.monotonic()
        sharing.step()
        took = time.monotonic() - t0
    modelled = sharing.runner.modelled_s * scale
    assert modelled > 0.1
    assert took > 1.7 * modelled, (took, modelled)
    t0 = time.monotonic()
    sharing.step()   # alone now
    assert time.monotonic() - t0 < 1.4 * (sharing.runner.modelled_s * scale - modelled) + 0.05
