"""Sampler: greedy, temperature, the cut-offs against transformers' warpers, seeds, distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from replica_worker.engine.seeded_draws import derived_seed, stream_words, uniforms
from replica_worker.engine.sampler import Sampler, SamplingRow
from replica_worker.engine.sampling_ops import cutoffs, sorted_descending
from replica_worker.engine.sampling_params import SamplingParams

V = 64


def logits_rows(n: int, seed: int = 0, scale: float = 3.0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def rows(params: SamplingParams, n: int, index: int = 0) -> list[SamplingRow]:
    return [SamplingRow(params, index) for _ in range(n)]


def sample(sampler: Sampler, logits: torch.Tensor, batch: list) -> torch.Tensor:
    return torch.tensor(sampler(logits.clone(), batch).to_host().token_ids)


def test_greedy_is_argmax_even_in_a_mixed_batch():
    logits = logits_rows(6)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0)
    batch = [SamplingRow(greedy if i % 2 == 0 else hot, 0) for i in range(6)]
    out = sample(Sampler("cpu"), logits, batch)
    assert out[0::2].tolist() == logits.argmax(-1)[0::2].tolist()
    assert torch.equal(sample(Sampler("cpu"), logits, rows(greedy, 6)), logits.argmax(-1))
    # The given argmax (a CUDA graph's) is what plain greedy rows return.
    planted = torch.arange(6)
    assert Sampler("cpu")(logits, rows(greedy, 6), argmax=planted).to_host().token_ids == list(range(6))


def test_top_k_one_and_tiny_top_p_and_tiny_temperature_are_greedy():
    logits = logits_rows(32)
    sampler = Sampler("cpu", seed=1)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6),
                   SamplingParams(temperature=1e-6), SamplingParams(temperature=1.0, min_p=1.0)):
        assert torch.equal(sample(sampler, logits, rows(params, 32)), logits.argmax(-1)), params


def test_seeded_draws_are_splitmix64_streams():
    # The reference generator's first outputs for seed 0, and for seed 1234567.
    words = stream_words(np.zeros(3, np.uint64), np.arange(3))
    assert [hex(w) for w in words.tolist()] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f"]
    assert stream_words(np.full(2, 1234567, np.uint64), np.arange(2)).tolist() == [6457827717110365317,
                                                                               3203168211198807973]
    u = uniforms(np.full(5000, 9, np.uint64), np.arange(5000))
    assert ((u > 0) & (u <= 1)).all() and abs(u.mean() - 0.5) < 0.02
    assert len({derived_seed(42, i) for i in range(1, 100)} | {42}) == 100


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = logits_rows(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    sampler = Sampler("cpu")
    solo = [sample(sampler, logits[None], [SamplingRow(params, i)]).item() for i in range(40)]
    others = logits_rows(5, seed=4)
    company = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0, min_tokens=3),
               SamplingParams(temperature=1.0, seed=7, min_p=0.2), SamplingParams(top_p=0.5, logprobs=2)]
    for i in range(40):
        batch = torch.cat([others[:i % 5], logits[None], others[i % 5:]])
        mix = [SamplingRow(company[j % 4], j) for j in range(i % 5)]
        mix += [SamplingRow(params, i)]
        mix += [SamplingRow(SamplingParams(temperature=1.0, seed=i, frequency_penalty=0.5), 3, [1, 2], [4, 4, 5])
                for _ in range(5 - i % 5)]
        assert sample(sampler, batch, mix)[i % 5].item() == solo[i]
    assert len(set(solo)) > 3  # different output indices draw differently
    # Resuming at output index 17 draws what the uninterrupted run drew there.
    assert sample(Sampler("cpu", seed=99), logits[None], [SamplingRow(params, 17)]).item() == solo[17]


def test_unseeded_rows_use_the_engine_generator():
    logits = logits_rows(1)[0].repeat(200, 1)
    params = SamplingParams(temperature=1.0)
    a = sample(Sampler("cpu", seed=5), logits, rows(params, 200))
    b = sample(Sampler("cpu", seed=5), logits, rows(params, 200))
    c = sample(Sampler("cpu", seed=6), logits, rows(params, 200))
    assert torch.equal(a, b) and not torch.equal(a, c) and len(set(a.tolist())) > 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_follow_temperature_softmax(seeded):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    for temp in (0.5, 1.0, 2.0):
        params = SamplingParams(temperature=temp, seed=11 if seeded else None)
        # Seeded: one request's draws over 20000 output indices.
        batch = [SamplingRow(params, i) for i in range(n)] if seeded else rows(params, n)
        counts = torch.bincount(sample(Sampler("cpu", seed=7), base.repeat(n, 1), batch), minlength=6).float()
        # 5 degrees of freedom: 20.5 is the 0.999 quantile.
        assert _chi_square(counts, torch.softmax(base / temp, -1)) < 20.5, temp


def _warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' processing: temperature, top-k, top-p, min-p, in its order."""
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(ids, logits.clone())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return scores


def _kept(logits: torch.Tensor, params: SamplingParams, width: int | None = None) -> torch.Tensor:
    """The sampler's own cut-off, from the top `width` logits (all of them by default)."""
    scaled = logits / params.temperature
    n = scaled.shape[0]
    top = scaled.topk(width, dim=-1).values if width else sorted_descending(scaled)
    cut = cutoffs(top, torch.full((n,), max(params.top_k, 0)), torch.full((n,), params.top_p),
                  torch.full((n,), params.min_p))
    return scaled >= cut[:, None]


WARPER_CASES = [
    SamplingParams(top_k=5), SamplingParams(top_k=17, temperature=0.6),
    SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, temperature=1.7), SamplingParams(top_p=0.99),
    SamplingParams(top_k=8, top_p=0.7),
    SamplingParams(min_p=0.05), SamplingParams(min_p=0.3, temperature=0.5), SamplingParams(min_p=0.1, top_k=6),
]


@pytest.mark.parametrize("params", WARPER_CASES, ids=lambda p: f"k{p.top_k}-p{p.top_p}-minp{p.min_p}-t{p.temperature}")
def test_cut_offs_keep_what_transformers_warpers_keep(params):
    logits = logits_rows(64, seed=21, scale=2.0, vocab=500)
    reference = _warped(logits, params) > float("-inf")
    assert torch.equal(_kept(logits, params), reference)
    if params.top_k > 0 and params.top_p == 1.0:
        # The torch.topk path (width = the batch's largest k) keeps the same tokens.
        assert torch.equal(_kept(logits, params, width=params.top_k + 13), reference)
    # Sampled tokens stay inside the kept set, and every kept token of some weight turns up.
    draws = 4000
    row = logits[:1].repeat(draws, 1)
    got = sample(Sampler("cpu", seed=3), row, rows(params, draws))
    allowed = set(torch.nonzero(reference[0]).flatten().tolist())
    assert set(got.tolist()) <= allowed
    probs = torch.softmax(_warped(logits[:1], params), -1)[0]
    assert {t for t in allowed if probs[t] > 0.01} <= set(got.tolist())


def test_top_k_and_top_p_restrict_the_support_and_renormalise():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = probs.log().repeat(5000, 1)
    sampler = Sampler("cpu", seed=11)

    def support(params):
        return set(sample(sampler, logits, rows(params, 5000)).tolist())

    assert support(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert support(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_p=0.9)) == {0, 1, 2}
    # top-p applies to the top-k-renormalised distribution: 0.5/0.8 = 0.625 < 0.7.
    assert support(SamplingParams(temperature=1.0, top_k=2, top_p=0.7)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_k=2, top_p=0.6)) == {0}
    # min_p 0.5 keeps p >= 0.25; top-p 0.7 then applies to {0.5, 0.3} renormalised.
    assert support(SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6)) == {0}
    out = sample(sampler, logits, rows(SamplingParams(temperature=1.0, top_k=2), 5000))
    assert abs((out == 1).float().mean().item() - 0.375) < 0.03


def test_ties_at_the_cut_off_are_kept():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]]).repeat(3000, 1)
    got = sample(Sampler("cpu", seed=2), logits, rows(SamplingParams(top_k=2), 3000))
    assert set(got.tolist()) == {0, 1, 2, 3}


def test_logprobs_are_of_the_raw_distribution():
    logits = logits_rows(4, seed=8)
    batch = [SamplingRow(SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1), 0),
             SamplingRow(SamplingParams(temperature=0.0), 0),
             SamplingRow(SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=2.0), 1,
                         [int(logits[2].argmax())], [9]),
             SamplingRow(SamplingParams(temperature=1.0, logprobs=2, presence_penalty=1.0), 2, [], [3, 3])]
    out = Sampler("cpu")(logits.clone(), batch).to_host()
    reference = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for row, k in ((0, 5), (2, 0), (3, 2)):
        lp = out.logprobs[row]
        token = out.token_ids[row]
        assert lp.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert lp.rank == int((reference[row] > reference[row, token]).sum()) + 1
        top = reference[row].topk(k) if k else None
        assert [t for t, _ in lp.top] == ([] if top is None else top.indices.tolist())
        if k:
            np.testing.assert_allclose([v for _, v in lp.top], top.values.numpy(), atol=1e-5)
    assert out.token_ids[2] != int(logits[2].argmax())  # the penalty moved greedy, the logprobs stayed raw
