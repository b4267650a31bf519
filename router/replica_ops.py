"""What the router does with each replica message: registration, Pull, step
outputs (the per-token hot path), hand back, and a replica's departure."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.policies import PENDING, replica_queue
from router.requests import Phase
from router.store import pack_tokens

if TYPE_CHECKING:
    from router.core import RouterCore
    from router.registry import ReplicaSession


class ReplicaFault(Exception):
    """A protocol violation: the replica is dropped and its work requeued."""


class ReplicaOps:
    def __init__(self, core: "RouterCore"):
        self.core = core

    # ---- membership ----
    async def join(self, session: "ReplicaSession", held: list[str]) -> list[str]:
        """Registers the session; returns the held requests it keeps running."""
        core = self.core
        old = core.registry.add(session)
        keep = [rid for rid in dict.fromkeys(held) if self._adopt(session, old, rid)]
        lost = [rid for rid, (owner, _) in core.orphans.items() if owner == session.id]
        await core.requeue_orphans(lost)  # it re-registered without them: they are gone
        if old is not None:
            old.close(None)
            await self.leave(old, "replaced")
        core.metrics.replicas.set(len(core.registry))
        core.policy.on_replica_joined(session)
        if core.policy.per_replica_queues:
            await core.redistribute(PENDING)
        core.dispatcher.kick()
        return keep

    def _adopt(self, session, old, rid: str) -> bool:
        core = self.core
        req = core.requests.get(rid)
        if req is None or req.phase is not Phase.RUNNING:
            return False
        if req.owner is None:
            orphan = core.orphans.get(rid)
            if orphan is None or orphan[0] != session.id:
                return False
            del core.orphans[rid]
        elif old is None or req.owner is not old:
            return False
        else:
            old.owned.pop(rid, None)
            core.metrics.inflight_of(old.id).dec()
        req.owner = session
        session.owned[rid] = req
        session.rebound.add(rid)
        core.metrics.inflight_of(session.id).inc()
        return True

    async def leave(self, session: "ReplicaSession", reason: str) -> None:
        if session.gone:
            return
        session.gone = True
        session.close(None)
        core = self.core
        removed = core.registry.remove(session)
        await core.requeue_owned(session, list(session.owned.values()), reason)
        core.metrics.replicas.set(len(core.registry))
        core.policy.on_replica_left(session)
        if removed and core.policy.per_replica_queues:
            await core.redistribute(replica_queue(session.id), exclude=session)

    async def drain(self, replica_id: str) -> bool:
        """Asks a replica to stop taking work (scale-in); its queue moves elsewhere."""
        session = self.core.registry.get(replica_id)
        if session is None:
            return False
        session.draining = True
        session.send(rpb.RouterMessage(drain=rpb.Drain()))
        if self.core.policy.per_replica_queues:
            await self.core.redistribute(replica_queue(replica_id), exclude=session)
        return True

    # ---- messages ----
    def on_pull(self, session: "ReplicaSession", pull: rpb.Pull) -> None:
        # A Pull grants credit on top of what is outstanding (replica.proto), so
        # a grant crossing an Assign on the wire over-commits the replica by at
        # most the one prompt a grant's last assignment may overrun.
        session.pull_requests += pull.max_requests
        if not pull.HasField("max_prompt_tokens"):
            session.pull_unlimited_tokens = True
        else:
            session.pull_tokens = (0 if session.pull_unlimited_tokens else session.pull_tokens) \
                + pull.max_prompt_tokens
            session.pull_unlimited_tokens = False
        session.pull_at = time.monotonic()
        self.core.policy.on_pull(session)
        self.core.dispatcher.kick()

    async def on_hand_back(self, session: "ReplicaSession", msg: rpb.HandBack) -> None:
        reqs = [session.owned[r] for r in msg.request_ids if r in session.owned]
        await self.core.requeue_owned(session, reqs, "hand_back")

    async def _requeue_diverged(self, session: "ReplicaSession", reqs: list) -> None:
        ids = [r.id for r in reqs]
        for rid in ids:
            session.remember_released(rid)
        session.send(rpb.RouterMessage(cancel=rpb.CancelRequests(request_ids=ids)))
        await self.core.requeue_owned(session, reqs, "diverged")

    def check_step(self, session: "ReplicaSession", step: rpb.StepOutputs,
                   diverged: list) -> list:
        """Validates a whole StepOutputs before any of it is applied.

        A request kept across a router restart may have lost its last steps in
        the crash; its first delta then does not continue the recorded output.
        That one request is cancelled on the replica and requeued (it resumes
        from what was recorded); any other mismatch is a fault.
        """
        vocab = self.core.limits.vocab_size
        next_offset: dict[str, int | None] = {}
        items = []
        for d in step.deltas:
            rid = d.request_id
            req = session.owned.get(rid)
            if req is None:
                if rid in session.released:
                    continue  # cancelled by the router; the replica had not seen it yet
                raise ReplicaFault(f"delta for request {rid!r}, which is not assigned to this replica")
            expected = next_offset.get(rid, len(req.tokens))
            if expected is None:
                raise ReplicaFault(f"delta for request {rid!r} after its finish")
            if rid in session.rebound:
                # After re-registering, a replica resends what it sent before the
                # break: what is already recorded is skipped; a gap means the
                # replica lost output, and the request resumes from the record.
                end = d.output_offset + len(d.token_ids)
                if d.output_offset < expected and end <= expected and not d.HasField("finish_reason"):
                    continue
                session.rebound.discard(rid)
                if d.output_offset != expected:
                    diverged.append(req)
                    next_offset[rid] = None
                    continue
            if d.output_offset != expected:
                raise ReplicaFault(f"request {rid!r}: output_offset {d.output_offset}, expected "
                                   f"{expected} (a gap or a duplicate)")
            if d.token_ids and max(d.token_ids) >= vocab:
                raise ReplicaFault(f"request {rid!r}: token id {max(d.token_ids)} >= vocab {vocab}")
            end = expected + len(d.token_ids)
            if end > req.max_tokens:
                raise ReplicaFault(f"request {rid!r}: {end} tokens, more than max_tokens {req.max_tokens}")
            finished = d.HasField("finish_reason")
            if finished and d.finish_reason == gpb.FINISH_REASON_UNSPECIFIED:
                raise ReplicaFault(f"request {rid!r}: finish_reason UNSPECIFIED")
            next_offset[rid] = None if finished else end
            items.append((req, d))
        return items

    async def on_step(self, session: "ReplicaSession", step: rpb.StepOutputs) -> None:
        diverged: list = []
        items = self.check_step(session, step, diverged)
        if diverged:
            await self._requeue_diverged(session, diverged)
        if not items:
            return
        core, metrics = self.core, self.core.metrics
        now = time.time()
        args: list = []
        ttft, tbt = [], []
        for req, d in items:
            tokens = d.token_ids
            ft = fs = ""
            if tokens:
                if req.first_token_at:
                    tbt.append(now - req.last_token_at)
                else:
                    ttft.append(now - req.arrival)
                    ft = repr(now)
            req.append(tokens, d.text, now)
            if d.first_scheduled_at and not req.first_scheduled_at:
                req.first_scheduled_at = d.first_scheduled_at
                fs = repr(d.first_scheduled_at)
            if d.preemptions:
                req.preemptions = req.preemption_base + d.preemptions
            packed = pack_tokens(tokens) if tokens else b""
            if d.HasField("finish_reason"):
                req.replica_id = session.id
                core.finish_local(req, d.finish_reason, d.error)
                args += (req.id, packed, d.text, repr(req.first_token_at),
                         repr(req.first_scheduled_at), 1, req.finish_reason, req.error,
                         req.replica_id, repr(req.finished_at), req.preemptions,
                         repr(req.assigned_at))
            else:
                args += (req.id, packed, d.text, ft, fs, 0, "", "", "", "", "", "")
        for v in ttft:
            metrics.ttft.observe(v)
        for v in tbt:
            metrics.tbt.observe(v)
        try:
            await core.store.write_steps(args)  # durable before any client sees it
        except Exception as exc:
            # Memory is ahead of Redis: rewrite these from memory once Redis
            # answers (their clients are woken then); the replica is dropped.
            core.mark_dirty([req for req, _ in items], exc, output=True)
            raise
        for req, _ in items:
            req.notify()
