"""Late binding (the default): one shared queue in arrival order; a request is
bound to a replica only when that replica pulls, with room for it."""

from __future__ import annotations

from router.scheduling.policies.base import Policy


class PullPolicy(Policy):
    name = "pull"
    per_replica_queues = False
