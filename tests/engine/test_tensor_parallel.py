"""Tensor parallelism on the CPU: this process is rank 0, a second process is rank 1,
joined by gloo. Greedy output must equal transformers' token for token, with prompts
chunked over many steps, preemption, every scheduler and prefix-cache hits (the block
manager lives on rank 0 alone; rank 1 writes its heads' KV at the same block ids)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
import transformers

from replica_worker import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 12
PROMPTS = [
    [17, 5, 240, 33],
    list(range(40, 101)),
    [(i * 37) % 500 + 3 for i in range(90)],
    [301, 302, 9, 9, 9, 77, 12],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Chunks of 16 tokens, and too few blocks of 4 for all four requests at once.
TIGHT = dict(chunk_size=16, num_blocks=28, block_size=4, max_num_batched_tokens=128)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def tp_llm(path, **kwargs):
    llm = LLM(str(path), tensor_parallel_size=2, **kwargs)
    pids = llm.engine.tensor_parallel.follower_pids
    try:
        yield llm
    finally:
        llm.shutdown()
    assert all(_gone(p) for p in pids), "rank 1 outlived shutdown()"
    assert not dist.is_initialized()


def check_greedy(llm, path, prompts=PROMPTS):
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(path), prompts, MAX_NEW)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    return outs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_equals_transformers_chunked_preempted_and_cached(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    with tp_llm(path, **TIGHT) as llm:
        outs = check_greedy(llm, path)
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tight cache was meant to preempt"
        # A later prompt that shares a prefix with an earlier one starts past its cached blocks.
        first = [(i * 11) % 400 + 7 for i in range(50)]
        check_greedy(llm, path, [first])
        again = check_greedy(llm, path, [first[:40] + [5, 6, 7]])
        assert again[0].num_cached_tokens == 40
        assert llm.engine.prefix_cache_stats().hits >= 40


@pytest.mark.parametrize("scheduler", ["vllm", "orca", "faster_transformer", "simple_chunking"])
def test_every_scheduler_gives_the_same_tokens(tiny_model_factory, scheduler):
    path = tiny_model_factory("llama")
    with tp_llm(path, scheduler=scheduler, **TIGHT) as llm:
        check_greedy(llm, path)


def test_tied_embeddings_replicated_kv_head_and_odd_vocabulary(tiny_model_factory):
    # One kv head for two ranks (both hold it), 511 tokens (padded to 2 x 256), tied head.
    path = tiny_model_factory("llama", vocab_size=511, tie_word_embeddings=True, num_key_value_heads=1)
    assert transformers.AutoConfig.from_pretrained(str(path)).vocab_size % 2 == 1
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, max_tokens=MAX_NEW, ignore_eos=True)
              for s in range(len(PROMPTS))]
    single = [o.outputs[0].token_ids for o in LLM(str(path), chunk_size=16).generate(PROMPTS, seeded)]
    with tp_llm(path, chunk_size=16) as llm:
        check_greedy(llm, path)
        # Rank 0 samples alone, from the gathered logits: a seeded request draws what it
        # draws on one rank.
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)] == single


def _dummy_config(tmp_path, **overrides):
    cfg = dict(vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    transformers.LlamaConfig(**{**cfg, **overrides}).save_pretrained(str(tmp_path))
    return tmp_path


def test_dummy_weights_are_the_same_model_at_any_size(tmp_path):
    path = _dummy_config(tmp_path)
    kwargs = dict(load_format="dummy", chunk_size=32)
    single = [o.outputs[0].token_ids for o in LLM(str(path), **kwargs).generate(PROMPTS[:3], GREEDY)]
    with tp_llm(path, **kwargs) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == single


def _fp8_at_two_ranks(path):
    """transformers computing what a 2-rank fp8 engine computes: the scheme
    (fp8.emulate_in_transformers) on every projection, except that o_proj and
    down_proj, split by input features, quantize each half of their weight rows
    and of their inputs on its own, and sum the two products (the all-reduce)."""
    import torch
    import torch.nn.functional as F

    from replica_worker.engine.model.fp8 import emulate_in_transformers, quantize_rows

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    split = {}
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj"):
            k = module.weight.shape[1] // 2
            halves = [quantize_rows(module.weight.detach()[:, r * k:(r + 1) * k]) for r in range(2)]
            split[name] = (module, k, [q.float() * sc for q, sc in halves])
    emulate_in_transformers(hf)
    for module, k, weights in split.values():
        module._forward_pre_hooks.clear()

        def forward(x, k=k, weights=weights):
            out = None
            for r in range(2):
                q, sc = quantize_rows(x[..., r * k:(r + 1) * k].reshape(-1, k))
                y = F.linear((q.float() * sc).reshape(*x.shape[:-1], k), weights[r])
                out = y if out is None else out + y
            return out

        module.forward = forward
    return hf


def test_fp8_weights_on_every_rank(tiny_model_factory):
    # Token-exact against the 2-rank scheme: it holds only if rank 1 quantized its
    # shards too (a row-parallel shard's scales cover its slice of the inputs).
    from tests.engine.hf_reference import greedy_of

    path = tiny_model_factory("llama3")
    reference = greedy_of(_fp8_at_two_ranks(path), PROMPTS, MAX_NEW)
    with tp_llm(path, quantization="fp8", **TIGHT) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert not hasattr(llm.engine.runner.model.layers[0].mlp.down_proj, "weight")


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(tmp_path):
    path = _dummy_config(tmp_path, num_attention_heads=6, num_key_value_heads=3, head_dim=16, hidden_size=96)
    with pytest.raises(ValueError, match="num_key_value_heads 3 is not divisible by tensor_parallel_size 2"):
        LLM(str(path), load_format="dummy", tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_a_failed_step_ends_the_other_ranks_and_later_steps_say_why(tiny_model, monkeypatch):
    with tp_llm(tiny_model) as llm:
        pids = llm.engine.tensor_parallel.follower_pids

        def fail(batch, rows, previous=None):  # after the batch went out: rank 1 is left inside the step
            raise RuntimeError("boom on rank 0")

        monkeypatch.setattr(llm.engine.runner, "run_batch", fail)
        with pytest.raises(RuntimeError, match="boom on rank 0"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert all(_gone(p) for p in pids)
        with pytest.raises(RuntimeError, match="ranks are stopped: a step failed on rank 0"):
            llm.generate([[5, 6, 7]], GREEDY)


def test_one_rank_never_touches_torch_distributed(tiny_model):
    code = (
        "import sys, torch.distributed as dist\n"
        "from replica_worker import LLM, SamplingParams\n"
        f"LLM({str(tiny_model)!r}).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))\n"
        "assert not dist.is_initialized()\n"
        "loaded = [m for m in sys.modules if m.startswith('replica_worker.engine.distributed.')]\n"
        "assert loaded == ['replica_worker.engine.distributed.group'], loaded\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
