"""A request's state inside one replica engine.

Invariant: the KV cache holds tokens [0, num_computed_tokens) of token_ids.
A step schedules a chunk of the uncomputed tokens; when a chunk reaches the
last known token the runner samples one more, which is appended to the
output. Prefill, chunked prefill, decode and recompute after preemption are
all the same thing: computed tokens catching up with known tokens.

Placeholders. A sampled token is first appended as a placeholder, before its
value is back on the host (the engine schedules the next step meanwhile:
core.py). token_ids holds it as placeholder_code(row), a negative number naming
its row in the step that samples it; output_token_ids holds only resolved
tokens. At most one step's placeholder is unresolved when a step is scheduled,
and only ever as the last token (resolve_placeholder fills the oldest first).
num_tokens and num_output_tokens count placeholders: they are what scheduling
and sampling see. Readers of token values (the prefix cache's hashes, the
detokenizer) only read tokens before the last, or output_token_ids.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from replica_worker.engine.sampling_params import SamplingParams


def placeholder_code(row: int) -> int:
    """How token_ids holds the token sampled in row `row` of a step still in flight."""
    return -1 - row


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "cancelled"
    FINISHED_IGNORED = "error"  # could never be scheduled (e.g. larger than the KV cache)

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass
class SequenceTimes:
    """Wall-clock timestamps (time.time()), recorded once each, never on re-admission."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        resume_token_ids: list[int] | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # Tokens an earlier replica generated: recomputed as context, counted
        # as output (max_tokens, stop strings), never reported again.
        self.num_resumed_tokens = len(resume_token_ids or ())
        self.output_token_ids: list[int] = list(resume_token_ids or ())
        self._token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens found in the prefix cache at first admission (vLLM's name):
        # they started computed, so this replica never ran them.
        self.num_cached_tokens = 0
        # Physical KV block ids in logical order; owned by the BlockManager.
        self.block_ids: list[int] = []
        # Content hashes of the leading full blocks of token_ids, as far as the
        # BlockManager needed them (it owns them). Tokens are only appended, so
        # they stay valid for the sequence's life, preemptions included.
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        # Tokens sampled whose values are not back yet (their codes end token_ids).
        self.num_placeholders = 0
        # Set by the engine when the token in flight is the last one the request
        # can have (max_tokens or the model's length): nothing more is scheduled.
        self.last_token_in_flight = False
        self.times = SequenceTimes(arrival=time.time() if arrival_time is None else arrival_time)

    # ---- token bookkeeping ----
    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only by convention: use append_token."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled, placeholders included: the output index of the next."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def num_new_output_tokens(self) -> int:
        """Resolved output tokens generated on this replica (not resumed)."""
        return len(self.output_token_ids) - self.num_resumed_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True until the KV cache has caught up with all but the newest token.

        A preempted sequence is back in prefill: its whole context is recomputed.
        """
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Appends a known token (with no placeholder pending)."""
        assert not self.num_placeholders, f"{self} appends past a placeholder"
        self._token_ids.append(token_id)
        self._record_output(token_id, now)

    def append_placeholder(self, row: int) -> None:
        """The token sampled in row `row` of the step just launched."""
        self._token_ids.append(placeholder_code(row))
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int, now: float | None = None) -> None:
        """The oldest placeholder's value arrived."""
        assert self.num_placeholders > 0, f"{self} has no placeholder to resolve"
        index = len(self.prompt_token_ids) + len(self.output_token_ids)
        assert self._token_ids[index] < 0, (self, index)
        self._token_ids[index] = token_id
        self.num_placeholders -= 1
        self._record_output(token_id, now)

    def drop_placeholders(self) -> None:
        """Forgets tokens still in flight (the sequence ended before them)."""
        if self.num_placeholders:
            del self._token_ids[len(self._token_ids) - self.num_placeholders:]
            self.num_placeholders = 0
            self.num_computed_tokens = min(self.num_computed_tokens, len(self._token_ids))

    def _record_output(self, token_id: int, now: float | None) -> None:
        now = time.time() if now is None else now
        self.output_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)

    # ---- scheduling state ----
    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def mark_scheduled(self, now: float | None = None) -> None:
        self.status = SequenceStatus.RUNNING
        if self.times.first_scheduled is None:
            self.times.first_scheduled = time.time() if now is None else now

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the blocks are released; every known token
        is recomputed, except what the prefix cache still holds at re-admission."""
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING

    def finish(self, status: SequenceStatus, now: float | None = None) -> None:
        assert status.finished, status
        self.status = status
        self.times.finished = time.time() if now is None else now

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
