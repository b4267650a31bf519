"""Live replicas: one ReplicaSession per connected Connect stream."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from common.pb.quadriga.v1 import replica_pb2 as rpb

_join_seq = itertools.count()


class ReplicaSession:
    def __init__(self, replica_id: str, register: rpb.Register, metrics=None):
        self.id = replica_id
        self.model = register.model
        self.capacity = register.capacity
        self.scheduler = register.scheduler
        self.join_seq = next(_join_seq)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.last_seen = time.monotonic()
        self.owned: dict[str, object] = {}      # request id -> RequestState it runs
        self.released: set[str] = set()         # cancelled by the router; late deltas are fine
        self.rebound: set[str] = set()          # kept at Register, no delta seen since
        self.load_tokens = 0                    # queued + running cost (least_outstanding)
        # Outstanding Pull: what the router may still assign against the latest Pull.
        self.pull_requests = 0
        self.pull_tokens = 0                    # 0: no prompt-token limit
        self.pull_unlimited_tokens = True
        self.pull_at = 0.0
        self.draining = False
        self.closed = False
        self.gone = False                       # its work has been requeued
        self.close_status: tuple[grpc.StatusCode, str] | None = None
        self.metrics = metrics

    @property
    def wants_work(self) -> bool:
        return (not self.closed and not self.draining and self.pull_requests > 0
                and (self.pull_unlimited_tokens or self.pull_tokens > 0))

    def send(self, msg: rpb.RouterMessage) -> None:
        if not self.closed:
            self.outbox.put_nowait(msg)
            if self.metrics:
                self.metrics.sent_to_replica(msg.WhichOneof("kind")).inc()

    def close(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        """Ends the stream; with a code, the replica sees that status."""
        if self.closed:
            return
        self.closed = True
        if code is not None:
            self.close_status = (code, message)
        self.outbox.put_nowait(None)

    def remember_released(self, rid: str) -> None:
        self.released.add(rid)
        if len(self.released) > 10_000:
            self.released.pop()


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

    def live(self) -> list[ReplicaSession]:
        return [s for s in self.sessions.values() if not s.closed and not s.draining]

    def pullers(self) -> list[ReplicaSession]:
        """Replicas with an outstanding Pull, oldest Pull first."""
        return sorted((s for s in self.sessions.values() if s.wants_work), key=lambda s: s.pull_at)

    def __len__(self) -> int:
        return len(self.sessions)
