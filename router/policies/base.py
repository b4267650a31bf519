"""The routing policy interface: where a request waits until a replica pulls it.

A policy only decides the queue. Assignment always follows a replica's Pull:
the router sends a replica work from that replica's pull queue, never more
than its outstanding Pull allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from router.registry import ReplicaSession
    from router.requests import RequestState

PENDING = "pending"


def replica_queue(replica_id: str) -> str:
    return "r:" + replica_id


class Policy:
    name = "base"
    # True: each request is bound to one replica's own queue at arrival.
    per_replica_queues = False

    def select(self, request: "RequestState",
               live: Sequence["ReplicaSession"]) -> "ReplicaSession | None":
        """The replica whose queue gets this request; None: the shared pending queue."""
        return None

    def pull_queue(self, replica: "ReplicaSession") -> str:
        return replica_queue(replica.id) if self.per_replica_queues else PENDING

    # No-op hooks; a policy overrides the ones it needs.
    def on_request_arrival(self, request: "RequestState") -> None: ...
    def on_replica_joined(self, replica: "ReplicaSession") -> None: ...
    def on_replica_left(self, replica: "ReplicaSession") -> None: ...
    def on_pull(self, replica: "ReplicaSession") -> None: ...
    def on_assigned(self, request: "RequestState", replica: "ReplicaSession") -> None: ...
    def on_finished(self, request: "RequestState") -> None: ...
