"""Per-request sampling settings, validated at construction.

The meanings follow the OpenAI API and vLLM's SamplingParams; docs/engine.md
says what each one does to the logits, and in which order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.sampling_inputs import pack_params
from replica_worker.engine.seeded_draws import derived_seed

# Below this temperature a request is greedy: dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # as the OpenAI API's top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024  # bounds the per-step work a request can ask for
_SEED_LIMIT = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 or -1 disables top-k; top_p 1 disables top-p.

    max_tokens and min_tokens count every output token of the request,
    including tokens an earlier replica generated before it migrated here.

    n: completions per prompt. LLM.generate expands it into n sequences; the
        engine runs one sequence per request id and accepts only n == 1.
    logprobs: None, or k >= 0: report each output token's logprob and the k
        most likely tokens' logprobs, from the model's raw distribution.
    min_tokens: EOS and stop_token_ids cannot be sampled, and stop strings
        do not end the request, before this many output tokens.
    min_p: keep tokens whose probability is at least min_p times the top one's.
    presence_penalty, frequency_penalty: OpenAI's, over the output tokens:
        logit -= frequency_penalty * count + presence_penalty * (count > 0).
    repetition_penalty: CTRL's, over prompt and output tokens: a seen token's
        logit is divided by it when positive, multiplied when not.
    logit_bias: {token id: bias}, OpenAI's: added to those tokens' logits before
        the penalties and sampling (greedy included); bias in [-100, 100]. Kept as
        sorted (token, bias) pairs.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept lists (and None, as vLLM's defaults are) from callers but store
        # tuples so the object stays hashable and frozen.
        stop = self.stop or ()
        object.__setattr__(self, "stop", tuple([stop] if isinstance(stop, str) else stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias or ()))
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative")
        if self.seed is not None and -(_SEED_LIMIT >> 1) <= self.seed < 0:
            # A signed 64-bit seed, as vLLM takes it: the same draws as its unsigned form.
            object.__setattr__(self, "seed", self.seed % _SEED_LIMIT)
        if self.seed is not None and not 0 <= self.seed < _SEED_LIMIT:
            raise InvalidRequestError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    def _check_counts(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def _check_distribution(self) -> None:
        if not self.temperature >= 0.0 or math.isinf(self.temperature):  # also rejects NaN
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_completion(self, index: int) -> "SamplingParams":
        """Settings of completion `index` of n: n = 1, and with a seed, a seed of its own.

        Completion 0 keeps the seed, so n = 1 and the first of n agree;
        completion i > 0 takes seeded_draws.derived_seed(seed, i), so
        completions differ and each is reproducible.
        """
        seed = self.seed
        if seed is not None and index:
            seed = derived_seed(seed, index)
        return replace(self, n=1, seed=seed)

    @cached_property
    def packed(self) -> bytes:
        """This request's constant sampler columns (sampling_inputs.COLUMNS), as int32 words.

        Computed once per request, so a step joins bytes instead of reading
        a dozen attributes per row.
        """
        return pack_params(self)



def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit_bias given as a dict or (token, bias) pairs -> sorted pairs, checked."""
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = {}
    for token, value in items:
        token, value = int(token), float(value)
        if token < 0:
            raise InvalidRequestError(f"logit_bias token ids must be non-negative, got {token}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:   # also rejects NaN
            raise InvalidRequestError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value} "
                f"for token {token}")
        pairs[token] = value
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    return tuple(sorted(pairs.items()))
