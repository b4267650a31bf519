"""The engine against transformers: token-for-token greedy equality under every
replica scheduler, with prompts chunked over many steps and caches small
enough to force preemption by recompute."""

import pytest

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 24
# Mixed lengths: short, medium, and one long enough to be chunked many times.
PROMPTS = [
    [17, 5, 240, 33],
    list(range(40, 101)),
    [(i * 37) % 500 + 3 for i in range(150)],
    [301, 302, 9, 9, 9, 77, 12],
]


@pytest.fixture(scope="module", params=["llama", "llama3", "mistral", "qwen2"])
def arch_model(request, tiny_model_factory):
    return request.param, str(tiny_model_factory(request.param))


@pytest.fixture(scope="module")
def reference(arch_model):
    return hf_greedy(arch_model[1], PROMPTS, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

# (scheduler kwargs, expect preemption): chunk sizes that split the long prompt
# over many steps; a cache too small for all requests at once.
CONFIGS = {
    "roomy": (dict(chunk_size=32, num_blocks=256, max_num_batched_tokens=256), False),
    "tight": (dict(chunk_size=16, num_blocks=60, max_num_batched_tokens=192, block_size=4), True),
}


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_equals_transformers(arch_model, reference, scheduler, config_name):
    _, path = arch_model
    kwargs, expect_preemption = CONFIGS[config_name]
    llm = LLM(path, scheduler=scheduler, **kwargs)
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, GREEDY)]
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref, f"{scheduler}: prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    if expect_preemption and scheduler in ("sarathi", "vllm", "simple_chunking"):
        assert preemptions > 0, "the tight cache was meant to force preemption"


def test_text_matches_tokens(tiny_model):
    from common.tokenizer import load_tokenizer

    llm = LLM(str(tiny_model), chunk_size=8)
    tok = load_tokenizer(str(tiny_model))
    outs = [r.outputs[0] for r in llm.generate(["Zürich café 東京", "the model"], GREEDY)]
    for out in outs:
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
