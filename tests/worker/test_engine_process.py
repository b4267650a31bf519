"""The engine in a process of its own: the wire between it and its worker, the
worker's detokenizing and stop strings, and the two processes' lifetimes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.outputs import DeltaStats, EngineLoad, RequestDelta, StepResult, TokenLogprobs
from replica_worker.engine.schedulers.base import AdmissionCapacity
from replica_worker.worker import engine_wire
from replica_worker.worker.engine_loop import AbortRequest, AddRequest, EngineReport, ReportNow
from replica_worker.worker.engine_process import EngineProcess
from tests.engine.hf_reference import hf_greedy
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import client, collect, make_config, running_router, tokens_of
from tests.worker.test_worker_with_router import PROMPTS, requests, run_worker


def test_commands_and_reports_cross_the_wire_unchanged():
    add = AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.5, top_k=3, seed=2**63,
                                                       stop=("a", "bc"), stop_token_ids=(4,), logprobs=2),
                     arrival_time=12.5, resume_token_ids=(8, 9), resume_text_len=3)
    for cmd in (add, AbortRequest("r1"), ReportNow(), engine_wire.Stop()):
        assert engine_wire.decode_command(engine_wire.encode_command(cmd)) == cmd
    stats = DeltaStats(1.0, 1.5, 3, 2, 16, 1, (2.0, 2.5), 1.75)
    report = EngineReport(
        result=StepResult([
            RequestDelta("r1", [11], "x", 2, stats=stats,
                         logprobs=[TokenLogprobs(-0.5, ((11, -0.5), (12, -1.25)))]),
            RequestDelta("r2", [], "", 0, finish_reason="error", error="too long"),
        ], batch_size=2, num_tokens=7, num_preempted=1, step_time=0.01),
        capacity=AdmissionCapacity(3, 400), load=EngineLoad(1, 2, 30, 40), request_ids=("r1",),
        step_id=9, handed_back=("r3",), kv_events=KVCacheEvents((2**64 - 1,), (5,), False),
        prefix_stats=PrefixCacheStats(10, 4, 2))
    assert engine_wire.decode_report(engine_wire.encode_report(report)) == report


def _engine_config(model) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model)), CacheConfig(num_blocks=64))


def test_the_engine_process_reports_its_info_and_steps(tiny_model):
    engine = EngineProcess(_engine_config(tiny_model), threads=1)
    reports, finished = [], threading.Event()

    def on_report(report):
        reports.append(report)
        if any(d.finish_reason for d in report.result.deltas):
            finished.set()

    try:
        assert engine.info.num_kv_blocks == 64 and engine.info.max_model_len == 1024
        assert engine.prefix_caching_enabled and engine.cached_block_hashes() == []
        engine.attach(on_report).start()
        engine.submit(AddRequest("r", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
        assert finished.wait(30)
    finally:
        engine.stop()
    deltas = [d for r in reports for d in r.result.deltas]
    assert [t for d in deltas for t in d.new_token_ids] == hf_greedy(str(tiny_model), PROMPTS[:1], 5)[0]
    assert deltas[-1].finish_reason == "length" and deltas[0].stats.num_prompt_tokens == len(PROMPTS[0])
    assert not engine._process.is_alive()


def test_a_dead_engine_process_ends_its_worker_with_a_failure_status(tiny_model):
    exits = []
    engine = EngineProcess(_engine_config(tiny_model), threads=1, on_exit=exits.append)
    engine.attach(lambda report: None).start()
    os.kill(engine.pid, signal.SIGKILL)
    wait_for(lambda: exits, 30)
    assert exits == [70]  # killed by a signal: read as a failed device, like an accelerator error


def test_the_engine_process_ends_when_its_worker_is_gone(tiny_model):
    engine = EngineProcess(_engine_config(tiny_model), threads=1)
    engine._conn.close()  # what the engine process sees when its worker is killed
    engine._process.join(30)
    assert engine._process.exitcode == 0



# A worker that starts its engine process and says its pid at once (the engine then
# still builds its model), then waits to be killed.
_WORKER_KILLED_AT_START = """
import multiprocessing, sys, threading, time
from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig
from replica_worker.worker.engine_process import EngineProcess

def say_engine_pid():
    while not multiprocessing.active_children():
        time.sleep(0.005)
    print(multiprocessing.active_children()[0].pid, flush=True)

threading.Thread(target=say_engine_pid, daemon=True).start()
EngineProcess(EngineConfig(ModelConfig(sys.argv[1]), CacheConfig(num_blocks=64)), threads=1)
time.sleep(120)
"""


def test_a_worker_killed_while_its_engine_builds_leaves_no_engine_process_behind(tiny_model):
    """SIGKILL of a worker during its start (a rollout, a fault): its engine process,
    which reads no pipe while it builds, ends by itself soon after and logs no
    traceback (it used to finish its build, then die writing to the dead pipe)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    worker = subprocess.Popen([sys.executable, "-c", _WORKER_KILLED_AT_START, str(tiny_model)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        engine_pid = int(worker.stdout.readline())
        worker.kill()
        worker.wait(10)

        def gone() -> bool:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                return True
            # A zombie until its new parent reaps it: gone for our purposes.
            return Path(f"/proc/{engine_pid}/stat").read_text().split(") ")[1][0] == "Z"

        wait_for(gone, 30)
        time.sleep(0.5)   # anything it printed on its way out has reached the pipe
    finally:
        if worker.poll() is None:
            worker.kill()
    err = worker.stderr.read()
    assert "Traceback" not in err, err


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_stop_strings_end_requests_in_the_worker_as_in_the_engine(redis_url, tiny_model, arun, async_scheduling):
    """Greedy outputs through a worker whose engine has its own process equal
    transformers'; with stop strings, the texts and finish reasons equal the
    offline engine's, which finds them itself. With async scheduling the engine
    reports a step later and runs a step past a stop: the worker drops it."""
    from common.pb.quadriga.v1 import generation_pb2 as gpb

    n = 24
    llm = LLM(str(tiny_model), num_blocks=64)
    full = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True))]
    stops = [(text[8:11],) for text in full]  # each cuts its request short
    reference = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop=s)
                                       for s in stops])
    # A stop token id ends each request too; its text is left out, its id is not.
    stop_ids = [o.outputs[0].token_ids[5] for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]
    by_id = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[t]) for t in stop_ids])

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            worker, task = await run_worker(app.address, tiny_model, "--async-scheduling", async_scheduling,
                                            engine_thread=False)
            assert worker.texts is not None  # the worker detokenizes, not the engine
            async with client(app.address) as stub:
                greedy = await asyncio.gather(*(collect(stub, r, timeout=60) for r in requests(n)))
                stopped = await asyncio.gather(*(collect(stub, gpb.GenerateRequest(
                    prompt_token_ids=p, sampling=gpb.SamplingParams(
                        max_tokens=n, temperature=0.0, ignore_eos=True, stop=list(s))), timeout=60)
                    for p, s in zip(PROMPTS, stops)))
                stopped_by_id = await asyncio.gather(*(collect(stub, gpb.GenerateRequest(
                    prompt_token_ids=p, sampling=gpb.SamplingParams(
                        max_tokens=n, temperature=0.0, ignore_eos=True, stop_token_ids=[t])), timeout=60)
                    for p, t in zip(PROMPTS, stop_ids)))
            await wait_until(lambda: not worker.book.live)
            assert not list(worker.texts._requests)  # nothing left behind
            worker.begin_drain()
            await asyncio.wait_for(task, 30)
            return greedy, stopped, stopped_by_id

    greedy, stopped, stopped_by_id = arun(scenario(), timeout=180)
    assert [tokens_of(m) for m in greedy] == hf_greedy(str(tiny_model), PROMPTS, n)
    assert ["".join(m.text for m in msgs) for msgs in greedy] == full
    for msgs, ref in zip(stopped, reference):
        out = ref.outputs[0]
        assert tokens_of(msgs) == out.token_ids and len(out.token_ids) < n
        assert "".join(m.text for m in msgs) == out.text
        assert msgs[-1].finish_reason == gpb.FINISH_REASON_STOP and out.finish_reason == "stop"
    tok = llm.tokenizer
    for msgs, ref in zip(stopped_by_id, by_id):
        out = ref.outputs[0]
        assert tokens_of(msgs) == out.token_ids and out.finish_reason == "stop"
        assert "".join(m.text for m in msgs) == out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _replica_process(model, *flags: str):
    """`python -m replica_worker` with no router to reach, in a session of its own,
    its output merged; read its lines from .stdout."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-m", "replica_worker", "--router", "127.0.0.1:1",
                             "--model", str(model), "--replica-id", "x", "--threads", "1", *flags],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _group_gone(pgid: int) -> bool:
    import subprocess

    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True).returncode == 1


def test_a_worker_that_fails_after_its_engine_started_exits_and_leaves_no_engine(tiny_model):
    """A metrics port already taken fails the worker once its engine process runs:
    it exits non-zero at once (a supervisor restarts it) instead of waiting at
    exit on an engine process that lives on."""
    import socket

    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen(1)
    worker = _replica_process(tiny_model, "--metrics-port", str(busy.getsockname()[1]))
    try:
        assert worker.wait(60) == 1
        assert "Address already in use" in worker.stdout.read()
        wait_for(lambda: _group_gone(worker.pid), 20)
    finally:
        busy.close()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["while its engine builds", "once ready"])
def test_sigterm_drains_and_exits_0_whenever_it_comes(tiny_model, when):
    """During the build too: the stop waits for the engine, then drains nothing."""
    worker = _replica_process(tiny_model)
    try:
        for line in worker.stdout:
            if ("starting the engine" in line) if when != "once ready" else ("engine ready" in line):
                break
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.stdout.read()
        wait_for(lambda: _group_gone(worker.pid), 20)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)


def test_a_signal_to_the_whole_group_drains_a_tensor_parallel_replica_on_its_thread(tiny_model):
    """systemd and a terminal signal the whole process group: with the engine on
    the worker's thread, rank 1 is the worker's own child, and it must leave the
    stop to rank 0 (it used to die of the signal, ending the replica with 70)."""
    worker = _replica_process(tiny_model, "--tensor-parallel-size", "2", "--engine-thread")
    try:
        for line in worker.stdout:
            if "engine ready" in line:
                break
        time.sleep(1.5)   # in its reconnect loop: its drain ends at the next try, not at once
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(60) == 0, worker.stdout.read()
        wait_for(lambda: _group_gone(worker.pid), 20)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
