"""Routing policies, one per file, chosen by name."""

from __future__ import annotations

from router.scheduling.policies.base import (PENDING, Arrival, Policy, PolicySettings,
                                             replica_queue)
from router.scheduling.policies.cache_aware import CacheAwarePolicy
from router.scheduling.policies.least_outstanding import LeastOutstandingPolicy
from router.scheduling.policies.pull import PullPolicy
from router.scheduling.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PullPolicy, RoundRobinPolicy, LeastOutstandingPolicy, CacheAwarePolicy)
}


def make_policy(name: str, context=None, settings: PolicySettings = PolicySettings()) -> Policy:
    try:
        return POLICIES[name](context, settings)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["PENDING", "POLICIES", "Arrival", "Policy", "PolicySettings", "make_policy",
           "replica_queue"]
