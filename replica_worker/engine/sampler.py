"""Token sampling from the logits of the sampling rows, vectorized over the batch.

Per row, in order (vLLM's): logit_bias is added; min_tokens masks EOS and
stop_token_ids; the repetition, frequency and presence penalties; then greedy rows take argmax
of these float32 logits, and the others divide by temperature, cut by
min-p, top-k and top-p (sampling_ops.cutoffs) and draw one token by inverse
CDF from a single uniform draw. Logprobs are those of the model's raw
distribution: log_softmax of the logits before any of the above.

Host work per step does not grow with the vocabulary: the rows' settings are
read from packed bytes (SamplingParams.packed), the groups each stage needs
are found with numpy, and everything reaches the device in one copy
(sampling_inputs.transfer). There is no per-row kernel and no host sync;
the caller's one device-to-host copy (SampledBatch.to_host) brings back the
tokens and any logprobs together.

Seeds. A seeded row's draw is output i of the SplitMix64 stream of its seed,
i being the output index of the token (seeded_draws.py): a counter-based
draw, so the same seed draws the same number at the same output index
whatever else shares the batch, on any replica, and a request resumed at
output index i draws what it would have drawn there. The token is a
function of that draw and the row's own logits, computed by row-wise
operations, so it depends on the batch only through those logits: where the
model's logits for a row do not change with the batch (float32 on the CPU,
which the tests check), a seeded request's tokens are identical alone and in
any batch. In bfloat16 on a GPU the logits themselves can change with the
batch shape, and then so can the tokens. Unseeded rows draw from the
engine's own generator, seeded by ModelConfig.seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from replica_worker.engine.outputs import TokenLogprobs
from replica_worker.engine.penalty_state import PenaltyState
from replica_worker.engine.sampling_inputs import transfer
from replica_worker.engine.sampling_ops import (apply_penalties_, cutoffs, sample_inverse_cdf, sorted_descending,
                                                token_logprobs)
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sampling_plan import SamplingPlan

# Rows with a top-k up to this take their cut-off from torch.topk; others
# (top-p without top-k, or a larger k) from a sort of the whole vocabulary.
TOPK_LIMIT = 1024


@dataclass(eq=False)
class SamplingRow:
    """One row to sample, for callers without a Sequence (a Sequence serves as one).

    num_output_tokens is the output index of the token being sampled; the
    token lists are read only when the row uses penalties.
    """

    sampling_params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # None when no row asked for them


@dataclass
class SampledBatch:
    """A step's sampled tokens (and logprobs), still on the device."""

    packed: torch.Tensor  # [S] token ids; with logprobs int32, followed by [L, 2 + 2K] per logprob row
    num_rows: int
    logprob_rows: np.ndarray  # rows that asked for logprobs, in order
    logprob_k: np.ndarray  # each such row's k
    width: int  # K
    _host: torch.Tensor | None = field(default=None, repr=False)  # pinned copy under way
    _copied: object = field(default=None, repr=False)  # the CUDA event that marks its end

    @property
    def token_ids_device(self) -> torch.Tensor:
        """[S] the sampled ids, on the device (what a next step's placeholders read)."""
        return self.packed[: self.num_rows]

    def start_copy(self) -> "SampledBatch":
        """Starts the device-to-host copy without waiting for it (on CUDA: into
        pinned memory, behind the step's kernels); to_host() waits for it."""
        if self.packed.is_cuda and self._host is None:
            self._host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self._host.copy_(self.packed, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self

    def to_host(self) -> SamplerOutput:
        """The step's one device-to-host copy (waits for the step)."""
        if self._host is not None:
            self._copied.synchronize()
            flat = self._host.numpy()
        else:
            flat = self.packed.cpu().numpy()
        ids = flat[: self.num_rows].tolist()
        if not len(self.logprob_rows):
            return SamplerOutput(ids)
        # A row: the sampled token's logprob (float32 bits), its rank, then K ids and K logprobs.
        table = flat[self.num_rows:].reshape(len(self.logprob_rows), 2 + 2 * self.width)
        chosen = table[:, 0].view(np.float32).tolist()
        ranks = table[:, 1].tolist()
        top_ids = table[:, 2: 2 + self.width].tolist()
        top_lps = table[:, 2 + self.width:].view(np.float32).tolist()
        logprobs: list[TokenLogprobs | None] = [None] * self.num_rows
        for j, row in enumerate(self.logprob_rows.tolist()):
            k = int(self.logprob_k[j])
            logprobs[row] = TokenLogprobs(chosen[j], tuple(zip(top_ids[j][:k], top_lps[j][:k])), ranks[j])
        return SamplerOutput(ids, logprobs)


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0, eos_token_ids=()) -> None:
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.set_eos_token_ids(eos_token_ids)
        self._penalties: PenaltyState | None = None
        # On the device once: assigning a Python float through advanced indexing
        # copies it from pageable host memory, which synchronizes the stream.
        self._neg_inf = torch.tensor(float("-inf"), device=self.device)

    def penalty_state(self, vocab_size: int) -> PenaltyState:
        if self._penalties is None:
            self._penalties = PenaltyState(vocab_size, self.device)
        return self._penalties

    def set_eos_token_ids(self, ids) -> None:
        """EOS ids that min_tokens keeps from being sampled (unless ignore_eos)."""
        self.eos_token_ids = np.asarray(sorted(set(ids)), dtype=np.int64)

    def release(self, row) -> None:
        """The row's sequence has left the engine: drop its penalty counts."""
        if self._penalties is not None:
            self._penalties.release(row)

    def __call__(self, logits: torch.Tensor, rows: list, argmax: torch.Tensor | None = None) -> SampledBatch:
        """logits [S, V] float32, one row per entry of rows -> the sampled batch on the device.

        The logits may be overwritten: min_tokens masks and penalties apply in
        place, and sampling reuses their memory. argmax, when given, is
        logits.argmax(-1) already computed (a CUDA graph's); it is used when
        no row needs more than that.
        """
        plan = SamplingPlan.build(rows, self, logits.shape[-1], TOPK_LIMIT)
        if plan.plain_greedy:
            ids = argmax if argmax is not None else logits.argmax(dim=-1)
            return SampledBatch(ids, len(rows), plan.logprob_rows, plan.logprob_k, 0)
        dev = transfer(plan.sections, self.device)
        changes = "mask_rows" in dev or "bias_rows" in dev or plan.penalty_slots is not None
        raw = None
        if len(plan.logprob_rows):  # logprobs are of the raw logits: keep them before any change
            raw = logits[dev["logprob_rows"]] if changes or not plan.all_logprobs else logits
        self._process_(logits, plan, dev)
        ids = logits.argmax(dim=-1) if plan.any_greedy else None
        if len(plan.random_rows):
            sampled = self._sample_random(logits, plan, dev, may_overwrite=raw is not logits)
            ids = sampled if ids is None else ids.index_put_((dev["random_rows"],), sampled)
        if plan.penalty_slots is not None:
            self._penalties.record(dev["penalty_slots"], ids[dev["penalty_rows"]])
        return self._pack(raw, ids, plan, dev)

    def _process_(self, logits: torch.Tensor, plan: SamplingPlan, dev: dict) -> None:
        """logit_bias, min_tokens masks, then penalties, in place."""
        if "bias_rows" in dev:
            logits.index_put_((dev["bias_rows"], dev["bias_tokens"]), dev["bias_values"], accumulate=True)
        if "mask_rows" in dev:
            logits.index_put_((dev["mask_rows"], dev["mask_tokens"]), self._neg_inf)
        if plan.penalty_slots is not None:
            state = self._penalties  # assigned by the plan
            state.rebuild(dev)
            rows, slots = dev["penalty_rows"], dev["penalty_slots"]
            in_prompt = state.in_prompt[slots] if plan.any_repetition else None
            target = logits if plan.all_penalties else logits[rows]
            apply_penalties_(target, state.counts[slots], in_prompt,
                             dev["presence"], dev["frequency"], dev["repetition"])
            if not plan.all_penalties:
                logits[rows] = target

    def _sample_random(self, logits: torch.Tensor, plan: SamplingPlan, dev: dict, may_overwrite: bool) -> torch.Tensor:
        temperature = dev["temperature"][:, None]
        # sample_inverse_cdf overwrites what it is given: the logits when nothing reads them after, else a copy.
        if plan.all_random:
            scaled = logits.div_(temperature) if may_overwrite else logits / temperature
        else:
            scaled = logits[dev["random_rows"]].div_(temperature)
        cutoff = None
        if plan.topk_width or "sort_local" in dev:
            cutoff = torch.full((scaled.shape[0],), float("-inf"), device=logits.device)
        k, p, min_p = dev["top_k"], dev["top_p"], dev["min_p"]
        if plan.topk_width:
            local = dev["topk_local"]
            top = scaled[local].topk(plan.topk_width, dim=-1).values
            cutoff[local] = cutoffs(top, k[local], p[local], min_p[local])
        if "sort_local" in dev:
            local = dev["sort_local"]
            cutoff[local] = cutoffs(sorted_descending(scaled[local]), k[local], p[local], min_p[local])
        return sample_inverse_cdf(scaled, cutoff, dev["uniform"])

    def _pack(self, raw: torch.Tensor | None, ids: torch.Tensor, plan: SamplingPlan, dev: dict) -> SampledBatch:
        if raw is None:
            return SampledBatch(ids, len(plan.greedy), plan.logprob_rows, plan.logprob_k, 0)
        width = plan.logprob_width
        chosen, rank, top_ids, top_lps = token_logprobs(raw, ids[dev["logprob_rows"]], width)
        table = [chosen[:, None].view(torch.int32), rank[:, None].to(torch.int32)]
        if width:
            table += [top_ids.to(torch.int32), top_lps.view(torch.int32)]
        packed = torch.cat([ids.to(torch.int32), torch.cat(table, dim=1).reshape(-1)])
        return SampledBatch(packed, len(plan.greedy), plan.logprob_rows, plan.logprob_k, width)
