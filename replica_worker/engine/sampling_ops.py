"""Device-side sampling stages, each vectorized over the rows it is given.

Every function works row by row in the sense that matters for seeds: a
row's result depends on that row's logits and settings alone, never on the
other rows or on how many there are.
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def apply_penalties_(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """Penalizes the logits [P, V] of penalty rows, in place.

    counts [P, V] float32: each token's count in the row's output.
    in_prompt [P, V] bool (None when no row has a repetition penalty): the
    token occurs in the prompt. Repetition first (CTRL: a seen logit is
    divided by the penalty when positive, multiplied otherwise), then
    OpenAI's logit -= frequency * count + presence * (count > 0).
    """
    in_output = counts.sign()  # counts >= 0: 1.0 where the token was output
    if in_prompt is not None:
        seen = in_prompt | (counts > 0)
        r = repetition[:, None]
        torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits, out=logits)
    logits.addcmul_(counts, frequency[:, None], value=-1.0)
    logits.addcmul_(in_output, presence[:, None], value=-1.0)


def cutoffs(
    top_values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the lowest logit that survives min-p, top-k and top-p.

    top_values [R, W]: the row's largest (temperature-scaled) logits, sorted
    in descending order; W must cover the row's top-k, and the whole
    vocabulary for a row with top-p and no top-k. top_k 0 means none.
    Order (vLLM's): min-p keeps tokens with logit >= best + log(min_p), that
    is p >= min_p * p_max; top-k keeps the k best; top-p keeps the smallest
    best-first prefix of what is left, renormalised, whose mass reaches p
    (always the best token). Each filter keeps a best-first prefix, so one
    value per row says what is kept; tokens tied with it are kept too.
    -inf when nothing is cut.
    """
    width = top_values.shape[1]
    best = top_values[:, :1]
    by_k = top_values.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])[:, 0]
    by_k = torch.where(top_k > 0, by_k, _NEG_INF)
    by_min_p = best[:, 0] + min_p.log()  # log(0) = -inf: no cut
    kept = torch.minimum(torch.where(top_k > 0, top_k, width), (top_values >= by_min_p[:, None]).sum(dim=-1))
    cum = (top_values - best).exp_().cumsum_(dim=-1)  # unnormalised mass of the best r + 1
    target = top_p * cum.gather(1, (kept - 1)[:, None])[:, 0]
    # The nucleus ends at the first rank whose cumulative mass reaches p of the kept mass.
    last = torch.searchsorted(cum, target[:, None])[:, 0].clamp_(max=width - 1)
    by_p = top_values.gather(1, last[:, None])[:, 0]
    by_p = torch.where(top_p < 1.0, by_p, _NEG_INF)
    return torch.maximum(torch.maximum(by_k, by_min_p), by_p)


def sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first (values only: sorting is exact, so any method agrees)."""
    if x.device.type == "cpu":
        # numpy's vectorized sort is an order of magnitude faster than torch's on the CPU.
        return torch.from_numpy(np.ascontiguousarray(np.sort(x.numpy(), axis=-1)[:, ::-1]))
    return x.sort(dim=-1, descending=True).values


def sample_inverse_cdf(logits: torch.Tensor, cutoff: torch.Tensor | None, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row: the first whose cumulative probability reaches u. Overwrites logits.

    logits [R, V] temperature-scaled; cutoff [R]: tokens below it are never
    drawn (None: no row cuts); uniform [R] float64 in (0, 1]. The CDF runs over the vocabulary in
    token-id order, in float64 (a float32 CDF would round tail tokens' mass
    to whole ulps of the total), so a row's token is a function of its
    logits and its draw only.
    """
    below = None if cutoff is None else logits < cutoff[:, None]
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    if below is not None:
        weights.masked_fill_(below, 0.0)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = uniform[:, None] * cdf[:, -1:]
    # A token of weight 0 never holds the first index reaching target > 0.
    index = torch.searchsorted(cdf, target)[:, 0]
    return index.clamp_(max=logits.shape[-1] - 1)


def token_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log_softmax of the raw logits at the sampled tokens [L], their ranks [L] (1 + the
    tokens more likely), and the top k (ids, logprobs) [L, k]."""
    norm = raw_logits.logsumexp(dim=-1, keepdim=True)
    sampled_logits = raw_logits.gather(1, sampled[:, None])
    chosen = sampled_logits - norm
    rank = (raw_logits > sampled_logits).sum(dim=-1) + 1
    if k == 0:
        return chosen[:, 0], rank, None, None
    top_values, top_ids = raw_logits.topk(k, dim=-1)
    return chosen[:, 0], rank, top_ids, top_values - norm
