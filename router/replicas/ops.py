"""What the router does with each replica message and with a replica's
coming and going. Request state changes only through the request table;
credit and placement only through the pull scheduler.

How a replica leaves decides what happens to its work:
- its stream breaks (network, router-side errors, the process died): its
  requests stay bound to it, DETACHED, until their lease lapses; if it
  re-registers in time holding them, they run on with nothing recomputed;
- it broke the protocol, or was silent for a whole lease: its output cannot
  be trusted or its leases have lapsed, so its work is requeued at once;
- it handed work back (drain, a recoverable engine error): requeued at once.

The router's view of the replica's prefix cache (router/prefix/index.py)
follows the same rule: replaced by the snapshot of every Register, kept
while a broken stream may still come back within a lease, dropped at once
when the replica was dropped.

A replica may register with any router; requests it holds that another
router ran (that router died, or the replica moved on after a break) are
adopted at Register (lua_routers.ADOPT): this router becomes their back
router and they run on, nothing recomputed.
"""

from __future__ import annotations

import logging
import time

from common.pb.quadriga.v1 import generation_pb2 as gpb
from router.persistence.store import record_from_flat
from router.requests.request import Phase

log = logging.getLogger(__name__)


class ReplicaFault(Exception):
    """A protocol violation: the replica is dropped and its work requeued."""


class ReplicaOps:
    def __init__(self, table, scheduler, registry, metrics, vocab_size: int, lease_ttl: float,
                 store, writer, prefix_index):
        self.table = table
        self.scheduler = scheduler
        self.registry = registry
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.lease_ttl = lease_ttl
        self.store = store
        self.writer = writer
        self.prefix_index = prefix_index

    # ---- membership ----
    def check_prefix_hasher(self, replica_id: str, hasher) -> None:
        """Raises HasherMismatch unless the replica addresses blocks as the others do."""
        self.prefix_index.check_hasher(replica_id, hasher)

    async def join(self, session, held: list[str], cached_hashes=()) -> list[str]:
        """Registers the session; returns the held requests it keeps running.
        Raises PermanentWriteError when Redis refuses (this router is fenced), and
        HasherMismatch (nothing registered) when another replica addressing its
        cache's blocks otherwise joined first."""
        mine = {r.id for r in self.table.owned_by(session.id)}
        foreign = [rid for rid in dict.fromkeys(held) if rid not in mine]
        records = await self.writer.call(self.store.adopt(session.id, time.time() + self.lease_ttl,
                                                          foreign))
        if session.prefix_hasher is not None:
            # Again, before anything is registered: a replica addressing blocks another
            # way may have joined while this one waited on Redis. Its adopted leases
            # lapse and the reaper requeues them.
            self.prefix_index.check_hasher(session.id, session.prefix_hasher)
        old = self.registry.add(session)
        if old is not None:
            old.close(None)
            self.scheduler.detach(old)
        if session.prefix_hasher is not None:
            self.prefix_index.replace(session.id, session.prefix_hasher, cached_hashes)
        else:
            self.prefix_index.drop(session.id)
        held_set = set(held)
        keep = []
        for rid, flat in zip(foreign, records):
            rec = record_from_flat(rid, flat)
            if rec is not None and self.table.take_over(rec, session.id) is not None:
                session.rebound.add(rid)
                keep.append(rid)
        for req in self.table.owned_by(session.id):
            if req.id in keep:
                continue
            if req.id in held_set:
                self.table.adopt(req, session.id)
                session.rebound.add(req.id)
                keep.append(req.id)
            else:
                # Bound to this replica, which no longer has it: resume it elsewhere.
                self.table.requeue(req, self.scheduler.requeue_queue(req, None), "lost_by_replica")
        self.metrics.replicas.set(len(self.registry))
        self.scheduler.attach(session)
        return keep

    def leave(self, session, requeue_now: bool, reason: str) -> None:
        """The session ended. Synchronous: it must complete even while the
        stream's handler is being cancelled."""
        if not self.registry.remove(session):
            return  # replaced by a newer session of the same replica
        self.scheduler.detach(session)
        self.writer.post(self.store.replica_left(session.id))
        if requeue_now:
            self.prefix_index.drop(session.id)
        else:
            self.prefix_index.depart(session.id, time.monotonic() + self.lease_ttl)
        deadline = time.time() + self.lease_ttl if not requeue_now else 0.0
        for req in self.table.owned_by(session.id):
            if requeue_now:
                self.table.requeue(req, self.scheduler.requeue_queue(req, session.id), reason)
            elif req.phase is Phase.RUNNING:
                self.table.detach(req, deadline)
        self.metrics.replicas.set(len(self.registry))
        if not self.table.owned_by(session.id):
            self._forget(session.id)

    def _forget(self, replica_id: str) -> None:
        self.table.forget_replica(replica_id)
        self.metrics.forget_replica(replica_id)

    def expire_prefix_views(self, mono_now: float) -> None:
        """Drops the cache views of replicas whose stream broke a lease ago."""
        for replica_id in self.prefix_index.expire(mono_now):
            log.info("replica %s did not come back: its prefix cache view is dropped", replica_id)

    def lease_lapsed(self, req) -> None:
        """A DETACHED request whose replica did not come back in time."""
        owner = req.owner
        self.table.requeue(req, self.scheduler.requeue_queue(req, owner), "lease_expired")
        if owner not in self.registry.sessions and not self.table.owned_by(owner):
            self._forget(owner)

    def drain(self, replica_id: str) -> bool:
        """Asks a replica to stop taking work (scale-in); its queue moves elsewhere."""
        from common.pb.quadriga.v1 import replica_pb2 as rpb

        session = self.registry.get(replica_id)
        if session is None:
            return False
        session.draining = True
        session.send(rpb.RouterMessage(drain=rpb.Drain()))
        self.scheduler.draining(session)
        return True

    # ---- messages ----
    def on_pull(self, session, pull) -> None:
        # A Pull grants credit on top of what is outstanding (replica.proto), so
        # a grant crossing an Assign on the wire over-commits the replica by at
        # most the one prompt a grant's last assignment may overrun.
        tokens = pull.max_prompt_tokens if pull.HasField("max_prompt_tokens") else None
        self.scheduler.on_pull(session, pull.max_requests, tokens)

    def on_hand_back(self, session, msg) -> None:
        for rid in msg.request_ids:
            req = self.table.get(rid)
            if req is not None and req.owner == session.id and req.live:
                self.table.requeue(req, self.scheduler.requeue_queue(req, session.id), "hand_back")

    def on_step(self, session, step) -> None:
        if step.HasField("kv_events"):
            self._on_kv_events(session, step.kv_events)
            if not step.deltas:
                return  # events alone: nothing to record or acknowledge
        if session.prefill_rate.observe(step.num_tokens, step.batch_size, step.step_time_s):
            self.metrics.prefill_rate_of(session.id).set(session.prefill_tokens_per_s)
        diverged: list = []
        items = self.check_step(session, step, diverged)
        if diverged:
            session.send_cancel([r.id for r in diverged])
            for req in diverged:
                self.table.requeue(req, self.scheduler.requeue_queue(req, session.id), "diverged")
        step_id = step.step_id
        self.table.record_step(items, session.id, lambda: session.send_ack(step_id))

    def _on_kv_events(self, session, events) -> None:
        if session.prefix_hasher is None:
            raise ReplicaFault("KV events from a replica that registered no prefix cache")
        self.prefix_index.apply(session.id, events.stored, events.evicted, events.cleared)

    def check_step(self, session, step, diverged: list) -> list:
        """Validates a whole StepOutputs before any of it is applied.

        A request kept across a router restart may have lost its last steps in
        the crash; its first delta then does not continue the recorded output.
        That one request is cancelled on the replica and requeued (it resumes
        from what was recorded); any other mismatch is a fault.
        """
        next_offset: dict[str, int | None] = {}
        items = []
        for d in step.deltas:
            rid = d.request_id
            req = self.table.get(rid)
            if req is None or req.owner != session.id or req.phase is not Phase.RUNNING:
                if rid in session.released or (req is not None and req.finished):
                    continue  # cancelled by the router; the replica had not seen it yet
                raise ReplicaFault(f"delta for request {rid!r}, which is not assigned to this replica")
            expected = next_offset.get(rid, len(req.tokens))
            if expected is None:
                raise ReplicaFault(f"delta for request {rid!r} after its finish")
            if rid in session.rebound:
                # After re-registering, a replica resends what the router did not
                # acknowledge: what is already recorded is skipped; a gap means the
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
            if d.token_ids and max(d.token_ids) >= self.vocab_size:
                raise ReplicaFault(f"request {rid!r}: token id {max(d.token_ids)} >= vocab "
                                   f"{self.vocab_size}")
            end = expected + len(d.token_ids)
            if end > req.max_tokens:
                raise ReplicaFault(f"request {rid!r}: {end} tokens, more than max_tokens {req.max_tokens}")
            finished = d.HasField("finish_reason")
            if finished and d.finish_reason == gpb.FINISH_REASON_UNSPECIFIED:
                raise ReplicaFault(f"request {rid!r}: finish_reason UNSPECIFIED")
            next_offset[rid] = None if finished else end
            items.append((req, d))
        return items
