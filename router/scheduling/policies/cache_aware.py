"""Each request goes at arrival to the live replica holding the longest cached
prefix of it, unless that replica is too far ahead of the least loaded one:
more than `balance_abs` outstanding tokens over it and more than
`balance_rel` times its load. Then, and when no replica holds any of it,
it goes to the least loaded replica (as least_outstanding does).

Load is outstanding tokens (queued plus running, prompt plus max output
each). The view of the caches holds what replicas have computed, so a burst
of requests sharing a new prefix spreads until one of them is computed.
"""

from __future__ import annotations

from router.scheduling.policies.base import Policy


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    per_replica_queues = True
    uses_prefix_cache = True

    def select(self, work, live):
        if not live:
            return None
        load = self.context.load_of
        least = min(live, key=lambda r: (load(r.id), r.join_seq))
        hits = self.context.prefix.cached_tokens(work, [r.id for r in live])
        best = max(live, key=lambda r: (hits[r.id], -load(r.id), -r.join_seq))
        if not hits[best.id]:
            return least
        s = self.settings
        ahead = load(best.id) - load(least.id)
        if ahead > s.balance_abs and load(best.id) > s.balance_rel * load(least.id):
            return least
        return best
