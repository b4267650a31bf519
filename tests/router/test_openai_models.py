"""The OpenAI bodies' translation to RequestSpecs where it differs from the
gRPC API's meaning: vLLM's priority (lower first) and signed seeds."""

from router.frontends.openai_models import ChatCompletionRequest, CompletionRequest


def test_priority_is_served_lower_first_as_in_vllm():
    urgent = CompletionRequest(prompt="x", priority=-3).specs("")[0]
    late = CompletionRequest(prompt="x", priority=5).specs("")[0]
    assert urgent.priority == 3 > late.priority == -5   # the queue serves higher spec priority first


def test_a_negative_seed_is_the_same_unsigned_seed():
    assert CompletionRequest(prompt="x", seed=-1).specs("")[0].sampling.seed == 2 ** 64 - 1
    assert CompletionRequest(prompt="x", seed=7).specs("")[0].sampling.seed == 7


def test_text_parts_are_joined_with_newlines():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}])
    assert body.rendered_messages()[0]["content"] == "hello\nworld"


def test_unset_sampling_fields_take_the_models_generation_config(tiny_model, tmp_path):
    """As vLLM's OpenAI server: generation_config.json's sampling values fill the
    fields a body leaves unset; what the body sets wins; none turns it off."""
    import json
    import shutil

    from common.generation_config import sampling_defaults
    from router.frontends.openai_http import model_sampling_defaults
    from router.validation import ModelLimits
    from tests.support.router_harness import make_config

    folder = tmp_path / "tuned"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.9}
    limits = ModelLimits(max_model_len=1024, vocab_size=512)
    defaults = model_sampling_defaults(make_config("redis://unused", folder), limits)
    assert defaults == {"temperature": 0.6, "top_p": 0.9}
    unset = CompletionRequest(prompt="x").specs("", defaults)[0].sampling
    assert (unset.temperature, unset.top_p) == (0.6, 0.9)
    chosen = CompletionRequest(prompt="x", temperature=0.0).specs("", defaults)[0].sampling
    assert (chosen.temperature, chosen.top_p) == (0.0, 0.9)
    assert model_sampling_defaults(make_config("redis://unused", folder, generation_config="none"),
                                   limits) == {}
    config.update(temperature=-1)   # a value every request would be refused for: not used
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert model_sampling_defaults(make_config("redis://unused", folder), limits) == {}
