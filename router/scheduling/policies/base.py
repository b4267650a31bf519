"""The routing policy interface: where a request waits until a replica pulls it.

A policy decides queues only. Assignment always follows a replica's Pull:
the pull scheduler (scheduling/pull.py) sends a replica work from the queue
the policy names for it, never more than its outstanding credit allows.

A policy sees replicas as handles with `.id`, `.join_seq` and `.capacity`,
and reads load through the context it is given; it owns no request state.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

PENDING = "pending"


def replica_queue(replica_id: str) -> str:
    return "r:" + replica_id


class ReplicaHandle(Protocol):
    id: str
    join_seq: int


class PolicyContext(Protocol):
    load_of: Callable[[str], int]          # outstanding tokens bound to a replica


class Policy:
    name = "base"
    # True: each request is bound to one replica's own queue at arrival.
    per_replica_queues = False

    def __init__(self, context: PolicyContext | None = None) -> None:
        self.context = context

    def select(self, cost: int, live: Sequence[ReplicaHandle]) -> ReplicaHandle | None:
        """The replica whose queue gets a request of this cost; None: the shared queue."""
        return None

    def pull_queue(self, replica: ReplicaHandle) -> str:
        return replica_queue(replica.id) if self.per_replica_queues else PENDING

    # No-op hooks; a policy overrides the ones it needs.
    def on_replica_joined(self, replica: ReplicaHandle) -> None: ...
    def on_replica_left(self, replica: ReplicaHandle) -> None: ...
