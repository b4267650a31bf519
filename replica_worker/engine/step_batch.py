"""One step's batch as the model sees it: plain numbers, no Sequence objects.

The runner flattens the scheduler's chunks into a StepBatch once per step; under
tensor parallelism rank 0 sends it to the other ranks (distributed/step_channel.py),
which hold no sequences and run the same forward from it. Sequences are ordered
prefills (chunks of more than one token) first, then decodes, as the attention
backends want; sample_rows keep the caller's chunk order.

token_ids may hold placeholders (sequence.placeholder_code): tokens the step
before this one sampled, still on the device. The runner fills them there from
that step's sampled ids (fill_placeholders), so no host sync stands between
the two steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from replica_worker.engine.sequence import Sequence


class ChunkLike(Protocol):
    seq: Sequence
    num_tokens: int


@dataclass
class Chunk:
    seq: Sequence
    num_tokens: int


def samples(chunk: ChunkLike) -> bool:
    return chunk.seq.num_computed_tokens + chunk.num_tokens == chunk.seq.num_tokens


@dataclass(frozen=True)
class StepBatch:
    num_computed: list[int]  # per sequence: tokens already in the KV cache
    num_tokens: list[int]  # per sequence: tokens this step computes
    num_prefills: int
    # Per sequence, its KV blocks in logical order, covering num_computed + num_tokens
    # (may run longer: only the blocks the step needs are read).
    block_ids: Seq[Seq[int]]
    token_ids: np.ndarray  # int64 [T]: the computed tokens, flattened in sequence order
    sample_rows: np.ndarray  # int64 [S]: rows of the flattened batch whose logits are sampled

    @property
    def num_seqs(self) -> int:
        return len(self.num_tokens)

    @property
    def decode_only(self) -> bool:
        return self.num_prefills == 0

    @cached_property
    def has_placeholders(self) -> bool:
        """Read by the runner and the graphs each step: found once."""
        return bool(self.token_ids.size) and int(self.token_ids.min()) < 0


def fill_placeholders(input_ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """input_ids [T] on the device, placeholders replaced by the ids the step
    before sampled (previous [S], on the same device), without a host sync."""
    if previous is None or not previous.numel():
        raise ValueError("the step has placeholders but no step in flight to fill them from")
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, previous.to(input_ids.dtype)[rows], input_ids)


def batch_of(chunks: list[ChunkLike], max_model_len: int) -> tuple[StepBatch, list[int]]:
    """The step's batch, and the indices of the chunks that sample, in chunk order
    (sample_rows[k] is the last token of chunks[sampling[k]])."""
    order = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    num_prefills = len(order)
    order += [i for i, c in enumerate(chunks) if c.num_tokens <= 1]
    ordered = [chunks[i] for i in order]
    token_ids: list[int] = []
    last_row: dict[int, int] = {}
    for idx, c in zip(order, ordered):
        start = c.seq.num_computed_tokens
        if c.num_tokens < 1 or start + c.num_tokens > c.seq.num_tokens:
            raise ValueError(f"bad chunk of {c.num_tokens} tokens for {c.seq!r}")
        if start + c.num_tokens > max_model_len:
            raise ValueError(f"{c.seq!r} exceeds max_model_len {max_model_len}")
        token_ids.extend(c.seq.token_ids[start : start + c.num_tokens])
        last_row[idx] = len(token_ids) - 1
    sampling = [i for i, c in enumerate(chunks) if samples(c)]
    batch = StepBatch(
        num_computed=[c.seq.num_computed_tokens for c in ordered],
        num_tokens=[c.num_tokens for c in ordered],
        num_prefills=num_prefills,
        block_ids=[c.seq.block_ids for c in ordered],
        token_ids=np.asarray(token_ids, dtype=np.int64),
        sample_rows=np.asarray([last_row[i] for i in sampling], dtype=np.int64),
    )
    return batch, sampling
