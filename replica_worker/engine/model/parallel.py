"""Tensor-parallel layers: each rank holds only its shard of a weight.

- ColumnParallelLinear splits output features: rank r computes its slice of y and
  nothing is communicated. A fused projection (q|k|v, gate|up) holds, one after the
  other, the rank's rows of each checkpoint matrix, so the slices it outputs are the
  rank's heads (or intermediate features) of each part.
- RowParallelLinear splits input features, the ones the column-parallel layer before it
  produced on this rank; each rank's partial product is summed by an all-reduce.
- VocabParallelEmbedding holds a range of the vocabulary's rows; a token outside the
  range looks up zeros, and the all-reduce leaves each token its one real row.
- ParallelLMHead holds the same rows of the output matrix; the logit shards are
  all-gathered, so every rank has the whole vocabulary's logits (rank 0 samples).

Loading: `load(part, kind, source)` copies this rank's share of one checkpoint tensor,
given full-sized (a torch tensor or a safetensors slice, which reads only what is
indexed). `init_dummy` draws the full-sized tensor with the seeded generator, then
keeps the rank's share, so every tensor-parallel size holds the same dummy model.

At size 1 a shard is the whole weight and forward is the plain op, nothing more.
A projection quantized to fp8 (`quantize_fp8`, after loading) keeps its shard's
weight in e4m3 with per-output-channel scales (model/fp8.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica_worker.engine.distributed.group import TensorGroup
from replica_worker.engine.model.fp8 import Fp8Weight


def empty_param(*shape: int) -> nn.Parameter:
    # Allocated on the ambient default device and dtype (see loader.model_context).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def check_shape(source, expected: tuple[int, ...], what: str) -> None:
    if _shape(source) != expected:
        raise ValueError(f"{what}: checkpoint shape {_shape(source)}, expected {expected}")


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one rank: q heads [q_start, q_start + num_heads), kv heads
    [kv_start, kv_start + num_kv_heads)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int


def tensor_parallel_problem(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> str | None:
    """None when a model of this shape splits over `size` ranks, else why it does not."""
    if intermediate_size % size:
        return f"intermediate_size {intermediate_size} is not divisible by tensor_parallel_size {size}"
    return _head_problem(num_heads, num_kv_heads, size)


def _head_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    if num_heads % size:
        return f"num_attention_heads {num_heads} is not divisible by tensor_parallel_size {size}"
    if num_kv_heads >= size and num_kv_heads % size:
        return f"num_key_value_heads {num_kv_heads} is not divisible by tensor_parallel_size {size}"
    if num_kv_heads < size and size % num_kv_heads:
        return (f"tensor_parallel_size {size} is not a multiple of num_key_value_heads {num_kv_heads}, "
                "so the kv heads cannot be replicated evenly")
    return None


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Query heads split evenly. With fewer kv heads than ranks each kv head is
    replicated on size / num_kv_heads ranks: the ones whose query heads attend to it."""
    problem = _head_problem(num_heads, num_kv_heads, size)
    if problem:
        raise ValueError(problem)
    q_per_rank = num_heads // size
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        return HeadShard(q_per_rank, rank * q_per_rank, kv_per_rank, rank * kv_per_rank)
    return HeadShard(q_per_rank, rank * q_per_rank, 1, rank * num_kv_heads // size)


@dataclass(frozen=True)
class RowSlice:
    """This rank's rows [start, start + rows) of a checkpoint matrix of full_rows rows."""

    part: str
    full_rows: int
    start: int
    rows: int

    @classmethod
    def even(cls, part: str, full_rows: int, rank: int, size: int) -> "RowSlice":
        rows = full_rows // size
        return cls(part, full_rows, rank * rows, rows)


def _small_m_rows() -> int:
    raw = os.environ.get("QUADRIGA_SMALL_M_GEMV_ROWS", "16").strip() or "0"
    return max(0, min(16, int(raw)))


# Projections of at most this many rows (CUDA, bf16/fp16) take model/triton_gemv.py's
# kernel instead of cuBLAS; 16 by default (two H100 runs: batch-1 steps 6-8% shorter
# with the fused KV store beside it), 0: none.
# Fixed at import, so a captured CUDA graph and the eager steps around it agree.
SMALL_M_GEMV_ROWS = _small_m_rows()


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or for the few rows of a small decode batch the Triton kernel when it
    is turned on (SMALL_M_GEMV_ROWS)."""
    if (SMALL_M_GEMV_ROWS and x.shape[0] <= SMALL_M_GEMV_ROWS and x.dim() == 2 and x.is_cuda
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype):
        from replica_worker.engine.model import triton_gemv

        if triton_gemv.available():
            return triton_gemv.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class _Linear(nn.Module):
    """A projection whose weight may be quantized to fp8 once loaded (model/fp8.py):
    then `fp8` holds it and `weight` is gone, so the bf16 copy's memory is freed."""

    fp8: Fp8Weight | None = None
    bias: nn.Parameter | None

    def quantize_fp8(self) -> None:
        self.fp8 = Fp8Weight(self.weight.data)
        del self.weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.linear(x, self.bias, x.dtype)
        return small_m_linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, slices: list[RowSlice], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.slices = {s.part: s for s in slices}
        self.offsets, offset = {}, 0
        for s in slices:
            self.offsets[s.part] = offset
            offset += s.rows
        self.weight = empty_param(offset, in_features)
        self.bias = empty_param(offset) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def expected_loads(self) -> set[tuple[str, str]]:
        kinds = ("weight", "bias") if self.bias is not None else ("weight",)
        return {(part, kind) for part in self.slices for kind in kinds}

    def load(self, part: str, kind: str, source) -> None:
        s = self.slices[part]
        dst = self.weight if kind == "weight" else self.bias
        if dst is None:
            raise ValueError(f"the config declares no bias for this {part} projection")
        check_shape(source, (s.full_rows, *dst.shape[1:]), f"{part} {kind}")
        start = self.offsets[part]
        dst[start : start + s.rows].copy_(source[s.start : s.start + s.rows])

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        for kind, dst in (("weight", self.weight), ("bias", self.bias)):
            if dst is None:
                continue
            full_rows = sum(s.full_rows for s in self.slices.values())
            full = torch.empty(full_rows, *dst.shape[1:], dtype=dst.dtype, device=dst.device)
            full.normal_(0.0, std, generator=generator)
            offset = 0
            for part, s in self.slices.items():
                self.load(part, kind, full[offset : offset + s.full_rows])
                offset += s.full_rows


class RowParallelLinear(_Linear):
    """Input features [start, start + in_features / size) on this rank (no bias)."""

    def __init__(self, in_features: int, out_features: int, start: int, group: TensorGroup) -> None:
        super().__init__()
        self.full_in = in_features
        self.start = start
        self.group = group
        self.reduce = group.size > 1
        self.weight = empty_param(out_features, in_features // group.size)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return self.group.all_reduce(out) if self.reduce else out

    def expected_loads(self) -> set[tuple[str, str]]:
        return {("", "weight")}

    def load(self, part: str, kind: str, source) -> None:
        check_shape(source, (self.weight.shape[0], self.full_in), kind)
        self.weight.copy_(source[:, self.start : self.start + self.weight.shape[1]])

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        w = self.weight
        full = torch.empty(w.shape[0], self.full_in, dtype=w.dtype, device=w.device)
        self.load("", "weight", full.normal_(0.0, std, generator=generator))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + ceil(vocab / size)) of the vocabulary; rows past the
    vocabulary (its padding to a multiple of size) are zeros nobody looks up."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorGroup,
                 weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        self.rows = -(-vocab_size // group.size)
        self.start = group.rank * self.rows
        self.weight = empty_param(self.rows, hidden_size) if weight is None else weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def expected_loads(self) -> set[tuple[str, str]]:
        return {("", "weight")}

    def load(self, part: str, kind: str, source) -> None:
        check_shape(source, (self.vocab_size, self.weight.shape[1]), kind)
        held = max(0, min(self.rows, self.vocab_size - self.start))
        if held < self.rows:
            self.weight[held:].zero_()
        if held:
            self.weight[:held].copy_(source[self.start : self.start + held])

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        w = self.weight
        full = torch.empty(self.vocab_size, w.shape[1], dtype=w.dtype, device=w.device)
        self.load("", "weight", full.normal_(0.0, std, generator=generator))


class ParallelLMHead(VocabParallelEmbedding):
    """The output matrix, split by vocabulary rows like the embedding; a tied head
    shares the embedding's shard and is neither loaded nor drawn itself."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorGroup,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, group, None if tied_to is None else tied_to.weight)
        self.tied = tied_to is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab] of the (already selected) sampling rows."""
        if self.group.size == 1:
            return small_m_linear(hidden, self.weight).float()
        local = F.linear(hidden, self.weight)  # [S, rows]; gathered in the model dtype
        shards = self.group.all_gather(local).view(self.group.size, *local.shape)
        logits = shards.transpose(0, 1).reshape(local.shape[0], -1)
        return logits[:, : self.vocab_size].float()

    def expected_loads(self) -> set[tuple[str, str]]:
        return set() if self.tied else super().expected_loads()

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        if not self.tied:
            super().init_dummy(generator, std)
