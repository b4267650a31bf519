"""ReplicaWorker with a scripted engine: credit, invalid work, engine failures, cancels;
and its drain against a scripted router."""

import asyncio


from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as pb
from common.pb.quadriga.v1 import replica_pb2_grpc
from replica_worker.worker import client
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker, serve_router


def run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def assign(worker, *assignments):
    worker._on_router_message(pb.RouterMessage(assign=pb.Assign(assignments=list(assignments))))


def deltas_of(msgs):
    return [d for m in msgs if m is not None and m.WhichOneof("kind") == "step" for d in m.step.deltas]


def test_invalid_assignment_gets_an_error_and_its_credit_back():
    async def main():
        engine = FakeEngine(seats=1, tokens=100)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            worker.engine_loop.request_report()
            pull = (await w.next("pull")).pull
            assert (pull.max_requests, pull.max_prompt_tokens) == (1, 100)
            # top_p out of range: rejected before it reaches the engine.
            assign(worker, assignment("bad", top_p=5.0))
            step = (await w.next("step")).step
            assert [d.request_id for d in step.deltas] == ["bad"]
            assert step.deltas[0].finish_reason == gpb.FINISH_REASON_ERROR and "top_p" in step.deltas[0].error
            # The router spent its credit on it; the idle replica must ask again
            # (on top of the 97 tokens still outstanding).
            pull = (await w.next("pull")).pull
            assert (pull.max_requests, pull.max_prompt_tokens) == (1, 3)
            assert (worker.credit.outstanding_requests, worker.credit.outstanding_tokens) == (1, 100)
            assert not worker.book.live
    run(main())


def test_recoverable_engine_error_hands_the_step_back_and_the_worker_lives():
    """A step fails with an error the device survives (out of memory, say): the
    engine frees everything and the worker hands the requests back to the
    router, which resumes them from what it recorded; nothing is failed."""
    async def main():
        engine = FakeEngine(seats=4, length=3)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            engine.fail_steps = 1
            assign(worker, assignment("a"), assignment("c"))
            back = (await w.next("hand_back")).hand_back
            assert sorted(back.request_ids) == ["a", "c"]
            assert not [d for d in deltas_of(await w.settle()) if d.HasField("finish_reason")]
            assert not engine.reqs and not worker.book.live and not worker.book.queued
            # The next request runs normally.
            assign(worker, assignment("b"))
            got = []
            while not got or not got[-1].HasField("finish_reason"):
                got += [d for d in deltas_of([await w.next("step")]) if d.request_id == "b"]
            assert [d.output_offset for d in got] == [0, 1, 2]
    run(main())


def test_accelerator_failure_ends_the_replica_without_failing_its_requests():
    """A CUDA error leaves the device unusable: the worker must not fail its requests
    (the router requeues them once the replica is gone), only hand over to the exit."""
    async def main():
        engine = FakeEngine(seats=4, length=3)
        worker = make_worker(engine)
        failures = []
        worker.engine_loop._on_device_failure = failures.append  # instead of os._exit
        async with Wired(worker) as w:
            engine.fail_steps = 1
            engine.step_error = RuntimeError("CUDA error: an illegal memory access was encountered")
            assign(worker, assignment("a"))
            for _ in range(100):
                if failures:
                    break
                await asyncio.sleep(0.02)
            assert [str(e) for e in failures] == ["CUDA error: an illegal memory access was encountered"]
            assert not [d for d in deltas_of(await w.settle()) if d.HasField("finish_reason")]
            assert "a" in worker.book.live
    run(main())


def test_fatal_device_errors_are_told_from_recoverable_ones():
    import torch

    from replica_worker.worker.engine_loop import is_fatal_device_error

    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal_device_error(torch.AcceleratorError("device-side assert triggered"))
    assert not is_fatal_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not is_fatal_device_error(RuntimeError("boom in step"))


def test_unexpected_add_error_fails_that_request_only():
    async def main():
        engine = FakeEngine(seats=4, length=2)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            engine.fail_add = {"bad"}
            engine.hold = True  # keep both commands in one inbox batch
            assign(worker, assignment("bad"), assignment("good"))
            await asyncio.sleep(0.1)
            engine.hold = False
            worker.engine_loop.request_report()
            seen = {}
            while len(seen) < 2:
                for d in deltas_of([await w.next("step")]):
                    if d.HasField("finish_reason"):
                        seen[d.request_id] = d
            assert seen["bad"].finish_reason == gpb.FINISH_REASON_ERROR
            assert seen["good"].finish_reason == gpb.FINISH_REASON_LENGTH
            assert not worker.book.live and not worker.book.queued
    run(main())


def test_cancel_while_the_add_is_still_queued_sends_nothing_for_it():
    async def main():
        engine = FakeEngine(seats=4, length=3)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            with worker.engine_loop._wake:  # the engine thread cannot take the inbox yet
                assign(worker, assignment("a"), assignment("b"))
                worker._on_router_message(pb.RouterMessage(cancel=pb.CancelRequests(request_ids=["a"])))
            msgs = await w.settle(0.5)
            assert {d.request_id for d in deltas_of(msgs)} == {"b"}
            assert not engine.reqs and not worker.book.live and not worker.book.queued
    run(main())


def test_step_failing_after_sampling_hands_back_without_a_stray_token():
    """The failing step sampled a token for "a" before raising: that token is
    never reported, so the router resumes exactly after what it received."""
    async def main():
        engine = FakeEngine(seats=4, length=10**9)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            engine.hold = True
            assign(worker, assignment("a", max_tokens=10))
            await asyncio.sleep(0.1)
            engine.hold = False
            worker.engine_loop.request_report()
            got = []
            while len(got) < 2:
                got += [d for d in deltas_of([await w.next("step")]) if d.request_id == "a"]
            # Pause the scripted engine: unpaused it steps as fast as it can, and
            # its unread deltas would pile up in the outbox (gigabytes on a slow run).
            engine.hold = True
            got += [d for d in deltas_of(await w.settle()) if d.request_id == "a"]
            engine.fail_steps, engine.fail_after_sampling = 1, True
            engine.hold = False
            worker.engine_loop.request_report()
            msgs = []
            while not any(m.WhichOneof("kind") == "hand_back" for m in msgs):
                msgs.append(await w.next())
            assert [d for d in deltas_of(msgs) if d.request_id == "a"] == []
            assert "a" not in worker.book.live
    run(main())


def test_drain_timeout_holds_while_the_router_is_away():
    async def main():
        engine = FakeEngine(seats=2)
        engine.hold = True  # the request stays in hand until the drain gives it up
        worker = make_worker(engine, drain_timeout_s=0.3, reconnect_min_s=0.05, reconnect_max_s=0.1)
        task = asyncio.create_task(worker.run())  # its router address is unreachable
        await asyncio.sleep(0.2)
        assign(worker, assignment("a"))
        await asyncio.sleep(0.1)
        assert "a" in engine.reqs
        worker.begin_drain()
        # The lease (10 s by default) is far off; the drain timeout ends it.
        await asyncio.wait_for(task, 3)
        assert not engine.reqs and not worker.book.live
    run(main())


def test_the_credit_a_finish_frees_rides_in_its_step_when_the_router_takes_it():
    """A router whose Registered set step_credit gets a freed seat inside the
    StepOutputs that finished its request; one that did not (an older router)
    gets it as a Pull message after that step, or the replica would starve."""
    async def main(step_credit: bool):
        engine = FakeEngine(seats=1, tokens=100, length=1)
        worker = make_worker(engine)
        worker._step_credit = step_credit
        async with Wired(worker) as w:
            worker.engine_loop.request_report()
            assert (await w.next("pull")).pull.max_requests == 1
            assign(worker, assignment("a", max_tokens=1))
            msgs = [m for m in await w.settle(0.3) if m is not None]
        kinds = [m.WhichOneof("kind") for m in msgs]
        step = next(m.step for m in msgs if m.WhichOneof("kind") == "step")
        assert [d.request_id for d in step.deltas if d.HasField("finish_reason")] == ["a"]
        return kinds, step

    kinds, step = run(main(True))
    assert "pull" not in kinds, kinds
    assert step.HasField("pull") and step.pull.max_requests == 1
    kinds, step = run(main(False))
    assert not step.HasField("pull")
    assert kinds.index("pull") > kinds.index("step"), kinds


def test_a_drain_asked_for_while_registering_still_ends_the_stream():
    """begin_drain while the worker waits for its Registered reply (a SIGTERM right as a
    replica connects): nothing is in hand, so the drain is complete at once, and its
    half-close must still reach the router once the session is up. It was dropped (the
    session had no outbox yet), and worker and router then waited on each other forever."""
    registering, answer = asyncio.Event(), asyncio.Event()
    half_closed: list[bool] = []

    class ScriptedRouter(replica_pb2_grpc.ReplicaGatewayServicer):
        async def Connect(self, request_iterator, context):
            stream = request_iterator.__aiter__()
            first = await stream.__anext__()
            assert first.WhichOneof("kind") == "register"
            registering.set()
            await answer.wait()
            yield pb.RouterMessage(registered=pb.Registered(heartbeat_interval_s=0.5, lease_ttl_s=10,
                                                            step_credit=True))
            async for _ in stream:   # heartbeats, until the worker half-closes
                pass
            half_closed.append(True)

    async def main():
        server, port = await serve_router(ScriptedRouter())
        try:
            worker = make_worker(FakeEngine(seats=2), router=f"127.0.0.1:{port}")
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(registering.wait(), 10)
            worker.begin_drain()
            answer.set()
            await asyncio.wait_for(task, 5)
            assert half_closed == [True]
        finally:
            await server.stop(None)
    run(main())


def test_an_engine_that_holds_work_and_reports_nothing_is_taken_for_dead(monkeypatch):
    """A tensor-parallel rank frozen inside a collective leaves the engine silent
    for the collective's timeout (10-30 min) while the worker's heartbeats renew
    the leases; past ENGINE_STALL_S the worker hands the work back and exits."""
    monkeypatch.setattr(client, "ENGINE_STALL_S", 0.2)

    async def main():
        engine = FakeEngine(seats=4, length=10**9)
        worker = make_worker(engine)
        died = []
        worker._engine_died = died.append
        async with Wired(worker):
            engine.hold = True   # it stops stepping with the request in hand
            assign(worker, assignment("a", max_tokens=10))
            worker.engine_loop.request_report()
            await asyncio.sleep(0.1)
            assert worker._last_report is not None and worker._last_report.request_ids == ("a",)
            await asyncio.wait_for(worker._watch_engine(), 5)
        assert died == [70]
    run(main())
