"""Per-request in-memory state: output so far, owner, timings, and the fan-out
of deltas to subscribed client streams with coalescing.

Invariant: `tokens` holds exactly the output tokens recorded in Redis (each
delta is persisted before subscribers are woken), so a subscriber's cursor is
the only thing needed for exactly-once delivery.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb


class Phase(enum.Enum):
    QUEUED = "q"
    RUNNING = "r"
    FINISHED = "f"


@dataclass(eq=False)
class Subscriber:
    interval: int
    tok: int = 0       # next output token index to send
    part: int = 0      # next text part to send
    event: asyncio.Event = field(default_factory=asyncio.Event)


class RequestState:
    def __init__(self, assignment: rpb.Assignment, *, digest: str, max_tokens: int,
                 priority: int, stream_interval: int, queue: str = "", member: str = ""):
        self.id = assignment.request_id
        self.assignment = assignment          # prompt ids, sampling, arrival time
        self.digest = digest
        self.prompt_len = len(assignment.prompt_token_ids)
        self.max_tokens = max_tokens
        self.priority = priority
        self.stream_interval = stream_interval
        self.arrival = assignment.arrival_time
        self.queue = queue                    # queue name while QUEUED
        self.member = member                  # its sorted-set member (keeps arrival order)
        self.phase = Phase.QUEUED
        self.owner = None                     # ReplicaSession while RUNNING
        self.load_holder = None               # ReplicaSession whose load counts this request
        self.tokens: list[int] = []
        self.parts: list[str] = []
        self.subscribers: list[Subscriber] = []
        self.finish_reason = gpb.FINISH_REASON_UNSPECIFIED
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
        self.done = asyncio.Event()

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

    # ---- fan-out ----

    def subscribe(self, interval: int) -> Subscriber:
        sub = Subscriber(interval=max(1, interval))
        self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)

    def append(self, token_ids, text: str, now: float) -> None:
        if token_ids:
            if not self.tokens:
                self.first_token_at = now
            self.tokens.extend(token_ids)
            self.last_token_at = now
        if text:
            self.parts.append(text)

    def notify(self) -> None:
        n = len(self.tokens)
        for sub in self.subscribers:
            if self.finished or n - sub.tok >= sub.interval:
                sub.event.set()

    def finish(self, reason: int, error: str, now: float) -> None:
        """Marks it finished; subscribers are woken by notify(), once it is persisted."""
        self.phase = Phase.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finished_at = now
        self.owner = None
        self.done.set()

    def take(self, sub: Subscriber) -> tuple[gpb.GenerateResponse | None, bool]:
        """The next message for this subscriber (None: nothing new) and whether it is the last."""
        n = len(self.tokens)
        last = self.finished
        if not last and n - sub.tok < sub.interval:
            return None, False
        msg = gpb.GenerateResponse(request_id=self.id, output_offset=sub.tok,
                                   token_ids=self.tokens[sub.tok:n],
                                   text="".join(self.parts[sub.part:]))
        sub.tok, sub.part = n, len(self.parts)
        if last:
            msg.finish_reason = self.finish_reason
            msg.error = self.error
            msg.timings.CopyFrom(self.timings())
        return msg, last

    def timings(self) -> gpb.RequestTimings:
        end = self.finished_at or time.time()

        def since(t: float) -> float:
            return max(0.0, t - self.arrival) if t else 0.0

        return gpb.RequestTimings(
            queue_time_s=since(self.assigned_at),
            scheduling_delay_s=since(self.first_scheduled_at),
            time_to_first_token_s=since(self.first_token_at),
            end_to_end_s=since(end),
            replica_id=self.replica_id,
            preemptions=self.preemptions,
            prompt_tokens=self.prompt_len,
            output_tokens=len(self.tokens),
            requeues=self.requeues,
        )
