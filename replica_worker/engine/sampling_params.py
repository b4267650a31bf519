"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica_worker.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 or -1 disables top-k; top_p 1 disables top-p.

    max_tokens counts every output token of the request, including tokens an
    earlier replica generated before the request migrated here.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative")
        if self.seed is not None and self.seed < 0:
            raise InvalidRequestError(f"seed must be non-negative, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
