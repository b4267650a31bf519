"""Routing policies, one per file, chosen by name."""

from __future__ import annotations

from router.policies.base import PENDING, Policy, replica_queue
from router.policies.least_outstanding import LeastOutstandingPolicy
from router.policies.pull import PullPolicy
from router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PullPolicy, RoundRobinPolicy, LeastOutstandingPolicy)
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["PENDING", "POLICIES", "Policy", "make_policy", "replica_queue"]
