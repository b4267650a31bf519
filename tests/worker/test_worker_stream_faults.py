"""The worker's stream to its router when something goes wrong on it: output
of an earlier assignment of the same id, an outbox the router does not drain,
a router that never answers Register. Scripted engine; a scripted gRPC router
where a real stream matters."""

import asyncio
import time


from common.pb.quadriga.v1 import replica_pb2 as pb
from common.pb.quadriga.v1 import replica_pb2_grpc
from replica_worker.worker import client
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker, serve_router


def test_output_of_an_earlier_assignment_of_the_same_id_is_not_sent_as_the_new_ones():
    """The router cancels a request and assigns it here again (a diverged request
    requeued, and this replica pulls it back): steps the engine computed for the
    old assignment before it took the cancel must not reach the router at offsets
    the new one never had (the router reads a gap as a fault and drops the replica)."""
    async def main():
        # Steps of a millisecond: with instant ones the engine thread outruns the loop,
        # and the new assignment's steps wait behind an ever longer backlog.
        engine = FakeEngine(seats=4, tokens=1000, length=10**9, step_s=0.001)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            worker._on_router_message(pb.RouterMessage(assign=pb.Assign(
                assignments=[assignment("x", max_tokens=10**6)])))
            await asyncio.sleep(0.05)
            while not worker._outbox.empty():   # what the router got of the old x
                w._acked(worker._outbox.get_nowait())
            time.sleep(0.05)   # the loop is busy; the engine thread goes on reporting the old x
            worker._on_router_message(pb.RouterMessage(cancel=pb.CancelRequests(request_ids=["x"])))
            again = assignment("x", max_tokens=10**6)
            again.resume_token_ids.extend([1, 1])   # what the router recorded of it
            worker._on_router_message(pb.RouterMessage(assign=pb.Assign(assignments=[again])))
            expected, seen, deadline = 2, 0, time.monotonic() + 10
            while seen < 20 and time.monotonic() < deadline:
                m = await w.next()
                if m is None or m.WhichOneof("kind") != "step":
                    continue
                for d in m.step.deltas:
                    if d.request_id == "x":
                        assert d.output_offset == expected, (d.output_offset, expected)
                        expected += len(d.token_ids)
                        seen += 1
            engine.hold = True
            assert seen, "the new assignment streamed nothing"

    asyncio.run(asyncio.wait_for(main(), 20))


class _AnsweringRouter(replica_pb2_grpc.ReplicaGatewayServicer):
    """Answers Register, then reads whatever comes; counts the Registers."""

    def __init__(self):
        self.registers = 0

    async def Connect(self, request_iterator, context):
        it = request_iterator.__aiter__()
        await it.__anext__()
        self.registers += 1
        yield pb.RouterMessage(registered=pb.Registered(heartbeat_interval_s=0.5, lease_ttl_s=10,
                                                        step_credit=True))
        async for _ in it:
            pass


def test_an_outbox_the_router_does_not_drain_reconnects_the_worker_goes_on():
    router = _AnsweringRouter()

    async def main():
        server, port = await serve_router(router)
        try:
            worker = make_worker(FakeEngine(seats=2), router=f"127.0.0.1:{port}",
                                 reconnect_min_s=0.05, reconnect_max_s=0.1)
            task = asyncio.create_task(worker.run())
            while worker._outbox is None:
                await asyncio.sleep(0.01)
            heartbeat = pb.ReplicaMessage(heartbeat=pb.Heartbeat())
            for _ in range(client.OUTBOX_LIMIT + 1):   # faster than anyone reads
                worker._send(heartbeat)
            deadline = time.monotonic() + 10
            while router.registers < 2 and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not task.done(), "the worker ended instead of reconnecting"
            assert router.registers >= 2
            worker.begin_drain()
            await asyncio.wait_for(task, 5)
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


class _SilentRouter(replica_pb2_grpc.ReplicaGatewayServicer):
    """Takes a stream and its Register, and never answers (a router whose join
    waits on a Redis that is away)."""

    def __init__(self):
        self.registers = 0
        self.got = asyncio.Event()

    async def Connect(self, request_iterator, context):
        await request_iterator.__aiter__().__anext__()
        self.registers += 1
        self.got.set()
        await asyncio.Event().wait()
        yield  # pragma: no cover


def test_sigterm_ends_a_worker_whose_router_never_answered_register():
    async def main():
        router = _SilentRouter()
        server, port = await serve_router(router)
        try:
            worker = make_worker(FakeEngine(seats=2), router=f"127.0.0.1:{port}", drain_timeout_s=0.5)
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(router.got.wait(), 10)
            worker.begin_drain()                 # nothing in hand: it may go at once
            await asyncio.wait_for(task, 5)
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_router_that_never_answers_register_is_left_for_another_try(monkeypatch):
    monkeypatch.setattr(client, "REGISTER_REPLY_TIMEOUT_S", 0.3)

    async def main():
        router = _SilentRouter()
        server, port = await serve_router(router)
        try:
            worker = make_worker(FakeEngine(seats=2), router=f"127.0.0.1:{port}",
                                 reconnect_min_s=0.05, reconnect_max_s=0.1)
            task = asyncio.create_task(worker.run())
            deadline = time.monotonic() + 10
            while router.registers < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert router.registers >= 2 and not task.done()
            worker.begin_drain()
            await asyncio.wait_for(task, 5)
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_worker_whose_engine_reports_stop_being_read_ends():
    """The task that turns engine reports into messages failed: the worker would
    renew its leases and send nothing. It ends instead, so its work resumes elsewhere."""
    async def main():
        server, port = await serve_router(_AnsweringRouter())
        try:
            worker = make_worker(FakeEngine(seats=2), router=f"127.0.0.1:{port}")

            def broken(_report):
                raise ValueError("a report that cannot be sent")
            worker._send_report = broken
            task = asyncio.create_task(worker.run())
            await asyncio.sleep(0.2)
            worker.engine_loop.request_report()   # a report to read, whatever came before
            done, _ = await asyncio.wait({task}, timeout=5)
            assert done and isinstance(task.exception(), ValueError)
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))
