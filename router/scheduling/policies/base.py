"""The routing policy interface: where a request waits until a replica pulls it,
and which of the waiting requests a Pull takes.

A policy decides queues and picks only. Assignment always follows a
replica's Pull: the pull scheduler (scheduling/pull.py) sends a replica work
from the queue the policy names for it, never more than its outstanding
credit allows, and asks the policy (`choose`) which requests to take; None
takes from the head of the queue, in order, atomically in Redis.

A policy sees replicas as handles with `.id`, `.join_seq`, `.capacity` and
`.prefill_tokens_per_s` (measured; None before any prefill-heavy step),
requests as `Work` (router/prefix/matcher.py: a cost and the context tokens),
and reads load, queues and the replicas' caches through the context it is
given; it owns no request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

PENDING = "pending"


def replica_queue(replica_id: str) -> str:
    return "r:" + replica_id


class ReplicaHandle(Protocol):
    id: str
    join_seq: int
    prefill_tokens_per_s: float | None


class PolicyContext(Protocol):
    load_of: Callable[[str], int]          # outstanding tokens bound to a replica
    oldest: Callable[[str, int], list]     # the first n poppable requests of a queue, in order
    prefix: object                         # router/prefix/matcher.PrefixMatcher


@dataclass(frozen=True)
class PolicySettings:
    """The knobs of the cache-affine policies, and their defaults: RouterConfig's
    fields of the same meaning (pull_affinity_*, cache_aware_balance_*) take theirs
    from here."""

    affinity_window: int = 32          # pull: oldest queued requests a Pull chooses among; 0: FIFO
    affinity_max_wait: float = 2.0     # pull: seconds after which a request is served first, in order
    # pull: a second's wait is worth this x the puller's prefill tokens/s. 0.25, not
    # the cost-neutral 1: a request taken from a busy holder has its prefix cached
    # twice, evicting others, which costs more than the prefill it redoes
    # (docs/router.md, "pull with affinity", as measured).
    affinity_wait_weight: float = 0.25
    # pull: a holder this much busier than the puller (outstanding tokens over the
    # puller's by more than abs, and more than rel times them) is not waited for;
    # 0: off (holders are waited for whatever their load; docs/router.md).
    affinity_balance_abs: int = 0
    affinity_balance_rel: float = 1.5
    balance_abs: int = 8192            # cache_aware: outstanding tokens over the least loaded ...
    balance_rel: float = 1.5           # ... and this many times its load: least loaded instead

    @classmethod
    def from_config(cls, c) -> "PolicySettings":
        return cls(c.pull_affinity_window, c.pull_affinity_max_wait, c.pull_affinity_wait_weight,
                   c.pull_affinity_balance_abs, c.pull_affinity_balance_rel,
                   c.cache_aware_balance_abs, c.cache_aware_balance_rel)


@dataclass(eq=False)
class Arrival:
    """A request being admitted, before it has any state: what placement needs."""

    prompt_ids: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    block_hasher: object = None

    @property
    def cost(self) -> int:
        return len(self.prompt_ids) + self.max_tokens


# Why a Pull took a request (the quadriga_pull_picks_total label); ARRIVAL: taken
# as it arrived, nothing else waiting (scheduling/pull.py, take_at_arrival).
FIFO, AFFINITY, OVERDUE, ARRIVAL = "fifo", "affinity", "overdue", "arrival"


@dataclass(frozen=True)
class Choice:
    """What a Pull takes: (request, why) in the order to take them. retry_in:
    seconds until a request left for another replica may be taken here; the
    scheduler asks again then, as no message may come to wake it (None: no need)."""

    picks: list
    retry_in: float | None = None


class Policy:
    name = "base"
    # True: each request is bound to one replica's own queue at arrival.
    per_replica_queues = False
    # True: its decisions read the replicas' caches (their hit metrics are always kept).
    uses_prefix_cache = False

    def __init__(self, context: PolicyContext | None = None,
                 settings: PolicySettings = PolicySettings()) -> None:
        self.context = context
        self.settings = settings

    def select(self, work, live: Sequence[ReplicaHandle]) -> ReplicaHandle | None:
        """The replica whose queue gets this request; None: the shared queue."""
        return None

    def pull_queue(self, replica: ReplicaHandle) -> str:
        return replica_queue(replica.id) if self.per_replica_queues else PENDING

    def choose(self, replica: ReplicaHandle, queue: str, seats: int, token_limit: int | None,
               others: Sequence[str]) -> Choice | None:
        """What a Pull of `replica` takes from `queue`, within `seats` and the token
        credit (the last may overrun it); `others` are the other live replicas.
        None: from the head."""
        return None

    def take_at_arrival(self, work, pullers: Sequence[ReplicaHandle],
                        others: Sequence[ReplicaHandle]) -> ReplicaHandle | None:
        """Which of `pullers` (replicas with a seat now, oldest Pull first) takes
        `work`, placed in the shared queue, at once, as its Pull would once it were
        queued, with nothing else waiting; `others` are the other live replicas.
        None: it is queued."""
        return pullers[0] if pullers else None

    # No-op hooks; a policy overrides the ones it needs.
    def on_replica_joined(self, replica: ReplicaHandle) -> None: ...
    def on_replica_left(self, replica: ReplicaHandle) -> None: ...
