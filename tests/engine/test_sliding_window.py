"""Sliding-window attention (Mistral's) against transformers: with a window of 8
tokens, prompts and outputs run far past it, so every prefill chunk, every
chunk with cached context and every decode is masked; greedy output must match
token for token, under every replica scheduler, chunked and preempted."""

import pytest
import transformers

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.config import CacheConfig, SchedulerConfig
from replica_worker.engine.schedulers import make_scheduler
from replica_worker.engine.sequence import Sequence
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
    dict(chunk_size=32, num_blocks=30, max_num_batched_tokens=128, block_size=4),  # whole prompts, a tight cache
], ids=["small-chunks", "tight-cache"])
def test_windowed_greedy_equals_transformers(windowed_model, reference, scheduler, kwargs):
    llm = LLM(windowed_model, scheduler=scheduler, **kwargs)
    assert llm.engine.runner.backend.sliding_window == WINDOW
    outs = [r.outputs[0] for r in llm.generate(PROMPTS, GREEDY)]
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref, f"{scheduler}: prompt of {len(prompt)} tokens diverged"
    _all_blocks_back(llm)


def _all_blocks_back(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "blocks still held after every request finished"


# Six short prompts growing together in blocks longer than the window: each grows
# by a block before it can give one back, so a cache of 8 blocks preempts.
GROWING = [[(i * 31 + k * 7) % 500 + 3 for i in range(10 + k)] for k in range(6)]
GROWING_NEW = 24
# Four prompts whose outputs run far past the window.
LONG = [[(i * 13 + k) % 500 + 3 for i in range(20)] for k in range(4)]
LONG_NEW = 64


@pytest.fixture(scope="module")
def growing_reference(windowed_model):
    refs = hf_greedy(windowed_model, GROWING, GROWING_NEW)
    assert refs != hf_greedy(windowed_model, GROWING, GROWING_NEW, sliding_window=None)
    return refs


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_windowed_preemption_equals_transformers(windowed_model, growing_reference, scheduler):
    """Preempted mid-run, its given-back blocks cached or evicted meanwhile, a
    sequence recomputes and still matches transformers."""
    llm = LLM(windowed_model, scheduler=scheduler, chunk_size=32, num_blocks=9,
              max_num_batched_tokens=128, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=GROWING_NEW, ignore_eos=True)
    outs = [r.outputs[0] for r in llm.generate(GROWING, params)]
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tiny cache was meant to force preemption"
    assert [o.token_ids for o in outs] == growing_reference
    _all_blocks_back(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_a_long_windowed_sequence_holds_about_a_window_of_blocks(windowed_model, prefix_caching):
    """Far past the window, a sequence holds the blocks its next queries can see
    (the window, the block the window starts in, the block being written), not
    its whole context; four such sequences run at once in a cache that could
    not hold them whole side by side."""
    block = 4
    llm = LLM(windowed_model, chunk_size=16, num_blocks=48, block_size=block,
              enable_prefix_caching=prefix_caching)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=LONG_NEW, ignore_eos=True)
    for k, prompt in enumerate(LONG):
        engine.add_request(f"r{k}", prompt, params)
    assert len(LONG) * bm.blocks_needed(len(LONG[0]) + LONG_NEW) > bm.num_total_blocks
    most_held = most_running = 0
    while engine.has_unfinished():
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        for seq in engine.scheduler.running:
            most_held = max(most_held, bm.num_held_blocks(seq))
    assert most_running == len(LONG)
    # A chunk may start at most one block past the window, and async steps keep one more.
    assert most_held <= WINDOW // block + 3, most_held
    assert engine.scheduler.running == [] and bm.num_free_blocks == bm.num_total_blocks
    if prefix_caching:  # run again, from what the first run left cached, against transformers
        got = [r.outputs[0].token_ids for r in llm.generate(LONG, params)]
        assert got == hf_greedy(windowed_model, LONG, LONG_NEW)


# Prompts longer than the whole cache of the test below (120 tokens against 60
# usable slots): taken chunk by chunk, each holds about its window's blocks.
VERY_LONG = [[(i * 29 + k * 3) % 500 + 3 for i in range(120)] for k in range(3)]
VERY_LONG_NEW = 12


@pytest.fixture(scope="module")
def very_long_reference(windowed_model):
    return hf_greedy(windowed_model, VERY_LONG, VERY_LONG_NEW)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("scheduler", ["sarathi", "simple_chunking"])
def test_a_windowed_prompt_longer_than_the_cache_runs_chunk_by_chunk(windowed_model, very_long_reference,
                                                                    scheduler, prefix_caching):
    """A chunking scheduler admits a windowed prompt with its first chunk's blocks
    and appends each later chunk's, while the blocks behind the window go back:
    three prompts, each longer than the cache, run (side by side as far as blocks
    allow, preempting the latest arrival otherwise), token-exact, each holding at
    most the window's bound (BlockManager.peak_blocks) at any step."""
    block, chunk = 4, 6
    llm = LLM(windowed_model, scheduler=scheduler, chunk_size=chunk, num_blocks=16, block_size=block,
              max_num_batched_tokens=128, enable_prefix_caching=prefix_caching)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    assert bm.blocks_needed(len(VERY_LONG[0])) > bm.num_total_blocks
    params = SamplingParams(temperature=0.0, max_tokens=VERY_LONG_NEW, ignore_eos=True)
    outs = [r.outputs[0] for r in llm.generate(VERY_LONG, params)]
    assert [o.token_ids for o in outs] == very_long_reference
    _all_blocks_back(llm)
    for k, prompt in enumerate(VERY_LONG):
        engine.add_request(f"again{k}", prompt, params)
    most_held = 0
    while engine.has_unfinished():
        engine.step()
        most_held = max([most_held] + [bm.num_held_blocks(s) for s in engine.scheduler.running])
    assert most_held <= bm.peak_blocks(len(VERY_LONG[0]) + VERY_LONG_NEW, 2 * chunk), most_held
    _all_blocks_back(llm)


def test_a_prompt_that_must_be_held_whole_still_needs_the_cache_to_hold_it(windowed_model):
    """vllm computes a prompt in one step, so its blocks are needed at once: a
    windowed prompt longer than the cache is refused there as before."""
    llm = LLM(windowed_model, scheduler="vllm", num_blocks=16, block_size=4, max_num_batched_tokens=128)
    with pytest.raises(InvalidRequestError, match="can never fit"):
        llm.generate(VERY_LONG[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def test_a_windowed_prefill_short_of_blocks_preempts_a_later_arrival():
    """The scheduler alone: a growing prompt whose next chunk finds no free block
    takes them from the latest arrival not yet in the step (recomputed later)."""
    sched = make_scheduler(SchedulerConfig(name="sarathi", chunk_size=8, max_num_batched_tokens=128, max_num_seqs=8),
                           CacheConfig(block_size=4, watermark=0.0, enable_prefix_caching=False),
                           num_blocks=10, max_model_len=256, sliding_window=16)
    bm = sched.block_manager
    a, b = (Sequence(name, [3] * 40, SamplingParams(max_tokens=8)) for name in ("a", "b"))
    sched.add_seq(a)
    sched.add_seq(b)
    first = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in first.chunks] == [(a, 8)]
    a.num_computed_tokens += 8
    # b, the later arrival, admitted by hand mid-prompt and holding every free block.
    sched.waiting.remove(b)
    bm.allocate(b, first_chunk=8)
    bm.append(b, (len(b.block_ids) + bm.num_free_blocks) * bm.block_size)
    sched.running.append(b)
    assert bm.num_free_blocks == 0
    out = sched.schedule()
    assert out.preempted == [b] and sched.waiting == [b] and not bm.is_allocated(b)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 8)]


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


@pytest.mark.parametrize("scheduler", ["sarathi", "simple_chunking"])   # those that chunk a prompt
def test_a_follow_up_turn_whose_cached_chain_passes_the_window_runs(windowed_model, scheduler):
    """A conversation's next turn finds its previous prompt and answer cached,
    a chain far longer than the window in a small cache. Only the blocks its
    first chunk can see are taken back (the rest name the null block): it runs,
    equal to transformers' windowed greedy output, and does not hold the queue
    behind it (an unrelated request finishes too)."""
    llm = LLM(windowed_model, scheduler=scheduler, num_blocks=12, block_size=4, chunk_size=8,
              async_scheduling=False, max_model_len=128)
    first = list(range(10, 50))
    answer = llm.generate([first], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    follow_up = first + answer.outputs[0].token_ids + list(range(60, 66))
    outs = llm.generate([follow_up, [5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert outs[0].num_cached_tokens > WINDOW
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(windowed_model, [follow_up, [5, 6, 7]], 4)
    _all_blocks_back(llm)
