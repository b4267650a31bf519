"""The router's view of its replicas' caches, fed over the real replica stream by
scripted replicas: snapshots at Register, KV events, a replica whose blocks
differ, a stream blip, a replica that leaves for good, and a router restart."""

import asyncio

import grpc

from common.block_hash import BlockHasher
from common.pb.quadriga.v1 import replica_pb2 as rpb
from common.pb.quadriga.v1 import replica_pb2_grpc
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import (Replicas, client, collect, free_port, make_config,
                                          request, running_router)

H16 = BlockHasher(16)


def chain(n: int, seed: int = 0) -> list[int]:
    return H16.hashes([seed * 1000 + i for i in range(16 * n)])


def test_register_snapshot_and_events_make_the_view(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            a = chain(4)
            rep = await reps.add("r0", prefix_cache=True, cached=tuple(a[:2]), cache_prompts=True)
            index = app.prefix_index
            assert index.hashes_of("r0") == set(a[:2])
            rep.store(a[2:])
            await wait_until(lambda: index.hashes_of("r0") == set(a))
            rep.evict(a[3:])
            await wait_until(lambda: index.hashes_of("r0") == set(a[:3]))
            b = chain(2, seed=5)
            rep.replace_cache(b)
            await wait_until(lambda: index.hashes_of("r0") == set(b))
            # An engine caches what it computes: a prompt's full blocks reach the view.
            prompt = list(range(200, 200 + 40))
            async with client(app.address) as stub:
                await collect(stub, request(prompt, 3))
            await wait_until(lambda: set(H16.hashes(prompt)) <= index.hashes_of("r0"))
            assert app.registry.get("r0") is not None, "events alone are not a fault"
            await reps.close()

    arun(scenario())


async def register_raw(address: str, register: rpb.Register):
    """Registers by hand; returns (status code, details) of how the stream ended."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = replica_pb2_grpc.ReplicaGatewayStub(channel).Connect()
        await call.write(rpb.ReplicaMessage(register=register))
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


def test_a_replica_addressing_blocks_otherwise_is_refused(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            await reps.add("r0", prefix_cache=True, cached=tuple(chain(2)))
            code, details = await register_raw(app.address, rpb.Register(
                replica_id="r1", prefix_cache=rpb.PrefixCache(block_size=32, hash_scheme="blake2b64-v1")))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "block size 32" in details and "'r0' uses block size 16" in details
            code, details = await register_raw(app.address, rpb.Register(
                replica_id="r2", prefix_cache=rpb.PrefixCache(block_size=16, hash_scheme="md5-v0")))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "md5-v0" in details
            assert set(app.registry.sessions) == {"r0"} and "r1" not in app.prefix_index
            await reps.close()

    arun(scenario())


def test_two_replicas_addressing_blocks_differently_joining_at_once(redis_url, tiny_model, arun):
    """Both pass the gateway's check while no view exists, then both wait on
    Redis to join: the second to finish is refused whole, never left registered
    without a place in the scheduler (a session no leave() would end)."""
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            ops, entered, gate = app.ops, [], asyncio.Event()
            real_call = ops.writer.call

            async def gated_call(write):   # the adopt of each join waits for both
                entered.append(write)
                if len(entered) <= 2:
                    if len(entered) == 2:
                        gate.set()
                    await gate.wait()
                return await real_call(write)

            ops.writer.call = gated_call
            joins = {asyncio.create_task(register_raw(app.address, rpb.Register(
                replica_id=rid, prefix_cache=rpb.PrefixCache(block_size=size, hash_scheme="blake2b64-v1"))))
                for rid, size in (("r0", 16), ("r1", 32))}
            done, pending = await asyncio.wait(joins, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            ops.writer.call = real_call
            assert len(done) == 1 and len(pending) == 1, "one is refused, the other stays"
            code, details = done.pop().result()
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "cannot join" in details, details
            assert len(app.registry.sessions) == 1
            assert set(app.registry.sessions) == set(app.scheduler._sessions)
            pending.pop().cancel()

    arun(scenario())


def test_kv_events_from_a_replica_without_a_cache_are_a_fault(redis_url, tiny_model, arun):
    async def scenario():
        async with running_router(make_config(redis_url, tiny_model)) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            rep = await reps.add("r0")
            rep.store(chain(1))
            await wait_until(lambda: rep.rec.errors)
            assert rep.rec.errors == [grpc.StatusCode.FAILED_PRECONDITION]
            await reps.close()

    arun(scenario())


def test_a_blip_replaces_the_view_and_leaving_for_good_drops_it(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, lease_ttl=1.0, heartbeat_interval=0.25)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            index = app.prefix_index
            a = chain(3)
            blip = await reps.add("blip", prefix_cache=True, cached=tuple(a), reconnect=True,
                                  fail_after_steps=1)
            gone = await reps.add("gone", prefix_cache=True, cached=tuple(a))
            silent = await reps.add("silent", prefix_cache=True, cached=tuple(a), stop_heartbeats=True)
            assert {r: index.size_of(r) for r in ("blip", "gone", "silent")} == {
                "blip": 3, "gone": 3, "silent": 3}
            # A stream blip: the replica re-registers with what it holds then.
            blip.cache = set(a[:1])
            async with client(app.address) as stub:
                await collect(stub, request([1, 2], 2, request_id="x"))
            await wait_until(lambda: len(blip.rec.registered) >= 2)
            await wait_until(lambda: index.hashes_of("blip") == {a[0]})
            # A stream that ends and does not come back: its view lasts a lease.
            await reps.kill("gone")
            await asyncio.sleep(0.3)
            assert index.size_of("gone") == 3
            await wait_until(lambda: "gone" not in index, timeout=5)
            # A replica dropped for silence: at once.
            await wait_until(lambda: app.registry.get("silent") is None, timeout=5)
            assert "silent" not in index
            assert "blip" in index
            await reps.close()

    arun(scenario())


def test_a_restarted_router_has_the_whole_view_at_once(redis_url, tiny_model, arun):
    async def scenario():
        cfg = make_config(redis_url, tiny_model, port=free_port())
        a, b = chain(5), chain(2, seed=7)
        async with running_router(cfg) as app:
            reps = Replicas(app.address, app.limits.vocab_size)
            r0 = await reps.add("r0", prefix_cache=True, cached=tuple(a[:2]), reconnect=True)
            await reps.add("r1", prefix_cache=True, cached=tuple(b), reconnect=True)
            r0.store(a[2:])
            await wait_until(lambda: app.prefix_index.size_of("r0") == 5)
        async with running_router(cfg) as app:
            await wait_until(lambda: set(app.registry.sessions) == {"r0", "r1"}, timeout=10)
            assert app.prefix_index.hashes_of("r0") == set(a)
            assert app.prefix_index.hashes_of("r1") == set(b)
            await reps.close()

    arun(scenario())
