"""Simulated replicas that share one modelled device step one at a time: the
lock holds across processes, and a replica's step waits while another holds it."""

from __future__ import annotations

import multiprocessing
import threading
import time

from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.sim.cost_model import load_profile
from replica_worker.sim.engine import SimulatedEngine
from replica_worker.sim.shared_device import SharedDevice


def _hold_in_turns(path: str, turns: int, hold_s: float, spans) -> None:
    device = SharedDevice(path)
    for _ in range(turns):
        with device:
            start = time.monotonic()   # CLOCK_MONOTONIC: one clock for every process
            time.sleep(hold_s)
            spans.append((start, time.monotonic()))


def test_processes_sharing_a_device_never_hold_it_at_once(tmp_path):
    path = str(tmp_path / "device.lock")
    with multiprocessing.Manager() as manager:
        a, b = manager.list(), manager.list()
        procs = [multiprocessing.get_context("spawn").Process(target=_hold_in_turns, args=(path, 6, 0.03, s))
                 for s in (a, b)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        a, b = list(a), list(b)
    assert len(a) == len(b) == 6
    for s0, e0 in a:
        for s1, e1 in b:
            assert e0 <= s1 or e1 <= s0, f"held at once: {(s0, e0)} and {(s1, e1)}"


def _engine(shared: SharedDevice | None) -> SimulatedEngine:
    engine = SimulatedEngine.from_profile(load_profile("cpu-tiny"), "sarathi", time_scale=1.0,
                                          shared_device=shared)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    return engine


def test_a_step_waits_while_another_replica_holds_the_shared_device(tmp_path):
    path = str(tmp_path / "device.lock")
    sharing, alone = _engine(SharedDevice(path)), _engine(None)
    other_replica = SharedDevice(path)
    with other_replica:
        waiting = threading.Thread(target=sharing.step)
        waiting.start()
        free = threading.Thread(target=alone.step)
        free.start()
        free.join(10)
        assert not free.is_alive(), "a replica with a device of its own should not wait"
        waiting.join(0.5)
        assert waiting.is_alive(), "the step ran while another replica held the device"
    waiting.join(10)
    assert not waiting.is_alive()
    assert sharing.runner.modelled_s > 0
