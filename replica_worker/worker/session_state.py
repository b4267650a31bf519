"""What the worker remembers about its requests across router sessions.

Every delta is kept until the router acknowledges it (Ack: durable in Redis),
then forgotten, so memory holds only what the router could still lose. After
a broken stream or a router restart the worker re-registers holding its live
requests, and resends the unacknowledged deltas; the router drops what it
already has by output_offset, so the client sees each token once. A request
that finished stays here until its finish is acknowledged: otherwise a
router that died before recording it would recompute the whole request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.pb.quadriga.v1 import replica_pb2 as pb


@dataclass
class LiveRequest:
    num_prompt_tokens: int
    # (message sequence, delta) of every delta not yet acknowledged, oldest first.
    history: deque = field(default_factory=deque)
    first_scheduled_sent: bool = False
    next_offset: int = 0  # output_offset the router expects next (resumed tokens included)
    finished: bool = False
    # output_offset the engine's next delta for this assignment has. A delta that
    # starts elsewhere is from an earlier assignment of the same id (cancelled, then
    # assigned here again), computed before the engine saw the cancel.
    engine_next: int = 0


class RequestBook:
    """Live requests (assigned, not finished and acknowledged) and those not yet inside the engine."""

    def __init__(self) -> None:
        self.live: dict[str, LiveRequest] = {}
        self.queued: dict[str, int] = {}  # request_id -> context tokens, until the engine reports it
        self.seq = 0                      # of the last StepOutputs built (Ack refers to it)

    def assigned(self, request_id: str, context_tokens: int, num_resumed: int = 0) -> None:
        self.live[request_id] = LiveRequest(context_tokens, next_offset=num_resumed,
                                            engine_next=num_resumed)
        self.queued[request_id] = context_tokens

    def of_this_assignment(self, request_id: str, output_offset: int, num_tokens: int) -> bool:
        """Whether an engine delta with tokens belongs to the request's current
        assignment (then counted), not to an earlier one of the same id whose
        output the engine had computed before it took the cancel: that would
        reach the router at offsets it never expects (read as a fault) and into
        the new request's text."""
        req = self.live.get(request_id)
        if req is None or not num_tokens:
            return True   # not live: dropped later; tokenless: an ending, placed by record()
        if output_offset != req.engine_next:
            return False
        req.engine_next += num_tokens
        return True

    def dropped(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.queued.pop(request_id, None)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def record(self, delta: pb.RequestDelta, seq: int) -> bool:
        """Keeps a delta until acknowledged; False for a request no longer live (cancelled)."""
        req = self.live.get(delta.request_id)
        if req is None or req.finished:
            return False
        if not delta.token_ids:
            # A tokenless (error) delta ends the request where the router is:
            # after a failed step the engine may hold tokens never reported,
            # and an offset past them would read as a gap.
            delta.output_offset = req.next_offset
        req.next_offset = delta.output_offset + len(delta.token_ids)
        if delta.first_scheduled_at:
            req.first_scheduled_sent = True
        req.history.append((seq, delta))
        if delta.HasField("finish_reason"):
            req.finished = True
            self.queued.pop(delta.request_id, None)
        return True

    def acknowledged(self, seq: int) -> None:
        """The router holds every delta up to message `seq` durably."""
        for rid, req in list(self.live.items()):
            history = req.history
            while history and history[0][0] <= seq:
                history.popleft()
            if req.finished and not history:
                del self.live[rid]

    def unacknowledged(self) -> int:
        return sum(len(r.history) for r in self.live.values())

    def engine_holds(self, request_ids) -> None:
        """The engine reported these as inside it: they no longer count as queued."""
        for rid in request_ids:
            self.queued.pop(rid, None)

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued.values())

    @property
    def unfinished(self) -> list[str]:
        return [rid for rid, r in self.live.items() if not r.finished]

    def first_scheduled_sent(self, request_id: str) -> bool:
        req = self.live.get(request_id)
        return req is not None and req.first_scheduled_sent

    def replay(self, keep: set[str]) -> tuple[list[pb.RequestDelta], list[str]]:
        """After re-registering: unacknowledged deltas to resend for kept requests,
        and the unfinished requests the router took back (to abort here)."""
        resend, abort = [], []
        for rid, req in list(self.live.items()):
            if rid in keep:
                resend.extend(d for _, d in req.history)
            else:
                if not req.finished:
                    abort.append(rid)
                self.dropped(rid)
        return resend, abort
