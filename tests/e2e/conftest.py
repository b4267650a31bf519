import pytest
import torch

from tests.support.live_stack import LiveStack


@pytest.fixture(scope="session")
def e2e_model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="session")
def hf_reference(e2e_model):
    """Greedy continuation by transformers, cached per (prompt, length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(e2e_model, dtype=torch.float32)
    cache: dict = {}

    def reference(prompt_ids: list[int], max_new: int) -> list[int]:
        key = (tuple(prompt_ids), max_new)
        if key not in cache:
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return reference


@pytest.fixture
def live_stack(tmp_path, redis_url, e2e_model):
    stacks = []

    def make(policy: str = "pull", router_args=()) -> LiveStack:
        stack = LiveStack(tmp_path, redis_url, e2e_model, policy, tuple(router_args))
        stacks.append(stack)
        stack.start_router()
        return stack

    yield make
    for stack in stacks:
        stack.stop()
