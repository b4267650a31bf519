"""A request as Redis records it (store.load_requests, lua_common.record_),
turned into a RequestState, and output that reaches this router from Redis
(another router's step, or a reload) merged into one it holds."""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.persistence.store import unpack_logprobs, unpack_tokens
from router.requests.request import Phase, RequestState
from router.requests.spec import RequestSpec, sampling_from_fields


def _f(rec: dict, key: str, default: float = 0.0) -> float:
    value = rec.get(key)
    return float(value) if value not in (None, b"") else default


def state_from_record(rec: dict) -> RequestState:
    """A request as Redis records it."""
    sampling = sampling_from_fields(json.loads(rec.get("sp", b"{}") or b"{}"))
    spec = RequestSpec(request_id=rec["id"], sampling=sampling, priority=int(_f(rec, "pr")),
                       stream_interval=int(_f(rec, "si")))
    req = RequestState(spec, unpack_tokens(rec.get("p")), rid=rec["id"],
                       digest=rec.get("d", b"").decode(), max_tokens=int(_f(rec, "mt")),
                       arrival=_f(rec, "at"))
    req.submit_token = rec.get("tok", b"").decode()
    req.queue = rec.get("q", b"").decode()
    req.confirmed = req.poppable = True
    req.assignments = int(_f(rec, "n"))
    take_output(req, rec)
    take_timings(req, rec)
    if rec.get("st") == b"f":
        finish_from_record(req, rec)
    return req


def take_output(req: RequestState, rec: dict) -> None:
    """Output as recorded replaces what the request holds (a prefix of it). Text
    that extends what it holds is added as one more part, so a client stream
    part-way through the parts it had gets the rest, not nothing; text that
    does not (output recomputed otherwise) replaces them."""
    req.tokens = list(rec["tokens"])
    if req.logprobs_k is not None:
        req.logprobs = unpack_logprobs(rec.get("logprobs"), req.logprobs_k)
    recorded = rec["text"] or b""
    held = "".join(req.parts).encode() if req.parts else b""
    if held and recorded.startswith(held):
        if len(recorded) > len(held):   # parts end on whole characters: the rest decodes alone
            req.parts.append(recorded[len(held):].decode(errors="replace"))
    else:
        text = recorded.decode(errors="replace")
        req.parts = [text] if text else []
    req.text_bytes = len(recorded)
    req.visible_tokens, req.visible_parts = len(req.tokens), len(req.parts)


def take_timings(req: RequestState, rec: dict) -> None:
    req.cached_tokens = int(_f(rec, "ct")) or req.cached_tokens
    req.requeues = int(_f(rec, "rq", req.requeues))
    req.assigned_at = _f(rec, "asg") or req.assigned_at
    req.first_scheduled_at = _f(rec, "fs") or req.first_scheduled_at
    req.first_token_at = _f(rec, "ft") or req.first_token_at
    req.last_token_at = max(req.last_token_at, req.first_token_at)
    req.preemptions = int(_f(rec, "pre")) or req.preemptions
    req.replica_id = rec.get("rep", b"").decode() or req.replica_id


def finish_from_record(req: RequestState, rec: dict) -> None:
    req.phase = Phase.FINISHED
    req.finish_reason = int(_f(rec, "fr"))
    req.error = rec.get("err", b"").decode()
    req.finished_at = _f(rec, "fin")
    req.visible_tokens, req.visible_parts = len(req.tokens), len(req.parts)
    req.finish_visible = True


def merge_output(req: RequestState, tok_start: int, tokens: list[int], txt_start: int,
                 text: bytes, lp_start: int, lp: bytes) -> bool:
    """Appends what a recorded delta holds beyond the request's output; False
    when it starts past the end (a gap: events were missed, reload). Offsets
    are the byte offsets Redis wrote at, so a delta seen twice adds nothing."""
    k = req.logprobs_k
    size = 4 + 8 * (k or 0)
    if tok_start > len(req.tokens) or txt_start > req.text_bytes or (
            k is not None and lp_start // size > len(req.logprobs)):
        return False
    req.tokens.extend(tokens[len(req.tokens) - tok_start:])
    skip = req.text_bytes - txt_start
    if skip < len(text):
        req.parts.append(text[skip:].decode(errors="replace"))
        req.text_bytes += len(text) - skip
    if k is not None and lp:
        entries = unpack_logprobs(lp, k)
        req.logprobs.extend(entries[len(req.logprobs) - lp_start // size:])
    return True


@dataclass(frozen=True)
class RecordedDelta:
    """Output another router recorded for a request (an event, events.py):
    where in the request's keys it was written, and its finish, if any."""
    rid: str
    assignments: int
    tok_start: int                   # token offset
    tokens: list[int]
    txt_start: int                   # byte offsets in the txt and lp keys
    text: bytes
    lp_start: int
    lp: bytes
    timings: dict                    # ft, fs, ct when set
    finish: dict | None = None       # fr, err, rep, fin, pre, asg, rq when it finished
