"""Sampler penalties and min_tokens: against transformers' processor and OpenAI's formula,
and the device-side counts carried from step to step."""

from __future__ import annotations

import random

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from replica_worker.engine.sampler import Sampler, SamplingRow
from replica_worker.engine.sampling_ops import apply_penalties_
from replica_worker.engine.sampling_params import SamplingParams

V = 50


def histories(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([rng.randrange(V) for _ in range(rng.randrange(1, 12))],
             [rng.randrange(V // 2) for _ in range(rng.randrange(0, 15))]) for _ in range(n)]


def openai_penalized(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token in set(output):
        count = output.count(token)
        out[token] = logits[token] - count * frequency - presence
    return out


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(12, V) * 3
    hist = histories(12)
    for penalty in (1.3, 0.7):
        expected = torch.stack([
            RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + o]), logits[i:i + 1].clone())[0]
            for i, (p, o) in enumerate(hist)])
        counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=V) for _, o in hist])
        in_prompt = torch.stack([torch.bincount(torch.tensor(p), minlength=V) > 0 for p, _ in hist])
        got = logits.clone()
        apply_penalties_(got, counts.float(), in_prompt, torch.zeros(12), torch.zeros(12), torch.full((12,), penalty))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # Through the sampler: greedy is argmax of the penalized logits.
        params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
        batch = [SamplingRow(params, len(o), p, o) for p, o in hist]
        assert Sampler("cpu")(logits.clone(), batch).to_host().token_ids == expected.argmax(-1).tolist()


def test_presence_and_frequency_follow_the_openai_formula():
    torch.manual_seed(1)
    logits = torch.randn(12, V)
    hist = histories(12, seed=1)
    for presence, frequency in ((0.8, 0.0), (0.0, 0.6), (1.5, -0.4), (-2.0, 2.0)):
        expected = torch.stack([openai_penalized(logits[i], o, presence, frequency) for i, (_, o) in enumerate(hist)])
        params = SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
        batch = [SamplingRow(params, len(o), p, o) for p, o in hist]
        assert Sampler("cpu")(logits.clone(), batch).to_host().token_ids == expected.argmax(-1).tolist()
        counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=V) for _, o in hist])
        got = logits.clone()
        apply_penalties_(got, counts.float(), None, torch.full((12,), presence), torch.full((12,), frequency),
                         torch.ones(12))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_counts_carried_on_the_device_match_a_rebuild_every_step():
    """Rows append what they sample, as the engine does; the kept counts must equal fresh ones."""
    torch.manual_seed(2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=4, frequency_penalty=0.5),
              SamplingParams(temperature=0.0)]
    carried = Sampler("cpu")
    live = [SamplingRow(params[i % 3], 0, [i, i + 1], []) for i in range(20)]  # more rows than the first slots
    for step in range(12):
        logits = torch.randn(len(live), V) * 2
        got = carried(logits.clone(), live).to_host().token_ids
        # A fresh sampler with fresh row objects rebuilds every count from the lists.
        fresh_rows = [SamplingRow(r.sampling_params, r.num_output_tokens, list(r.prompt_token_ids),
                                  list(r.output_token_ids)) for r in live]
        assert got == Sampler("cpu")(logits.clone(), fresh_rows).to_host().token_ids, step
        for row, token in zip(live, got):
            row.output_token_ids.append(token)
            row.num_output_tokens += 1
        if step == 5:  # some sequences leave, new ones arrive and take their slots
            for row in live[:6]:
                carried.release(row)
            live = live[6:] + [SamplingRow(params[0], 0, [7, 8, 9], []) for _ in range(4)]
    state = carried.penalty_state(V)
    assert state.num_slots >= 14


def test_a_row_whose_token_was_not_appended_is_rebuilt():
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = Sampler("cpu")
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    row = SamplingRow(params, 0, [1], [])
    assert sampler(logits.clone(), [row]).to_host().token_ids == [5]
    # The 5 was never appended: the next step must not count it.
    assert sampler(logits.clone(), [row]).to_host().token_ids == [5]
    row.output_token_ids.append(5)
    row.num_output_tokens = 1
    assert sampler(logits.clone(), [row]).to_host().token_ids != [5]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 7, 9
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop], logits[0, 3] = 5.0, 4.0, 3.0
    sampler = Sampler("cpu", eos_token_ids=[eos])

    def greedy(index: int, **kw) -> int:
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], **kw)
        return sampler(logits.clone(), [SamplingRow(params, index)]).to_host().token_ids[0]

    assert [greedy(i) for i in range(5)] == [3, 3, 3, eos, eos]
    # ignore_eos: EOS does not end the request, so it is not masked; stop ids still are.
    assert greedy(0, ignore_eos=True) == eos
    logits[0, eos] = -1.0
    assert greedy(0, ignore_eos=True) == 3
    # Sampled rows are masked too.
    hot = SamplingParams(temperature=5.0, min_tokens=2, stop_token_ids=[stop])
    out = sampler(logits.repeat(400, 1), [SamplingRow(hot, 1) for _ in range(400)]).to_host().token_ids
    assert eos not in out and stop not in out
