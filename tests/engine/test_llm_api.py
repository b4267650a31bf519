"""LLM.generate and LLM.chat in vLLM's shape: RequestOutput, n completions, prompt encoding."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from common.tokenizer import encode_prompt, load_tokenizer
from replica_worker import LLM, SamplingParams
from replica_worker.engine.errors import InvalidRequestError

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), chunk_size=16, num_blocks=128)


def _folder_with_tokenizer(src, dst, change) -> str:
    """A copy of the model folder whose tokenizer `change` altered."""
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)  # not load_tokenizer's shared one
    change(tok)
    tok.save_pretrained(str(dst))
    return str(dst)


def test_request_output_shape(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    text_out, ids_out = llm.generate(["the model", [5, 6, 7]], params)
    assert text_out.prompt == "the model" and ids_out.prompt is None
    assert text_out.prompt_token_ids == encode_prompt(llm.tokenizer, "the model")
    assert ids_out.prompt_token_ids == [5, 6, 7]
    assert text_out.request_id != ids_out.request_id
    for out in (text_out, ids_out):
        assert out.finished and out.num_cached_tokens == 0 and len(out.outputs) == 1
        (c,) = out.outputs
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == 5
        for token, entry in zip(c.token_ids, c.logprobs):
            assert token in entry and len(entry) in (2, 3)
            # greedy: the sampled token is the most likely, rank 1 (vLLM's Logprob shape)
            assert max(e.logprob for e in entry.values()) == entry[token].logprob
            assert entry[token].rank == 1 and sorted(e.rank for e in entry.values()) == [1, 2]
            assert entry[token].decoded_token == llm.tokenizer.decode([token])
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        assert out.metrics is c.metrics and c.metrics.time_to_first_token is not None
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert plain.token_ids == ids_out.outputs[0].token_ids


def test_n_completions_share_the_prompt_and_are_reproducible(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    first, again = (llm.generate([[11, 12, 13]], params)[0] for _ in range(2))
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    runs = [c.token_ids for c in first.outputs]
    assert runs == [c.token_ids for c in again.outputs]
    assert len({tuple(r) for r in runs}) == 4
    # Completion 0 keeps the seed: it is what n = 1 gives.
    single = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert llm.generate([[11, 12, 13]], single)[0].outputs[0].token_ids == runs[0]
    unseeded = llm.generate([[11, 12, 13], [4]], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert [len(r.outputs) for r in unseeded] == [2, 2]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_engine_runs_one_sequence_per_request(llm):
    with pytest.raises(InvalidRequestError, match="one sequence per request"):
        llm.engine.add_request("n2", [1, 2, 3], SamplingParams(n=2))
    assert not llm.engine.has_unfinished()


def test_chat_renders_the_template_and_generates(tiny_model, tmp_path):
    path = _folder_with_tokenizer(tiny_model, tmp_path / "chat", lambda t: setattr(t, "chat_template", CHAT_TEMPLATE))
    llm = LLM(path, chunk_size=16)
    tok = llm.tokenizer
    conversation = [{"role": "user", "content": "the model"}, {"role": "assistant", "content": "café"},
                    {"role": "user", "content": "river"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.chat(conversation, params)
    rendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and rendered.startswith("<s><user> the model") and rendered.endswith("<assistant> ")
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate([out.prompt_token_ids], params)[0].outputs[0].token_ids
    both = llm.chat([conversation, conversation[:1]], params)
    assert [o.prompt for o in both] == [rendered, tok.apply_chat_template(conversation[:1], tokenize=False,
                                                                         add_generation_prompt=True)]


def test_chat_without_a_template_says_so(tiny_model, tmp_path):
    def drop_template(tok):
        tok.chat_template = None

    path = _folder_with_tokenizer(tiny_model, tmp_path / "plain", drop_template)
    for leftover in Path(path).glob("chat_template*"):
        leftover.unlink()
    with pytest.raises(ValueError, match="no chat template"):
        LLM(path, chunk_size=16).chat([{"role": "user", "content": "hi"}])


def test_offline_and_router_encoding_agree_on_bos(tiny_model, tmp_path):
    def add_bos(tok):
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])

    path = _folder_with_tokenizer(tiny_model, tmp_path / "bos", add_bos)
    llm = LLM(path, chunk_size=16)
    tok = load_tokenizer(path)
    ids = llm.generate(["the model"], SamplingParams(temperature=0.0, max_tokens=1))[0].prompt_token_ids
    assert ids == encode_prompt(tok, "the model") == tok.encode("the model")
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("the model", add_special_tokens=False)


def test_no_sampling_params_means_the_models_generation_config(tiny_model, tmp_path, llm):
    """As vLLM's LLM: generate with no SamplingParams uses the model's own sampling
    defaults (here temperature 0: greedy) over SamplingParams' defaults."""
    import json

    folder = tmp_path / "greedy_by_default"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    tuned = LLM(str(folder), chunk_size=16, num_blocks=128)
    assert tuned.get_default_sampling_params().temperature == 0.0
    assert llm.get_default_sampling_params() == SamplingParams()   # the tiny model sets none
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0))[0].outputs[0].token_ids
    assert tuned.generate([[5, 6, 7]])[0].outputs[0].token_ids == greedy


@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "logit_bias"])
def test_none_is_none_given_as_vllm_defaults_it(field):
    """Code written for vLLM passes e.g. stop=request.stop, which may be None."""
    assert getattr(SamplingParams(**{field: None}), field) == ()
