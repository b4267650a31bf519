"""EngineCore behaviour a worker relies on: stop conditions, aborts, seeds, bad input."""

import pytest

from replica_worker import LLM, SamplingParams
from replica_worker.engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), chunk_size=16, num_blocks=64)


def free_all(engine):
    bm = engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_total_blocks


def test_stop_token_id_finishes_with_that_token(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_at = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: first + 1]
    # The stop token's id is in the output, its text is not (vLLM's default).
    tok = llm.tokenizer
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_stop_string_truncates_text(llm):
    greedy = llm.generate(["the model"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = llm.generate(["the model"], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_model_factory):
    # A model whose greedy output quickly hits EOS: make EOS the first greedy token.
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, chunk_size=16)
    first = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    llm.engine.eos_token_ids = frozenset({first})
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", list(range(10, 60)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(8):
        engine.step()
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    while engine.has_unfinished():
        engine.step()
    assert free_all(engine)


def test_seeded_sampling_ignores_batch_company(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], params)[0].outputs[0].token_ids
    noisy = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)] * 3
    crowd = llm.generate([[1, 2], [11, 12, 13], list(range(30, 70)), [7]], [noisy[0], params, *noisy[1:]])
    assert crowd[1].outputs[0].token_ids == alone


def test_resumed_request_continues_the_same_tokens(llm):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    full = llm.generate([[21, 22, 23, 24]], params)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r", [21, 22, 23, 24], params, resume_token_ids=full[:6])
    got, offsets = [], []
    while engine.has_unfinished():
        for d in engine.step().deltas:
            got.extend(d.new_token_ids)
            offsets.append(d.output_offset)
    assert got == full[6:]
    assert offsets[0] == 6


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    (list(range(1, 1025)), SamplingParams(), "model allows"),
    ([1, 2, 512], SamplingParams(), "outside the vocabulary"),
    ([1, 2, -1], SamplingParams(), "outside the vocabulary"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n must be"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens .9. must be at most max_tokens .8."),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(seed=1 << 64), "seed"),
    (dict(seed=-(1 << 63) - 1), "seed"),
])
def test_bad_sampling_values(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_negative_seed_is_its_unsigned_form():
    """A signed 64-bit seed, as vLLM accepts it, draws as the same bits unsigned."""
    assert SamplingParams(seed=-1).seed == (1 << 64) - 1
    assert SamplingParams(seed=-(1 << 63)).seed == 1 << 63


def test_request_that_can_never_fit_is_rejected(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=4, block_size=16)  # 64 tokens of cache in all
    with pytest.raises(InvalidRequestError, match="never fit"):
        llm.engine.add_request("big", list(range(3, 60)), SamplingParams(max_tokens=20))
    out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8


def test_stop_string_spanning_the_resume_boundary(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["the model"], params)[0].outputs[0]
    tok = llm.engine.tokenizer
    prompt = llm._encode("the model")
    for k in range(3, 20):
        head = tok.decode(full.token_ids[:k], skip_special_tokens=True)
        stop = full.text[len(head) - 2: len(head) + 2]
        if len(head) >= 2 and len(stop) == 4 and full.text.index(stop) == len(head) - 2:
            break
    else:
        pytest.skip("no visible stop string across a token boundary")
    # The earlier replica held back the stop string's first two characters.
    engine = llm.engine
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       resume_token_ids=full.token_ids[:k], resume_text_len=len(head) - 2)
    text, finish = "", None
    while engine.has_unfinished():
        for d in engine.step().deltas:
            text += d.text
            finish = d.finish_reason or finish
    assert finish == "stop"
    assert head[: len(head) - 2] + text == full.text[: full.text.index(stop)]
