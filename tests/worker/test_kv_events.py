"""The worker tells the router its prefix cache: a whole snapshot at Register,
then each step's changes in its StepOutputs, so the router's view equals the
engine's cache at every message."""

import asyncio

from common.block_hash import SCHEME
from common.pb.quadriga.v1 import replica_pb2 as pb
from replica_worker.engine.kv_events import KVCacheEvents
from replica_worker.worker.kv_mirror import KVMirror
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker
from tests.worker.test_worker import assign, run


class RouterView:
    """What a router rebuilds from the messages, the way router/prefix does."""

    def __init__(self, snapshot: pb.PrefixCache):
        self.hashes = set(snapshot.block_hashes)
        self.messages = 0

    def apply(self, msgs) -> None:
        for m in msgs:
            if m is None or m.WhichOneof("kind") != "step" or not m.step.HasField("kv_events"):
                continue
            ev = m.step.kv_events
            self.messages += 1
            if ev.cleared:
                self.hashes = set(ev.stored)
            else:
                self.hashes.difference_update(ev.evicted)
                self.hashes.update(ev.stored)


async def until_idle(engine, wired):
    while engine.reqs:
        await asyncio.sleep(0.01)
    return await wired.settle(0.1)


def test_register_snapshot_then_step_events_follow_the_engine_cache():
    async def main():
        engine = FakeEngine(prefix_cache=True, block_size=4)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            reg = worker._prefix_cache_pb()   # what Register carries
            assert (reg.block_size, reg.hash_scheme, reg.hash_salt) == (4, SCHEME, b"")
            assert list(reg.block_hashes) == []
            view = RouterView(reg)
            assign(worker, assignment("a", prompt=range(1, 10)))   # 9 tokens: 2 full blocks
            msgs = await until_idle(engine, w)
            view.apply(msgs)
            stored = engine.block_hasher.hashes(list(range(1, 10)))
            assert view.hashes == set(stored) == engine.cache
            # Events ride on the step that has deltas: no extra message for them.
            with_events = [m for m in msgs if m.WhichOneof("kind") == "step" and m.step.HasField("kv_events")]
            assert len(with_events) == 1 and with_events[0].step.deltas

            engine.evict_next_step.append(stored[1])
            assign(worker, assignment("b", prompt=range(50, 58)))
            view.apply(await until_idle(engine, w))
            assert view.hashes == engine.cache and stored[1] not in view.hashes
            # A re-registration sends the whole cache again.
            assert set(worker._prefix_cache_pb().block_hashes) == engine.cache
    run(main())


def test_changes_while_registering_are_sent_once_registered():
    """Between Register (the snapshot) and the router's answer nothing can be sent;
    those changes go out right after Registered, so nothing is missed."""
    async def main():
        engine = FakeEngine(prefix_cache=True, block_size=4)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            view = RouterView(worker._prefix_cache_pb())
            outbox, worker._outbox = worker._outbox, None   # registering: no stream yet
            assign(worker, assignment("a", prompt=range(1, 13)))
            while engine.reqs or not worker._reports.empty():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            worker._outbox = outbox
            worker._on_registered(pb.Registered())
            view.apply(await w.settle(0.1))
            assert len(view.hashes) == 3 and view.hashes == engine.cache
    run(main())


def test_an_overflowing_engine_log_replaces_the_view():
    async def main():
        engine = FakeEngine(prefix_cache=True, block_size=1, max_pending_events=4)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            view = RouterView(worker._prefix_cache_pb())
            view.hashes.add(12345)   # something the router holds that the cache does not
            assign(worker, assignment("a", prompt=range(1, 10)))   # 9 blocks > 4: cleared
            msgs = await until_idle(engine, w)
            assert any(m.step.kv_events.cleared for m in msgs if m.WhichOneof("kind") == "step")
            view.apply(msgs)
            assert view.hashes == engine.cache and len(view.hashes) == 9
    run(main())


def test_no_prefix_cache_no_snapshot_and_no_events():
    async def main():
        engine = FakeEngine(prefix_cache=False)
        worker = make_worker(engine)
        async with Wired(worker) as w:
            assert worker._prefix_cache_pb() is None
            assign(worker, assignment("a", prompt=range(1, 10)))
            msgs = await until_idle(engine, w)
            steps = [m.step for m in msgs if m.WhichOneof("kind") == "step"]
            assert steps and not any(s.HasField("kv_events") for s in steps)
    run(main())


def test_mirror_keeps_only_net_changes_and_collapses_past_its_bound():
    mirror = KVMirror([1, 2], max_pending=3)
    mirror.apply(KVCacheEvents(stored=(3,)))      # no session: nothing pending
    assert mirror.take() is None and mirror.hashes == {1, 2, 3}
    assert sorted(mirror.snapshot()) == [1, 2, 3]
    mirror.apply(KVCacheEvents(stored=(4,), evicted=(1,)))
    mirror.apply(KVCacheEvents(evicted=(4,)))
    taken = mirror.take()
    assert (taken.stored, sorted(taken.evicted), taken.cleared) == ((), [1, 4], False)
    assert mirror.take() is None
    mirror.apply(KVCacheEvents(stored=(5, 6, 7, 8)))   # 4 pending > 3
    taken = mirror.take()
    assert taken.cleared and set(taken.stored) == {2, 3, 5, 6, 7, 8} == mirror.hashes
    mirror.apply(KVCacheEvents(stored=(9,), cleared=True))
    assert mirror.hashes == {9} and mirror.take() == KVCacheEvents(stored=(9,), cleared=True)
    mirror.end_session()
    mirror.apply(KVCacheEvents(stored=(10,)))
    assert mirror.take() is None
