"""Streaming coalescing at the replica: a request's client asked for at most
one message per `stream_interval` tokens, so the replica holds its deltas and
sends them merged, rather than one per step that the router then recombines.

Invariants:
- A request's first delta goes at once (time to first token is never delayed),
  and so does any delta that finishes it or carries an error.
- After that a held delta goes once it holds `interval` tokens.
- Held deltas are not yet recorded in the RequestBook: the router has not seen
  them, so a replica that dies loses only tokens the router will recompute.
- Merging keeps what a single delta would have said: the first offset, every
  token, its text and logprobs in order, the latest preemption count, and the
  first-scheduled stamp of whichever delta carried it.
"""

from __future__ import annotations

from common.pb.quadriga.v1 import replica_pb2 as pb


class _Coalesced:
    __slots__ = ("interval", "held", "sent_first")

    def __init__(self, interval: int):
        self.interval = interval
        self.held: pb.RequestDelta | None = None
        self.sent_first = False


def _merge(into: pb.RequestDelta, later: pb.RequestDelta) -> None:
    into.token_ids.extend(later.token_ids)
    into.text += later.text
    into.logprobs.extend(later.logprobs)
    into.preemptions = later.preemptions
    if later.HasField("finish_reason"):
        into.finish_reason = later.finish_reason
    if later.error:
        into.error = later.error
    if later.first_scheduled_at and not into.first_scheduled_at:
        into.first_scheduled_at = later.first_scheduled_at
        into.cached_tokens = later.cached_tokens


class DeltaCoalescer:
    """Owns the held deltas of requests with a stream interval above 1."""

    def __init__(self) -> None:
        self._requests: dict[str, _Coalesced] = {}

    def assigned(self, request_id: str, interval: int) -> None:
        """A new assignment starts afresh (a request assigned here again after a requeue included)."""
        if interval > 1:
            self._requests[request_id] = _Coalesced(interval)
        else:
            self._requests.pop(request_id, None)

    def offer(self, delta: pb.RequestDelta) -> pb.RequestDelta | None:
        """The delta to send now (possibly merged with held ones), or None while it is held."""
        state = self._requests.get(delta.request_id)
        if state is None:
            return delta
        if state.held is not None:
            _merge(state.held, delta)
            delta, state.held = state.held, None
        if delta.HasField("finish_reason") or delta.error:
            del self._requests[delta.request_id]
            return delta
        if not state.sent_first and delta.token_ids:
            state.sent_first = True
            return delta
        if len(delta.token_ids) >= state.interval:
            return delta
        state.held = delta
        return None

    def release(self, request_ids) -> list[pb.RequestDelta]:
        """Held deltas of requests leaving this replica alive (handed back), to
        send before they go: the router then resumes them after those tokens."""
        out = []
        for rid in request_ids:
            state = self._requests.pop(rid, None)
            if state is not None and state.held is not None:
                out.append(state.held)
        return out

    def retain(self, live) -> None:
        """Forgets requests no longer live here (cancelled, dropped, taken back)."""
        for rid in [rid for rid in self._requests if rid not in live]:
            del self._requests[rid]
