"""What the worker remembers about its requests across router sessions."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.pb.quadriga.v1 import replica_pb2 as pb


@dataclass
class LiveRequest:
    num_prompt_tokens: int
    # Every delta sent for this request. After a broken stream they are sent
    # again: the router drops what it already has by output_offset, so the
    # client sees each token once whichever deltas were lost in flight.
    history: list[pb.RequestDelta] = field(default_factory=list)
    first_scheduled_sent: bool = False
    next_offset: int = 0  # output_offset the router expects next (resumed tokens included)
    finished: bool = False  # finished while the router was away; kept until resent


class RequestBook:
    """Live requests (assigned, not finished) and those not yet inside the engine."""

    def __init__(self) -> None:
        self.live: dict[str, LiveRequest] = {}
        self.queued: dict[str, int] = {}  # request_id -> context tokens, until the engine reports it

    def assigned(self, request_id: str, context_tokens: int, num_resumed: int = 0) -> None:
        self.live[request_id] = LiveRequest(context_tokens, next_offset=num_resumed)
        self.queued[request_id] = context_tokens

    def dropped(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.queued.pop(request_id, None)

    def record(self, delta: pb.RequestDelta, delivered: bool) -> bool:
        """Keeps a delta for resending; False for a request no longer live (cancelled).

        A request that finishes while the router is away stays here, finished,
        until its deltas are resent: otherwise its end would be lost.
        """
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
        req.history.append(delta)
        if delta.HasField("finish_reason"):
            req.finished = True
            self.queued.pop(delta.request_id, None)
            if delivered:
                self.dropped(delta.request_id)
        return True

    def engine_holds(self, request_ids) -> None:
        """The engine reported these as inside it: they no longer count as queued."""
        for rid in request_ids:
            self.queued.pop(rid, None)

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued.values())

    def first_scheduled_sent(self, request_id: str) -> bool:
        req = self.live.get(request_id)
        return req is not None and req.first_scheduled_sent

    def replay(self, keep: set[str]) -> tuple[list[pb.RequestDelta], list[str]]:
        """After re-registering: deltas to resend for kept requests, and the
        unfinished requests the router took back (to abort here)."""
        resend, abort = [], []
        for rid, req in list(self.live.items()):
            if rid in keep:
                resend.extend(req.history)
                if req.finished:
                    self.dropped(rid)
            else:
                if not req.finished:
                    abort.append(rid)
                self.dropped(rid)
        return resend, abort
