"""A step that fails recoverably (out of memory) hands back what the engine
holds; what ended before the failure is reported with it, so no request is
left neither finished nor handed back (its client would wait for good and its
seat would be lost to the replica's credit)."""

import asyncio
import threading

import torch

from common.pb.quadriga.v1 import replica_pb2 as pb
from replica_worker.engine.config import engine_config
from replica_worker.engine.core import EngineCore
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.worker.engine_loop import AddRequest, EngineLoop
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker


def test_an_add_refused_in_the_iteration_of_a_failed_step_is_still_answered():
    async def main():
        engine = FakeEngine(seats=4, tokens=100, length=3)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            engine.fail_add = {"bad"}
            engine.fail_steps = 1
            with worker.engine_loop._wake:   # both adds land in the iteration whose step fails
                worker._on_router_message(pb.RouterMessage(assign=pb.Assign(
                    assignments=[assignment("good"), assignment("bad")])))
            msgs = await w.settle(0.5)
            ended = {d.request_id for m in msgs if m and m.WhichOneof("kind") == "step"
                     for d in m.step.deltas if d.HasField("finish_reason")}
            handed = {r for m in msgs if m and m.WhichOneof("kind") == "hand_back"
                      for r in m.hand_back.request_ids}
            assert "bad" in ended and "good" in handed
            assert "bad" not in worker.book.live

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_request_a_failed_step_had_finished_before_its_launch_is_reported(tiny_model):
    """Async scheduling with a penalty: the request's last token is resolved at
    the top of the step, which ends it (it leaves the engine); then that step's
    launch fails. Its finish goes out with the hand-back of the rest."""
    engine = EngineCore(engine_config(str(tiny_model), device="cpu", async_scheduling=True, num_blocks=64))
    assert engine.async_scheduling
    reports, handed_back = [], threading.Event()

    def on_report(report):
        reports.append(report)
        if report.handed_back:
            handed_back.set()

    loop = EngineLoop(engine, on_report)
    real_launch, launches = engine.runner.launch, [0]

    def launch(chunks, previous=None):
        launches[0] += 1
        if launches[0] == 4:
            raise torch.OutOfMemoryError("out of memory (a test's)")
        return real_launch(chunks, previous)

    engine.runner.launch = launch
    loop.submit(AddRequest("p", [3, 14, 15, 92], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                                presence_penalty=0.5)))
    loop.submit(AddRequest("q", [6, 53, 58], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)))
    loop.start()
    try:
        assert handed_back.wait(30)
    finally:
        loop.stop()
    finishes = [d for r in reports for d in r.result.deltas if d.request_id == "p" and d.finish_reason]
    assert [d.finish_reason for d in finishes] == ["length"]
    assert "q" in {rid for r in reports for rid in r.handed_back}
