"""Sampler: greedy, temperature, top-k, top-p, and per-request seeds."""

from __future__ import annotations

import torch

from replica_worker.engine.sampler import Sampler, SamplingRow
from replica_worker.engine.sampling_params import SamplingParams

V = 64


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def rows(params: SamplingParams, n: int, index: int = 0) -> list[SamplingRow]:
    return [SamplingRow(params, index) for _ in range(n)]


def test_greedy_is_argmax_even_in_a_mixed_batch():
    logits = logits_rows(6)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0)
    batch = [SamplingRow(greedy if i % 2 == 0 else hot, 0) for i in range(6)]
    out = Sampler("cpu")(logits, batch)
    assert out[0::2].tolist() == logits.argmax(-1)[0::2].tolist()
    assert torch.equal(Sampler("cpu")(logits, rows(greedy, 6)), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_rows(32)
    sampler = Sampler("cpu", seed=1)
    assert torch.equal(sampler(logits, rows(SamplingParams(temperature=1.5, top_k=1), 32)), logits.argmax(-1))
    assert torch.equal(sampler(logits, rows(SamplingParams(temperature=1.5, top_p=1e-6), 32)), logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = logits_rows(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    sampler = Sampler("cpu")
    solo = [sampler(logits[None], [SamplingRow(params, i)]).item() for i in range(40)]
    others = logits_rows(5, seed=4)
    for i in range(40):
        batch = torch.cat([others[:i % 5], logits[None], others[i % 5:]])
        mix = [SamplingRow(SamplingParams(temperature=0.7, top_k=5), 0) for _ in range(i % 5)]
        mix += [SamplingRow(params, i)]
        mix += [SamplingRow(SamplingParams(temperature=1.0, seed=i), 3) for _ in range(5 - i % 5)]
        assert sampler(batch, mix)[i % 5].item() == solo[i]
    assert len(set(solo)) > 3  # different output indices draw different noise
    # Resuming at output index 17 draws what the uninterrupted run drew there.
    assert Sampler("cpu", seed=99)(logits[None], [SamplingRow(params, 17)]).item() == solo[17]


def test_unseeded_rows_use_the_global_generator():
    logits = logits_rows(1)[0].repeat(200, 1)
    params = SamplingParams(temperature=1.0)
    a = Sampler("cpu", seed=5)(logits, rows(params, 200))
    b = Sampler("cpu", seed=5)(logits, rows(params, 200))
    assert torch.equal(a, b) and len(set(a.tolist())) > 3


def test_frequencies_follow_temperature_softmax():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    for temp in (0.5, 1.0, 2.0):
        out = Sampler("cpu", seed=7)(base.repeat(n, 1), rows(SamplingParams(temperature=temp), n))
        freq = torch.bincount(out, minlength=6).float() / n
        torch.testing.assert_close(freq, torch.softmax(base / temp, -1), atol=0.015, rtol=0)


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = probs.log().repeat(5000, 1)
    sampler = Sampler("cpu", seed=11)

    def support(params):
        return set(sampler(logits, rows(params, 5000)).tolist())

    assert support(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert support(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_p=0.9)) == {0, 1, 2}
    assert support(SamplingParams(temperature=1.0, top_k=3, top_p=0.9)) == {0, 1, 2}
    # top-p applies to the top-k-renormalised distribution: 0.5/0.8 = 0.625 < 0.7.
    assert support(SamplingParams(temperature=1.0, top_k=2, top_p=0.7)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_k=2, top_p=0.6)) == {0}
    # Renormalised over the kept tokens: 0.3 / 0.8 of the draws.
    out = sampler(logits, rows(SamplingParams(temperature=1.0, top_k=2), 5000))
    assert abs((out == 1).float().mean().item() - 0.375) < 0.03
