"""The sampling features through the whole engine, against transformers on the same weights."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from replica_worker import LLM, SamplingParams

PROMPTS = [[17, 5, 240, 33], list(range(40, 71)), [301, 302, 9, 9, 9, 77, 12]]


@pytest.fixture(scope="module")
def path(tiny_model):
    return str(tiny_model)


@pytest.fixture(scope="module")
def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, chunk_size=16, num_blocks=128)


def hf_log_softmax(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position [len(output), V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1].float(), dim=-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, ignore_eos=True, logprobs=3,
                   repetition_penalty=1.4),
])
def test_logprobs_equal_transformers_log_softmax(llm, hf, params):
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        c = out.outputs[0]
        reference = hf_log_softmax(hf, prompt, c.token_ids)
        for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert entry[token].logprob == pytest.approx(reference[pos, token].item(), abs=1e-4)
            # its rank: 1 + the tokens transformers finds more likely (a token within the
            # two sides' rounding of it may fall either way)
            ref_lp = reference[pos, token]
            assert (int((reference[pos] > ref_lp + 1e-4).sum()) + 1 <= entry[token].rank
                    <= int((reference[pos] > ref_lp - 1e-4).sum()) + 1)
            top = reference[pos].topk(params.logprobs)
            ours = sorted(((t, e.logprob) for t, e in entry.items() if t in top.indices.tolist()),
                          key=lambda kv: -kv[1])
            assert [t for t, _ in ours] == top.indices.tolist()
            assert [v for _, v in ours] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_repetition_penalty_greedy_equals_transformers_generate(llm, hf):
    for penalty in (1.5, 0.8):
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
        outs = llm.generate(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=penalty,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref


def test_logit_bias_greedy_equals_transformers_sequence_bias(llm, hf):
    """logit_bias is added before the penalties and the argmax, as transformers' sequence
    bias of one-token sequences is, and before its repetition penalty, as there."""
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in PROMPTS:
        plain = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0].token_ids
        bias = {plain[0]: -100.0, plain[3]: -1.5, 7: 2.0, 300: 0.5}
        for extra in ({}, {"repetition_penalty": 1.3}):
            got = llm.generate([prompt], SamplingParams(**greedy, logit_bias=bias, **extra))[0].outputs[0].token_ids
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()},
                              **extra)[0, len(prompt):].tolist()
            assert got == ref
            assert got[0] != plain[0]


def test_logit_bias_rows_keep_to_themselves_in_a_batch(llm):
    biased = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={9: 3.0, 12: -2.0})
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [llm.generate([p], biased if i % 2 else plain)[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)]
    together = llm.generate(PROMPTS, [biased if i % 2 else plain for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in together] == alone


@pytest.mark.parametrize("bias, words", [({-1: 1.0}, "non-negative"), ({5: 100.5}, "[-100, 100]"),
                                         ({5: float("nan")}, "[-100, 100]")])
def test_bad_logit_bias_is_refused(bias, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={10 ** 6: 1.0}))


def test_presence_and_frequency_greedy_equal_a_direct_implementation(llm, hf):
    presence, frequency, steps = 0.7, 0.9, 16
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency)
    outs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    for prompt, out, unpenalized in zip(PROMPTS, outs, plain):
        tokens: list[int] = []
        for _ in range(steps):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].clone()
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=logits.shape[0]).float()
            logits -= frequency * counts + presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
        assert out.outputs[0].token_ids == tokens
    assert any(o.outputs[0].token_ids != u.outputs[0].token_ids for o, u in zip(outs, plain))


@pytest.fixture(scope="module")
def early_eos(tiny_model_factory):
    """A model whose greedy output for PROMPT hits its EOS at step `step`, and that step."""
    prompt = [9, 8, 7, 6]
    base = LLM(str(tiny_model_factory("llama")), chunk_size=16)
    greedy = base.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    step = next(i for i in range(2, 12) if greedy.token_ids[i] not in greedy.token_ids[:i])
    eos = greedy.token_ids[step]
    # Same seed, same weights: only the config's EOS differs.
    return str(tiny_model_factory("llama", eos_token_id=eos)), prompt, eos, step


def test_min_tokens_goes_past_eos_as_transformers_does(early_eos):
    path, prompt, eos, step = early_eos
    llm = LLM(path, chunk_size=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos_ids = sorted(llm.engine.eos_token_ids)
    assert eos in eos_ids

    def reference(**kw):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=eos_ids,
                          pad_token_id=0, **kw)
        return out[0, len(prompt):].tolist()

    # Without min_tokens EOS is the argmax at `step` and ends the request there, as in transformers.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert out.token_ids == reference() and len(out.token_ids) == step + 1
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    for min_tokens in (step + 1, step + 5):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens))[0].outputs[0]
        assert out.token_ids == reference(min_new_tokens=min_tokens)
        assert len(out.token_ids) > min_tokens and not set(out.token_ids[:min_tokens]) & set(eos_ids)
    # A stop token id is held back the same way.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=step + 3, stop_token_ids=[eos])
    out = llm.generate([prompt], params)[0].outputs[0]
    assert eos not in out.token_ids[: step + 3] and len(out.token_ids) > step + 3


def _twice_occurring_stop(tok, token_ids: list[int], text: str):
    """A visible 3-character stop string in text twice, with the token counts at which each
    occurrence is complete: (stop, first start, second start, tokens to complete each)."""
    lengths = [len(tok.decode(token_ids[:n], skip_special_tokens=True)) for n in range(len(token_ids) + 1)]

    def tokens_to(chars: int) -> int:
        return next(n for n, L in enumerate(lengths) if L >= chars)

    for i in range(len(text) - 3):
        stop = text[i:i + 3]
        second = text.find(stop, i + 3)
        if stop.isprintable() and stop.strip() and text.find(stop) == i and second > 0:
            done = (tokens_to(i + 3), tokens_to(second + 3))
            if done[1] - 1 > done[0]:
                return stop, i, second, done
    return None


def test_stop_strings_do_not_end_a_request_before_min_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["the model"], params)[0].outputs[0]
    found = _twice_occurring_stop(llm.tokenizer, full.token_ids, full.text)
    assert found, "need a stop string that occurs twice"
    stop, first, second, (first_done, second_done) = found
    early = llm.generate(["the model"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert early[0].outputs[0].text == full.text[:first] and early[0].outputs[0].finish_reason == "stop"
    # The first occurrence completes before min_tokens, so only the second one stops.
    held = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=second_done - 1)
    out = llm.generate(["the model"], held)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:second]
    assert len(out.token_ids) == second_done


def test_seeded_requests_with_every_feature_ignore_batch_company(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=77, max_tokens=12,
                            ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1,
                            min_tokens=4, logprobs=2)
    alone = llm.generate([[11, 12, 13]], params)[0].outputs[0]
    assert llm.generate([[11, 12, 13]], params)[0].outputs[0].token_ids == alone.token_ids
    noisy = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, frequency_penalty=1.0),
             SamplingParams(temperature=0.0, max_tokens=5, logprobs=1),
             SamplingParams(temperature=1.3, top_p=0.5, max_tokens=14, ignore_eos=True, seed=1)]
    crowd = llm.generate([[1, 2], [11, 12, 13], list(range(30, 70)), [7]], [noisy[0], params, *noisy[1:]])
    assert crowd[1].outputs[0].token_ids == alone.token_ids
    for a, b in zip(crowd[1].outputs[0].logprobs, alone.logprobs):
        assert a.keys() == b.keys()
        assert [e.logprob for e in a.values()] == pytest.approx([e.logprob for e in b.values()], abs=1e-5)


def test_penalties_survive_preemption_and_chunking(path):
    """Counts kept on the device stay right when a sequence is preempted and recomputed."""
    prompts = [[17, 5, 240, 33], list(range(40, 101)), [(i * 37) % 500 + 3 for i in range(150)], [301, 302, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.6,
                            frequency_penalty=0.4, repetition_penalty=1.3)
    roomy = LLM(path, chunk_size=32, num_blocks=256, max_num_batched_tokens=256).generate(prompts, params)
    tight = LLM(path, chunk_size=16, num_blocks=60, max_num_batched_tokens=192, block_size=4).generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in tight) > 0, "the tight cache was meant to force preemption"
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
