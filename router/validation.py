"""Client input checks, shared by both front ends. Every problem becomes a
RouterError whose message says exactly what is wrong; nothing else is
disturbed. The names in messages are the gRPC API's field names."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import grpc

from router.requests.spec import RequestSpec, Sampling

MAX_REQUEST_ID_LEN = 256
MAX_STREAM_INTERVAL = 4096
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0           # OpenAI's range: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024    # as the engine's bound (sampling_params.py)
# top_k and priority travel as int32 (protos/quadriga/v1/generation.proto): a larger
# value would fail only when the Assign is built, past admission.
INT32_LIMIT = 2 ** 31


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # label for quadriga_rejections_total


def invalid(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid_argument")


def unavailable(message: str, reason: str) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE, message, reason)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


def check_request(req: RequestSpec, limits: ModelLimits) -> None:
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
    _check_ids("prompt_token_ids", req.prompt_token_ids, limits)
    if not 0 <= req.stream_interval <= MAX_STREAM_INTERVAL:
        raise invalid(f"stream_interval {req.stream_interval} is not in [0, {MAX_STREAM_INTERVAL}]")
    if not -INT32_LIMIT <= req.priority < INT32_LIMIT:
        raise invalid(f"priority {req.priority} must lie in [-2^31, 2^31)")
    check_sampling(req.sampling, limits)


def _check_ids(name: str, ids, limits: ModelLimits) -> None:
    for i, tok in enumerate(ids):
        if not 0 <= tok < limits.vocab_size:
            raise invalid(f"{name}[{i}] = {tok} is not in the vocabulary [0, {limits.vocab_size})")


def _wire_float(name: str, value: float) -> float:
    """value as the wire's 32-bit float carries it: a value past its range would
    reach the replica as infinity, and a tiny one as 0."""
    try:
        wire = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        wire = math.inf
    if math.isfinite(value) and not math.isfinite(wire):
        raise invalid(f"sampling.{name} {value} is too large for a 32-bit float")
    return wire


def _finite(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    wire = _wire_float(name, value) if math.isfinite(value) else value
    ok = math.isfinite(wire) and (wire > lo if lo_open else wire >= lo) and wire <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise invalid(f"sampling.{name} {value} must lie in {bracket}{lo:g}, {hi:g}]")


def check_sampling(s: Sampling, limits: ModelLimits) -> None:
    if s.max_tokens is not None and s.max_tokens <= 0:
        raise invalid(f"sampling.max_tokens is {s.max_tokens}: ask for at least one token "
                      "(unset: up to the model limit)")
    if s.temperature is not None and not (math.isfinite(s.temperature) and s.temperature >= 0
                                          and math.isfinite(_wire_float("temperature", s.temperature))):
        raise invalid(f"sampling.temperature {s.temperature} must be a finite number >= 0")
    _finite("top_p", s.top_p, 0.0, 1.0, lo_open=True)
    if s.top_k is not None and not -1 <= s.top_k < INT32_LIMIT:
        raise invalid(f"sampling.top_k {s.top_k} must be -1 or 0 (disabled), or in [1, 2^31)")
    _finite("min_p", s.min_p, 0.0, 1.0)
    _finite("presence_penalty", s.presence_penalty, -2.0, 2.0)
    _finite("frequency_penalty", s.frequency_penalty, -2.0, 2.0)
    if s.repetition_penalty is not None and not (
            math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0
            and _wire_float("repetition_penalty", s.repetition_penalty) > 0):
        raise invalid(f"sampling.repetition_penalty {s.repetition_penalty} must be a finite number > 0")
    if s.seed is not None and not 0 <= s.seed < 2 ** 64:
        raise invalid(f"sampling.seed {s.seed} must lie in [0, 2^64)")
    if s.min_tokens is not None and not 0 <= s.min_tokens <= limits.max_model_len:
        raise invalid(f"sampling.min_tokens {s.min_tokens} must lie in [0, {limits.max_model_len}] "
                      "(the model's length)")
    if s.min_tokens and s.max_tokens is not None and s.min_tokens > s.max_tokens:
        raise invalid(f"sampling.min_tokens {s.min_tokens} is more than max_tokens {s.max_tokens}")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise invalid(f"sampling.logprobs {s.logprobs} must lie in [0, {MAX_LOGPROBS}]")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise invalid(f"sampling.stop[{i}] is an empty string")
    _check_ids("sampling.stop_token_ids", s.stop_token_ids, limits)
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"sampling.logit_bias has {len(s.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for tok, bias in s.logit_bias:
        if not 0 <= tok < limits.vocab_size:
            raise invalid(f"sampling.logit_bias token {tok} is not in the vocabulary [0, {limits.vocab_size})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise invalid(f"sampling.logit_bias[{tok}] = {bias} must lie in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def effective_max_tokens(req: RequestSpec, prompt_len: int, limits: ModelLimits) -> int:
    """Checks lengths against the model; returns max_tokens with the default applied."""
    if prompt_len == 0:
        raise invalid("empty prompt: it has no tokens")
    room = limits.max_model_len - prompt_len
    if room <= 0:
        raise invalid(f"prompt has {prompt_len} tokens; the model allows {limits.max_model_len} "
                      f"in all, leaving no room for output")
    max_tokens = req.sampling.max_tokens
    if max_tokens is not None:
        if max_tokens > room:
            raise invalid(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is more than "
                          f"the model's {limits.max_model_len}")
        return max_tokens
    return room
