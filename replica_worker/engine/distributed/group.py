"""The collectives a tensor-parallel model calls, behind one small interface.

A layer asks its group for its rank and size when it is built (to size its shard) and
calls all_reduce / all_gather in its forward only when size > 1, so a single-process
model runs exactly the ops it ran before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from replica_worker.engine.step_batch import StepBatch


class TensorGroup:
    """The ranks that together hold one model. This base class is the one-rank group."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place (x is returned)."""
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along dim 0 in rank order ([size * n, ...])."""
        return x


SINGLE_RANK = TensorGroup()


class StepLink(Protocol):
    """How a rank's runner follows rank 0 (distributed/step_channel.py)."""

    def publish(self, batch: StepBatch) -> None:
        """Rank 0: sends the step's batch to the other ranks before running it."""

    def agree_min(self, value: int) -> int:
        """Every rank: the smallest of the ranks' values (the KV blocks all can hold)."""


@dataclass(frozen=True)
class RankContext:
    """One rank of a tensor-parallel engine, as its ModelRunner sees it."""

    tensors: TensorGroup
    device: str  # this rank's device ("cuda:1", "cpu")
    steps: StepLink

    @property
    def rank(self) -> int:
        return self.tensors.rank

    @property
    def size(self) -> int:
        return self.tensors.size
