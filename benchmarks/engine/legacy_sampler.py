"""The engine's sampler before the vectorized one (replica_worker/engine/sampler.py),
kept only so that benchmarks/engine/sampler_bench.py can time both in one run.

Token sampling from the logits of the sampling rows.

Greedy rows (temperature 0) take argmax of the float32 logits. Other rows
scale by temperature, mask outside top-k and top-p (keeping at least the top
token), and take argmax(logits - log(E)) with E ~ Exp(1) over the vocabulary:
the Gumbel-max trick, an exact sample from the softmax with no normalisation.

A seeded request draws E from a generator seeded by (seed, output index)
alone, so its tokens do not depend on the rest of the batch, and a request
that migrates and resumes at output index i draws what it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica_worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): decorrelated streams for neighbouring indices."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    output_index: int  # index among the request's output tokens of the token being sampled


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [S, V] float32 -> token ids [S] int64 (on the device; no host sync)."""
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return greedy
        idx = torch.tensor(random_rows, device=logits.device)
        sampled = self._sample(logits.index_select(0, idx), [rows[i] for i in random_rows])
        return greedy.index_copy(0, idx, sampled)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[-1]
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
        x = logits / temps[:, None]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        need_k = any(k < vocab for k in top_k)
        need_p = any(p < 1.0 for p in top_p)
        if need_k or need_p:
            x = self._mask_top_k_top_p(x, top_k if need_k else None, top_p if need_p else None)
        noise = torch.empty_like(x)
        for i, r in enumerate(rows):
            gen = self.generator
            if r.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(mix_seed(r.params.seed, r.output_index))
            noise[i].exponential_(generator=gen)
        # exponential_ may return exactly 0; log(0) would make a masked token win.
        return (x - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log()).argmax(dim=-1)

    @staticmethod
    def _mask_top_k_top_p(x: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None) -> torch.Tensor:
        """Masks (to -inf) each row's logits below its cut-off. Ties at the cut-off stay."""
        device, vocab = x.device, x.shape[-1]
        sorted_x, _ = x.sort(dim=-1, descending=True)
        keep = torch.full((x.shape[0],), vocab, dtype=torch.int64, device=device)
        if top_k is not None:
            keep = torch.tensor(top_k, dtype=torch.int64, device=device).clamp_(1, vocab)
            ranks = torch.arange(vocab, device=device)
            sorted_x = sorted_x.masked_fill(ranks[None, :] >= keep[:, None], float("-inf"))
        if top_p is not None:
            p = torch.tensor(top_p, dtype=torch.float32, device=device)
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
            in_nucleus = (before < p[:, None]) | (p[:, None] >= 1.0)
            keep = torch.minimum(keep, in_nucleus.sum(dim=-1).clamp_(min=1))
        threshold = sorted_x.gather(1, (keep - 1)[:, None])
        return x.masked_fill(x < threshold, float("-inf"))
