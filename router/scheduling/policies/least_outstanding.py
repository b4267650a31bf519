"""Each request goes at arrival to the live replica with the fewest outstanding
tokens (queued plus running, prompt plus max output each)."""

from __future__ import annotations

from router.scheduling.policies.base import Policy


class LeastOutstandingPolicy(Policy):
    name = "least_outstanding"
    per_replica_queues = True

    def select(self, work, live):
        if not live:
            return None
        return min(live, key=lambda r: (self.context.load_of(r.id), r.join_seq))
