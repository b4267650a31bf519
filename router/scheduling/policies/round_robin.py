"""Each request goes at arrival to the next live replica's own queue, strictly
rotating over the live replicas in the order they joined."""

from __future__ import annotations

from router.scheduling.policies.base import Policy


class RoundRobinPolicy(Policy):
    name = "round_robin"
    per_replica_queues = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._last_join_seq = -1

    def select(self, work, live):
        if not live:
            return None
        ordered = sorted(live, key=lambda r: r.join_seq)
        # The next replica after the last one chosen; survives joins and leaves.
        chosen = next((r for r in ordered if r.join_seq > self._last_join_seq), ordered[0])
        self._last_join_seq = chosen.join_seq
        return chosen
