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
