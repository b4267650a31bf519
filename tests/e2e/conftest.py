import pytest
import torch

from tests.support.live_stack import LiveStack, RouterTier


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
def started_stacks():
    """Stops, at the end of the test, every stack given to it."""
    stacks = []

    def started(stack):
        stacks.append(stack)
        stack.start_router()
        return stack

    yield started
    for stack in stacks:
        stack.stop()


@pytest.fixture
def live_stack(tmp_path, redis_url, e2e_model, started_stacks):
    def make(policy: str = "pull", router_args=()) -> LiveStack:
        return started_stacks(LiveStack(tmp_path, redis_url, e2e_model, policy, tuple(router_args)))

    return make


@pytest.fixture
def router_tier(tmp_path, redis_url, e2e_model, started_stacks):
    """router_tier(count, policy, router_args): that many routers on one Redis, started."""

    def make(count: int, policy: str = "pull", router_args=()) -> RouterTier:
        return started_stacks(RouterTier(tmp_path, redis_url, e2e_model, count, policy,
                                         tuple(router_args)))

    return make
