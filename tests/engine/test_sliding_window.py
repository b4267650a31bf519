"""Sliding-window attention (Mistral's) against transformers: with a window of 8
tokens, prompts and outputs run far past it, so every prefill chunk, every
chunk with cached context and every decode is masked; greedy output must match
token for token, under every replica scheduler, chunked and preempted."""

import pytest
import transformers

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES
from replica_worker.engine.model import sliding_window_of
from tests.engine.hf_reference import hf_greedy

WINDOW = 8
MAX_NEW = 20
PROMPTS = [
    [17, 5, 240, 33],                            # shorter than the window, output runs past it
    list(range(40, 71)),                         # 31 tokens: chunked, context beyond the window
    [(i * 37) % 500 + 3 for i in range(90)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed_model(tiny_model_factory):
    return str(tiny_model_factory("mistral", sliding_window=WINDOW))


@pytest.fixture(scope="module")
def reference(windowed_model):
    refs = hf_greedy(windowed_model, PROMPTS, MAX_NEW)
    # The window must matter for these prompts, or the test below could not fail.
    full = hf_greedy(windowed_model, PROMPTS, MAX_NEW, sliding_window=None)
    assert refs != full, "the window changes nothing here: pick longer prompts or a smaller window"
    return refs


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("kwargs", [
    dict(chunk_size=6, num_blocks=128, max_num_batched_tokens=128, block_size=4),  # chunks under the window
    dict(chunk_size=32, num_blocks=40, max_num_batched_tokens=128, block_size=4),  # whole prompts; preemption
], ids=["small-chunks", "tight-cache"])
def test_windowed_greedy_equals_transformers(windowed_model, reference, scheduler, kwargs):
    llm = LLM(windowed_model, scheduler=scheduler, **kwargs)
    assert llm.engine.runner.backend.sliding_window == WINDOW
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, GREEDY)]
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref, f"{scheduler}: prompt of {len(prompt)} tokens diverged"
    if kwargs["num_blocks"] * kwargs["block_size"] < sum(len(p) + MAX_NEW for p in PROMPTS) \
            and scheduler in ("sarathi", "vllm", "simple_chunking"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tight cache was meant to force preemption"


def test_window_longer_than_the_context_is_full_attention(windowed_model):
    llm = LLM(windowed_model, max_model_len=WINDOW)
    assert llm.engine.runner.backend.sliding_window is None


def test_which_configs_have_a_window():
    mistral = transformers.MistralConfig(sliding_window=4096)
    assert sliding_window_of(mistral, 32768) == 4096
    assert sliding_window_of(mistral, 4096) is None  # the window never binds
    assert sliding_window_of(transformers.MistralConfig(sliding_window=None), 32768) is None
    qwen_off = transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096, num_hidden_layers=4)
    assert sliding_window_of(qwen_off, 32768) is None
    qwen_mixed = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4096, num_hidden_layers=4,
                                          max_window_layers=2)
    with pytest.raises(ValueError, match="mixes attention kinds"):
        sliding_window_of(qwen_mixed, 32768)

