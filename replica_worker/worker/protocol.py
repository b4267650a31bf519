"""Protobuf <-> engine types, for the replica side of the replica API."""

from __future__ import annotations

from common.pb.quadriga.v1 import generation_pb2 as gen_pb
from common.pb.quadriga.v1 import replica_pb2 as pb
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.outputs import RequestDelta
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.worker.engine_loop import AddRequest

FINISH_REASONS = {
    "stop": gen_pb.FINISH_REASON_STOP,
    "length": gen_pb.FINISH_REASON_LENGTH,
    "cancelled": gen_pb.FINISH_REASON_CANCELLED,
    "error": gen_pb.FINISH_REASON_ERROR,
}


# Optional wire fields the engine takes under the same name, when set.
_OPTIONAL = ("min_p", "min_tokens", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logprobs")


def sampling_from_pb(msg: gen_pb.SamplingParams) -> SamplingParams:
    """Unset fields take the API's defaults; invalid values raise InvalidRequestError."""
    optional = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    return SamplingParams(
        **optional,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") and msg.top_k != 0 else -1,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=dict(msg.logit_bias),
    )


def add_request_from_pb(a: pb.Assignment) -> AddRequest:
    if not a.request_id:
        raise InvalidRequestError("assignment without request_id")
    return AddRequest(
        request_id=a.request_id,
        prompt_token_ids=list(a.prompt_token_ids),
        params=sampling_from_pb(a.sampling),
        arrival_time=a.arrival_time or None,
        resume_token_ids=tuple(a.resume_token_ids),
        resume_text_len=a.resume_text_len if a.HasField("resume_text_len") else None,
    )


def delta_to_pb(delta: RequestDelta, first_scheduled_reported: bool) -> pb.RequestDelta:
    msg = pb.RequestDelta(
        request_id=delta.request_id,
        token_ids=delta.new_token_ids,
        text=delta.text,
        output_offset=delta.output_offset,
        error=delta.error,
    )
    if delta.finish_reason:
        msg.finish_reason = FINISH_REASONS[delta.finish_reason]
    if delta.logprobs:
        msg.logprobs.extend(gen_pb.TokenLogprobs(
            logprob=e.logprob, top_token_ids=[t for t, _ in e.top],
            top_logprobs=[v for _, v in e.top]) for e in delta.logprobs)
    stats = delta.stats
    if stats is not None:
        msg.preemptions = stats.num_preemptions
        if not first_scheduled_reported and stats.first_scheduled is not None:
            msg.first_scheduled_at = stats.first_scheduled
            msg.cached_tokens = stats.num_cached_tokens
    return msg
