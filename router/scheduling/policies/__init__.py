"""Routing policies, one per file, chosen by name."""

from __future__ import annotations

from router.scheduling.policies.base import PENDING, Policy, replica_queue
from router.scheduling.policies.least_outstanding import LeastOutstandingPolicy
from router.scheduling.policies.pull import PullPolicy
from router.scheduling.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PullPolicy, RoundRobinPolicy, LeastOutstandingPolicy)
}


def make_policy(name: str, context=None) -> Policy:
    try:
        return POLICIES[name](context)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["PENDING", "POLICIES", "Policy", "make_policy", "replica_queue"]
