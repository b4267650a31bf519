"""ReplicaGateway servicer: one bidirectional Connect stream per replica.

The first message must be Register; after that Pull, Heartbeat, StepOutputs
and HandBack in any order. A protocol violation (or malformed bytes) drops
the stream, the replica sees the status with the reason, and its work is
requeued; the router itself carries on. A stream that merely ends leaves the
replica's work with it until its lease lapses (ops.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import grpc

from common.block_hash import BlockHasher
from common.pb.quadriga.v1 import replica_pb2 as rpb
from common.pb.quadriga.v1 import replica_pb2_grpc
from router.malformed import MalformedMessage, check_message
from router.persistence.writer import PermanentWriteError
from router.prefix.index import HasherMismatch
from router.replicas.ops import ReplicaFault
from router.replicas.registry import ReplicaSession

log = logging.getLogger(__name__)
CONNECT_METHOD = "/quadriga.v1.ReplicaGateway/Connect"


class ReplicaGateway(replica_pb2_grpc.ReplicaGatewayServicer):
    def __init__(self, ops, config, metrics, lifecycle):
        self.ops = ops
        self.config = config
        self.metrics = metrics
        self.lifecycle = lifecycle       # .stopping: refuse new streams during shutdown
        kinds = ("register", "pull", "heartbeat", "step", "hand_back", "none")
        self._in = {k: metrics.messages_in.labels(k) for k in kinds}

    async def _register(self, it, context) -> rpb.Register:
        try:
            first = check_message(await asyncio.wait_for(it.__anext__(), self.config.register_timeout))
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no Register within {self.config.register_timeout:g} s")
        except MalformedMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if first.WhichOneof("kind") != "register":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the first message on Connect must be Register")
        reg = first.register
        self._in["register"].inc()
        token = self.config.replica_token
        if token and not hmac.compare_digest(reg.auth_token.encode(), token.encode()):
            self.metrics.rejections.labels("replica_auth").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "replica auth_token is missing or wrong (router requires "
                                "QUADRIGA_REPLICA_TOKEN)")
        if not reg.replica_id or not reg.replica_id.isprintable() or len(reg.replica_id) > 200:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Register.replica_id must be non-empty printable text")
        served = self.config.served_model_name
        if reg.model and reg.model != served:
            # Its outputs would not match what clients asked this router for.
            self.metrics.rejections.labels("replica_model").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"replica serves model {reg.model!r}; this router serves {served!r} "
                                "(set the same QUADRIGA_MODEL_NAME / QUADRIGA_ROUTER_MODEL_NAME)")
        return reg

    async def _prefix_hasher(self, reg: rpb.Register, context) -> BlockHasher | None:
        """How the replica addresses its cache's blocks; refused unless every replica
        of this router does it alike (the router computes one set of hashes)."""
        if not reg.HasField("prefix_cache"):
            return None
        pc = reg.prefix_cache
        try:
            hasher = BlockHasher(pc.block_size, pc.hash_salt, pc.hash_scheme)
            self.ops.check_prefix_hasher(reg.replica_id, hasher)
        except (ValueError, HasherMismatch) as exc:
            self.metrics.rejections.labels("replica_prefix_cache").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"replica {reg.replica_id!r} cannot join: {exc}")
        return hasher

    async def Connect(self, request_iterator, context):
        if self.lifecycle.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        it = request_iterator.__aiter__()
        reg = await self._register(it, context)
        hasher = await self._prefix_hasher(reg, context)
        session = ReplicaSession(reg.replica_id, reg, self.metrics, hasher)
        try:
            keep = await self.ops.join(session, list(reg.held_request_ids),
                                       reg.prefix_cache.block_hashes)
        except PermanentWriteError as exc:  # fenced: this router is starting over
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the router cannot take replicas: {exc}")
        except HasherMismatch as exc:  # another replica's cache joined while this one waited
            self.metrics.rejections.labels("replica_prefix_cache").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"replica {reg.replica_id!r} cannot join: {exc}")
        log.info("replica %s joined (model %s, keeps %d)", session.id, reg.model, len(keep))
        session.send(rpb.RouterMessage(registered=rpb.Registered(
            heartbeat_interval_s=self.config.heartbeat_interval, lease_ttl_s=self.config.lease_ttl,
            policy=self.config.policy, keep_request_ids=keep, step_credit=True)))
        outcome = {"requeue": False, "reason": "stream_ended"}
        reader = asyncio.get_running_loop().create_task(self._read(it, session, outcome))
        try:
            while True:
                msg = await session.outbox.get()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            self.ops.leave(session, outcome["requeue"], outcome["reason"])
        if session.close_status is not None:
            await context.abort(*session.close_status)

    async def _read(self, it, session: ReplicaSession, outcome: dict) -> None:
        ops = self.ops
        try:
            async for msg in it:
                if session.closed:
                    return
                check_message(msg)
                session.last_seen = time.monotonic()
                kind = msg.WhichOneof("kind")
                self._in[kind or "none"].inc()
                if kind == "step":
                    ops.on_step(session, msg.step)
                    if msg.step.HasField("pull"):
                        ops.on_pull(session, msg.step.pull)  # after the deltas whose finishes freed it
                elif kind == "pull":
                    ops.on_pull(session, msg.pull)
                elif kind == "heartbeat":
                    pass  # last_seen above keeps the replica's leases renewed
                elif kind == "hand_back":
                    ops.on_hand_back(session, msg.hand_back)
                elif kind == "register":
                    raise ReplicaFault("Register sent twice on one stream")
                else:
                    raise ReplicaFault("message with no kind set")
            session.close(None)
        except (ReplicaFault, MalformedMessage) as fault:
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(fault, MalformedMessage) \
                else grpc.StatusCode.FAILED_PRECONDITION
            log.warning("dropping replica %s: %s", session.id, fault)
            self.metrics.replica_faults.inc()
            outcome.update(requeue=True, reason="replica_fault")
            session.close(code, f"protocol violation: {fault}")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            log.info("replica %s stream ended: %s", session.id, exc.code())
            session.close(None)
        except Exception as exc:
            log.exception("replica %s: unexpected error", session.id)
            session.close(grpc.StatusCode.INTERNAL, f"router error: {exc}")
