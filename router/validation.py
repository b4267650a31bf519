"""Client input checks. Every problem becomes a RouterError whose message says
exactly what is wrong; nothing else is disturbed."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import grpc

from common.pb.quadriga.v1 import generation_pb2 as gpb

MAX_REQUEST_ID_LEN = 256
MAX_STREAM_INTERVAL = 4096


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # label for quadriga_rejections_total


def invalid(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid_argument")


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


def check_request(req: gpb.GenerateRequest, limits: ModelLimits) -> None:
    """Everything that needs no tokenizer."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise invalid(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    if req.request_id and not req.request_id.isprintable():
        raise invalid("request_id must be printable text")
    has_text, has_ids = bool(req.prompt), len(req.prompt_token_ids) > 0
    if has_text and has_ids:
        raise invalid("give exactly one of prompt and prompt_token_ids, not both")
    if not has_text and not has_ids:
        raise invalid("empty prompt: give prompt or prompt_token_ids")
    ids = req.prompt_token_ids
    if has_ids and max(ids) >= limits.vocab_size:
        i, tok = next((i, t) for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise invalid(f"prompt_token_ids[{i}] = {tok} is not below the vocabulary size "
                      f"{limits.vocab_size}")
    if req.stream_interval > MAX_STREAM_INTERVAL:
        raise invalid(f"stream_interval {req.stream_interval} is above {MAX_STREAM_INTERVAL}")
    _check_sampling(req.sampling, limits)


def _check_sampling(s: gpb.SamplingParams, limits: ModelLimits) -> None:
    if s.HasField("max_tokens") and s.max_tokens == 0:
        raise invalid("sampling.max_tokens is 0: ask for at least one token (unset: up to the model limit)")
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid(f"sampling.temperature {s.temperature} must be a finite number >= 0")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        raise invalid(f"sampling.top_p {s.top_p} must lie in (0, 1]")
    if s.HasField("top_k") and s.top_k < -1:
        raise invalid(f"sampling.top_k {s.top_k} must be -1 or 0 (disabled) or at least 1")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise invalid(f"sampling.stop[{i}] is an empty string")
    stops = s.stop_token_ids
    if stops and max(stops) >= limits.vocab_size:
        i, tok = next((i, t) for i, t in enumerate(stops) if t >= limits.vocab_size)
        raise invalid(f"sampling.stop_token_ids[{i}] = {tok} is not below the vocabulary "
                      f"size {limits.vocab_size}")


def effective_max_tokens(req: gpb.GenerateRequest, prompt_len: int, limits: ModelLimits) -> int:
    """Checks lengths against the model; returns max_tokens with the default applied."""
    if prompt_len == 0:
        raise invalid("empty prompt: it has no tokens")
    room = limits.max_model_len - prompt_len
    if room <= 0:
        raise invalid(f"prompt has {prompt_len} tokens; the model allows {limits.max_model_len} "
                      f"in all, leaving no room for output")
    s = req.sampling
    if s.HasField("max_tokens"):
        if s.max_tokens > room:
            raise invalid(f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) is more than "
                          f"the model's {limits.max_model_len}")
        return s.max_tokens
    return room


def digest(req: gpb.GenerateRequest) -> str:
    """Identity of a request body for the re-attach rule (request_id and
    stream_interval excluded: they do not change what is generated)."""
    rid, interval = req.request_id, req.stream_interval
    if not rid and not interval:  # the common case: no copy
        return hashlib.sha256(req.SerializeToString(deterministic=True)).hexdigest()[:32]
    body = gpb.GenerateRequest()
    body.CopyFrom(req)
    body.request_id = ""
    body.stream_interval = 0
    return hashlib.sha256(body.SerializeToString(deterministic=True)).hexdigest()[:32]
