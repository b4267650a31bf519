"""What the engine reports: per-step deltas and per-request results with metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from replica_worker.engine.sequence import Sequence


class TokenLogprobs(NamedTuple):
    """One output token's logprob and the k most likely tokens' (token id, logprob), best first.

    From the model's raw distribution: log_softmax of the logits before
    penalties, temperature or any cut-off. rank: the sampled token's place in
    that distribution (1: the most likely; tokens tied with it share its rank),
    where the sampler computed it (None where it crossed a process boundary
    that does not carry it).
    """

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


@dataclass(frozen=True)
class Logprob:
    """One token's entry in CompletionOutput.logprobs, as vLLM's Logprob: its
    logprob, its rank in the distribution (1: the most likely) and its text
    alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock seconds. Times measured from arrival; token_gaps are the times between tokens."""

    arrival_time: float
    scheduling_delay: float | None
    time_to_first_token: float | None
    token_gaps: tuple[float, ...]
    end_to_end: float | None
    num_preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        t = seq.times

        def since_arrival(x: float | None) -> float | None:
            return None if x is None else x - t.arrival

        gaps = tuple(b - a for a, b in zip(t.token_times, t.token_times[1:]))
        return cls(
            arrival_time=t.arrival,
            scheduling_delay=since_arrival(t.first_scheduled),
            time_to_first_token=since_arrival(t.first_token),
            token_gaps=gaps,
            end_to_end=since_arrival(t.finished),
            num_preemptions=seq.num_preemptions,
        )


@dataclass(frozen=True)
class DeltaStats:
    """What a delta says of its sequence, copied when the delta is made: safe to
    read on another thread, or in another process, while the engine goes on."""

    arrival: float
    first_scheduled: float | None
    num_prompt_tokens: int
    num_resumed_tokens: int  # output tokens taken over from another replica
    num_cached_tokens: int
    num_preemptions: int
    token_times: tuple[float, ...]  # when each of the delta's tokens was sampled
    previous_token_time: float | None  # when the token before them was, if here

    @classmethod
    def of(cls, seq: Sequence, num_new: int) -> "DeltaStats":
        t = seq.times
        times = t.token_times
        before = len(times) - num_new - 1
        return cls(t.arrival, t.first_scheduled, seq.num_prompt_tokens, seq.num_resumed_tokens,
                   seq.num_cached_tokens, seq.num_preemptions, tuple(times[len(times) - num_new:]),
                   times[before] if before >= 0 else None)


@dataclass
class RequestDelta:
    """New output of one request in one step. output_offset is the index, in the
    request's whole output (resumed tokens included), of new_token_ids[0]."""

    request_id: str
    new_token_ids: list[int]
    text: str
    output_offset: int
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str = ""
    stats: DeltaStats | None = field(default=None, repr=False)
    # One per new token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class StepResult:
    deltas: list[RequestDelta]
    batch_size: int = 0
    num_tokens: int = 0
    num_preempted: int = 0
    step_time: float = 0.0


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int


@dataclass
class CompletionOutput:
    """One of a request's n completions, as LLM.generate returns it (vLLM's shape).

    logprobs: None unless the request asked for them; else one dict per
    output token, {token id: Logprob}, holding the sampled token and the k
    most likely (k or k + 1 entries), as vLLM's. cumulative_logprob: the sum
    of the sampled tokens' logprobs, None without logprobs. metrics: this
    completion's own timings.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    metrics: RequestMetrics | None = None


@dataclass
class RequestOutput:
    """One prompt's result from LLM.generate or LLM.chat (vLLM's shape).

    prompt is the text when a text prompt was given (for chat, the rendered
    conversation), else None. metrics are completion 0's; each completion
    carries its own. num_cached_tokens: prompt tokens served from the prefix
    cache (0 without one).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
