"""Per-request state in the router's memory: output so far, timings, and the
fan-out of deltas to subscribed client streams with coalescing.

Only the request table (table.py) changes a request's phase, owner, queue or
output; everything here is data plus the read side of the fan-out.

Output has three marks, each a prefix of the next:
  visible <= durable-or-shown <= received
`tokens`/`parts` hold everything received from replicas. A subscriber is
given output up to `visible_tokens`/`visible_parts`: what Redis holds, or
more of what arrived (config.SHOW_OUTPUT: by default a first token and a
finish at once; while Redis stalls, everything). The replica keeps every
delta the router has not acknowledged, so what was shown is never lost with
the router. A finish the router made itself is shown once durable or while
stalled.
Output of a REMOTE request arrives from Redis (events.py), so it is durable
and shown at once.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from router.requests.spec import RequestSpec

CANCELLED = 3   # FinishReason values of the wire contract (generation.proto)
ERROR = 4


class Phase(enum.Enum):
    QUEUED = "queued"        # in a queue (memory first; Redis follows in order)
    RUNNING = "running"      # assigned to a replica whose stream is up
    DETACHED = "detached"    # its replica's stream is gone; the lease decides its fate
    REMOTE = "remote"        # run (or queued) through another router; its output arrives as events
    FINISHED = "finished"


@dataclass(eq=False)
class Subscriber:
    interval: int
    tok: int = 0       # next output token index to send
    part: int = 0      # next text part to send
    event: asyncio.Event = field(default_factory=asyncio.Event)
    detached: str = ""  # set when the router ends this stream without a finish (shutdown)


class RequestState:
    def __init__(self, spec: RequestSpec, prompt_ids: list[int], *, rid: str, digest: str,
                 max_tokens: int, arrival: float):
        self.id = rid
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.digest = digest
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.priority = spec.priority
        self.stream_interval = spec.stream_interval
        self.arrival = arrival
        self.order = (-spec.priority, arrival)   # queue order within this router
        self.submit_token = ""
        self.confirmed = False                # its submit is durable in Redis
        self.accepted_at = 0.0                # when this router learned that (unix s)
        # A pop may take it: once confirmed, or from admission when the router
        # made its id (no other request can hold that id in Redis, so its submit
        # cannot be refused, and the ordered writer sends any pop after it).
        self.poppable = False
        self.front = False                    # Redis names this router among its fronts
        self.phase = Phase.QUEUED
        self.queue = ""                       # queue name while QUEUED
        self.owner: str | None = None         # replica id while RUNNING or DETACHED
        self.lease_deadline = 0.0             # unix s; DETACHED requests are requeued after it
        self.heard_at = 0.0                   # monotonic s: a REMOTE request's last news (remote.py)
        self.assignments = 0                  # times popped (guards a retried requeue)
        self.tokens: list[int] = []
        # With sampling.logprobs = k: per token (logprob, ((token id, logprob) x k)).
        self.logprobs: list[tuple[float, tuple]] = []
        self.cached_tokens = 0                # prompt tokens its replica had cached
        self.parts: list[str] = []
        self.text_bytes = 0                   # UTF-8 bytes of parts (the txt key's length)
        self.visible_tokens = 0
        self.visible_parts = 0
        self.finish_visible = False
        self.subscribers: list[Subscriber] = []
        self.finish_reason = 0
        self.error = ""
        self.replica_id = ""
        self.assigned_at = 0.0
        self.first_scheduled_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished_at = 0.0
        self.preemptions = 0
        self.preemption_base = 0              # preemptions before the current assignment
        self.requeues = 0
        # Its context's block hashes, computed by router/prefix on first use and
        # extended as output arrives (tokens are only appended).
        self.block_hashes: list[int] = []
        self.block_hasher = None

    @property
    def cost(self) -> int:
        """Outstanding-token estimate used by least_outstanding."""
        return self.prompt_len + self.max_tokens

    @property
    def context_len(self) -> int:
        """Tokens a replica must compute to (re)start it: prompt plus output so far."""
        return self.prompt_len + len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def logprobs_k(self) -> int | None:
        return self.spec.sampling.logprobs

    @property
    def live(self) -> bool:
        return self.phase is not Phase.FINISHED

    # ---- fan-out (read side) ----
    def subscribe(self, interval: int, event: asyncio.Event | None = None) -> Subscriber:
        """event: shared by the subscriptions of one call that follows several requests."""
        sub = Subscriber(interval=max(1, interval), event=event or asyncio.Event())
        self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)

    def notify(self) -> None:
        n = self.visible_tokens
        for sub in self.subscribers:
            if self.finish_visible or n - sub.tok >= sub.interval or (sub.tok == 0 < n):
                sub.event.set()

    def take(self, sub: Subscriber):
        """(new tokens, their text, output offset, whether this is the last message),
        or None when nothing new is due for this subscriber."""
        n = self.visible_tokens
        last = self.finish_visible
        # The first message goes as soon as there is a token: coalescing never delays TTFT.
        if not last and n - sub.tok < sub.interval and not (sub.tok == 0 < n):
            return None
        out = (self.tokens[sub.tok:n], "".join(self.parts[sub.part:self.visible_parts]), sub.tok, last)
        sub.tok, sub.part = n, self.visible_parts
        return out

    def timings(self) -> dict:
        end = self.finished_at or time.time()

        def since(t: float) -> float:
            return max(0.0, t - self.arrival) if t else 0.0

        def shown(t: float) -> float:
            """A client sees nothing before its request is accepted, though a
            request taken at arrival may have output before then."""
            return since(max(t, self.accepted_at)) if t else 0.0

        return dict(queue_time_s=since(self.assigned_at),
                    scheduling_delay_s=since(self.first_scheduled_at),
                    time_to_first_token_s=shown(self.first_token_at),
                    end_to_end_s=shown(end), replica_id=self.replica_id,
                    preemptions=self.preemptions, prompt_tokens=self.prompt_len,
                    output_tokens=len(self.tokens), requeues=self.requeues,
                    cached_tokens=self.cached_tokens)
