"""Live replica streams: one ReplicaSession per connected Connect stream."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict

import grpc

from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.replicas import wire
from router.replicas.prefill_rate import PrefillRate

_join_seq = itertools.count()
OUTBOX_LIMIT = 10_000     # messages waiting to be written to one replica
RELEASED_LIMIT = 10_000   # cancelled ids remembered per session (late deltas are fine)
# Acks are cumulative; at most one per replica per this many seconds. They only
# bound the replica's replay history (what it resends after a broken stream),
# so a short delay costs nothing, while an Ack per writer flush cost the router
# an outgoing message per step under load (more than the client's own).
ACK_INTERVAL_S = 0.05


class ReplicaSession:
    def __init__(self, replica_id: str, register: rpb.Register, metrics=None, prefix_hasher=None):
        self.id = replica_id
        self.model = register.model
        self.capacity = register.capacity
        self.scheduler = register.scheduler
        self.prefix_hasher = prefix_hasher      # BlockHasher of its prefix cache; None: it has none
        self.join_seq = next(_join_seq)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.last_seen = time.monotonic()
        self.released: OrderedDict[str, None] = OrderedDict()
        self.rebound: set[str] = set()          # kept at Register, no delta seen since
        self.draining = False
        self.closed = False
        self.close_status: tuple[grpc.StatusCode, str] | None = None
        self.metrics = metrics
        self.prefill_rate = PrefillRate()       # from its StepOutputs
        self._ack_to = 0            # highest step_id durable; sent by _send_ack_now
        self._ack_due = False

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prefill_rate.tokens_per_s

    def send(self, msg: rpb.RouterMessage) -> None:
        if self.closed:
            return
        if self.outbox.qsize() >= OUTBOX_LIMIT:
            # The replica is not reading: end the stream rather than grow without
            # bound; its work stays with it until the lease lapses.
            self.close(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{OUTBOX_LIMIT} messages to this replica are unread")
            return
        self.outbox.put_nowait(msg)
        if self.metrics:
            self.metrics.sent_to_replica(msg.WhichOneof("kind")).inc()

    def send_assignments(self, requests) -> None:
        self.send(rpb.RouterMessage(assign=wire.assign(requests)))

    def send_cancel(self, request_ids) -> None:
        for rid in request_ids:
            self.remember_released(rid)
        self.send(rpb.RouterMessage(cancel=rpb.CancelRequests(request_ids=list(request_ids))))

    def send_ack(self, step_id: int) -> None:
        """Acks are cumulative (steps become durable in order): one Ack within
        ACK_INTERVAL_S carries the highest step durable by then."""
        self._ack_to = max(self._ack_to, step_id)
        if not self._ack_due:
            self._ack_due = True
            asyncio.get_running_loop().call_later(ACK_INTERVAL_S, self._send_ack_now)

    def _send_ack_now(self) -> None:
        self._ack_due = False
        self.send(rpb.RouterMessage(ack=rpb.Ack(step_id=self._ack_to)))

    def close(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        """Ends the stream; with a code, the replica sees that status."""
        if self.closed:
            return
        self.closed = True
        if code is not None:
            self.close_status = (code, message)
        self.outbox.put_nowait(None)

    def remember_released(self, rid: str) -> None:
        self.released[rid] = None
        while len(self.released) > RELEASED_LIMIT:
            self.released.popitem(last=False)


class Registry:
    def __init__(self) -> None:
        self.sessions: dict[str, ReplicaSession] = {}
        self.any_replica = asyncio.Event()

    def add(self, session: ReplicaSession) -> ReplicaSession | None:
        """Adds a session; returns the one it replaces (same replica id), if any."""
        old = self.sessions.get(session.id)
        self.sessions[session.id] = session
        self.any_replica.set()
        return old

    def remove(self, session: ReplicaSession) -> bool:
        if self.sessions.get(session.id) is not session:
            return False
        del self.sessions[session.id]
        if not self.sessions:
            self.any_replica.clear()
        return True

    def get(self, replica_id: str) -> ReplicaSession | None:
        return self.sessions.get(replica_id)

    def __len__(self) -> int:
        return len(self.sessions)
