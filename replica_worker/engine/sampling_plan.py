"""What one step's sampling needs, decided on the host from the rows' packed settings.

All of it is numpy over the batch's [S, C] settings array; the only
per-row Python is reading each row's params and output index, and, for
the few rows inside their min_tokens window or using penalties, a few
list operations each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from replica_worker.engine import sampling_inputs as si
from replica_worker.engine.seeded_draws import uniforms



@dataclass
class SamplingPlan:
    greedy: np.ndarray  # [S] bool
    random_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    topk_width: int = 0  # 0: no row takes its cut-off from torch.topk
    penalty_slots: np.ndarray | None = None
    any_repetition: bool = False
    logprob_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    logprob_k: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    logprob_width: int = 0
    sections: dict[str, np.ndarray] = field(default_factory=dict)  # what goes to the device

    @property
    def any_greedy(self) -> bool:
        return bool(self.greedy.any())

    @property
    def all_random(self) -> bool:
        return len(self.random_rows) == len(self.greedy)

    @property
    def all_penalties(self) -> bool:
        return self.penalty_slots is not None and len(self.penalty_slots) == len(self.greedy)

    @property
    def all_logprobs(self) -> bool:
        return len(self.logprob_rows) == len(self.greedy)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer."""
        return not len(self.random_rows) and not len(self.logprob_rows) and not self.sections

    @classmethod
    def build(cls, rows: list, sampler, vocab_size: int, topk_limit: int) -> "SamplingPlan":
        cols = si.columns([r.sampling_params for r in rows])
        flags = cols[:, si.FLAGS]
        greedy = (flags & si.GREEDY) != 0
        plan = cls(greedy=greedy)
        plan._plan_logprobs(cols)
        min_tokens = cols[:, si.MIN_TOKENS]
        seeded = ((flags & si.SEEDED) != 0) & ~greedy
        index = None
        if min_tokens.any() or seeded.any():
            index = np.fromiter((r.num_output_tokens for r in rows), dtype=np.int64, count=len(rows))
            plan._plan_min_tokens(rows, np.flatnonzero(index < min_tokens), sampler.eos_token_ids, vocab_size)
        bias_rows = np.flatnonzero(flags & si.LOGIT_BIAS)
        if len(bias_rows):
            plan._plan_logit_bias(rows, bias_rows)
        penalty_rows = np.flatnonzero(flags & si.PENALTIES)
        if len(penalty_rows):
            plan._plan_penalties(rows, cols, penalty_rows, sampler.penalty_state(vocab_size))
        plan.random_rows = np.flatnonzero(~greedy)
        if len(plan.random_rows):
            plan._plan_random(cols, seeded, index, sampler.rng, vocab_size, topk_limit)
        return plan

    def _plan_logprobs(self, cols: np.ndarray) -> None:
        k = cols[:, si.LOGPROBS]
        self.logprob_rows = np.flatnonzero(k != si.NO_LOGPROBS)
        if len(self.logprob_rows):
            self.logprob_k = k[self.logprob_rows]
            self.logprob_width = int(self.logprob_k.max())
            self.sections["logprob_rows"] = self.logprob_rows.astype(np.int64)

    def _plan_min_tokens(self, rows: list, active: np.ndarray, eos: np.ndarray, vocab_size: int) -> None:
        """(row, token) pairs to mask: stop_token_ids, and EOS unless ignore_eos."""
        if not len(active):
            return
        masked_rows, masked_tokens = [], []
        for j in active.tolist():
            p = rows[j].sampling_params
            ids = np.asarray(p.stop_token_ids, dtype=np.int64)
            if not p.ignore_eos:
                ids = np.concatenate([ids, eos])
            ids = ids[ids < vocab_size]
            masked_rows.append(np.full(len(ids), j, dtype=np.int64))
            masked_tokens.append(ids)
        tokens = np.concatenate(masked_tokens)
        if len(tokens):
            self.sections["mask_rows"] = np.concatenate(masked_rows)
            self.sections["mask_tokens"] = tokens

    def _plan_logit_bias(self, rows: list, bias_rows: np.ndarray) -> None:
        """(row, token, bias) triples to add to the logits."""
        pairs = [rows[j].sampling_params.logit_bias for j in bias_rows.tolist()]
        counts = np.fromiter((len(p) for p in pairs), dtype=np.int64, count=len(pairs))
        flat = np.array([pair for p in pairs for pair in p], dtype=np.float64).reshape(-1, 2)
        self.sections["bias_rows"] = np.repeat(bias_rows.astype(np.int64), counts)
        self.sections["bias_tokens"] = flat[:, 0].astype(np.int64)
        self.sections["bias_values"] = flat[:, 1].astype(np.float32)

    def _plan_penalties(self, rows: list, cols: np.ndarray, penalty_rows: np.ndarray, state) -> None:
        slots, rebuild = state.assign([rows[j] for j in penalty_rows.tolist()])
        floats = si.float_columns(cols)[penalty_rows]
        self.penalty_slots = slots
        self.any_repetition = bool((cols[penalty_rows, si.FLAGS] & si.REPETITION_PENALTY).any())
        self.sections.update(
            penalty_rows=penalty_rows.astype(np.int64), penalty_slots=slots,
            presence=np.ascontiguousarray(floats[:, si.PRESENCE]),
            frequency=np.ascontiguousarray(floats[:, si.FREQUENCY]),
            repetition=np.ascontiguousarray(floats[:, si.REPETITION]), **rebuild,
        )

    def _plan_random(self, cols, seeded, index, rng, vocab_size: int, topk_limit: int) -> None:
        rand = self.random_rows
        floats = si.float_columns(cols)[rand]
        top_k = cols[rand, si.TOP_K].astype(np.int64)
        top_k[top_k >= vocab_size] = 0  # a k covering the vocabulary cuts nothing
        top_p, min_p = floats[:, si.TOP_P], floats[:, si.MIN_P]
        small_k = (top_k > 0) & (top_k <= topk_limit)
        by_sort = ~small_k & ((top_p < 1.0) | (top_k > 0))
        by_topk = small_k | (~by_sort & (min_p > 0.0))
        if by_topk.any():
            self.topk_width = int(max(top_k[small_k].max(initial=1), 1))
            self.sections["topk_local"] = np.flatnonzero(by_topk).astype(np.int64)
        if by_sort.any():
            self.sections["sort_local"] = np.flatnonzero(by_sort).astype(np.int64)
        self.sections.update(
            random_rows=rand.astype(np.int64), uniform=self._draws(cols, seeded, index, rng),
            temperature=np.ascontiguousarray(floats[:, si.TEMPERATURE]), top_k=top_k,
            top_p=np.ascontiguousarray(top_p), min_p=np.ascontiguousarray(min_p),
        )

    def _draws(self, cols, seeded, index, rng) -> np.ndarray:
        """One uniform in (0, 1] per random row: SplitMix64(seed) at the output index, or the engine's generator."""
        is_seeded = seeded[self.random_rows]
        draws = np.empty(len(self.random_rows), dtype=np.float64)
        unseeded = ~is_seeded
        draws[unseeded] = 1.0 - rng.random(int(unseeded.sum()))
        if is_seeded.any():
            rows = self.random_rows[is_seeded]
            draws[is_seeded] = uniforms(si.seeds(cols[rows]), index[rows])
        return draws
