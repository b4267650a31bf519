"""CUDA-only checks (skipped without a GPU): big dummy shapes and CPU/GPU agreement."""

from __future__ import annotations

import random
import time

import pytest
import torch
import transformers

from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig
from replica_worker.engine.model_runner import ModelRunner
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence
from tests.engine.test_runner import HandScheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _llama31_8b_config(path):
    transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ).save_pretrained(str(path))
    return path


def test_dummy_llama31_8b_shape_on_cuda(tmp_path):
    path = _llama31_8b_config(tmp_path)
    torch.cuda.reset_peak_memory_stats()
    cfg = EngineConfig(
        ModelConfig(str(path), dtype="bfloat16", load_format="dummy", max_model_len=8192),
        CacheConfig(block_size=16, gpu_memory_utilization=0.5), device="cuda",
    )
    runner = ModelRunner(cfg)
    params = list(runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in params)
    kv_bytes = runner.num_blocks * runner.bytes_per_block
    peak = torch.cuda.max_memory_allocated()
    print(f"\nweights {weight_bytes / 2**30:.2f} GiB, kv {kv_bytes / 2**30:.2f} GiB "
          f"({runner.num_blocks} blocks), peak {peak / 2**30:.2f} GiB, eos {runner.eos_token_id}")
    assert 14.5 * 2**30 < weight_bytes < 15.5 * 2**30
    assert peak < weight_bytes + kv_bytes + 4 * 2**30  # never a float32 or CPU-side copy
    assert runner.max_model_len == 8192 and runner.eos_token_id == [128001, 128008, 128009]

    rng = random.Random(0)
    seqs = [Sequence(f"s{i}", [rng.randrange(128000) for _ in range(n)], SamplingParams(temperature=t, seed=i))
            for i, (n, t) in enumerate([(700, 0.0), (40, 1.0), (1, 0.7), (300, 0.0)])]
    sched = HandScheduler(runner, budget=512)
    sched.step(seqs)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    steps = 0
    while any(s.num_new_output_tokens < 8 for s in seqs):
        sched.step([s for s in seqs if s.num_new_output_tokens < 8])
        steps += 1
    print(f"{steps} steps in {time.perf_counter() - start:.3f} s")
    for s in seqs:
        assert len(s.output_token_ids) >= 8 and all(0 <= t < 128256 for t in s.output_token_ids)


def test_cuda_greedy_equals_cpu(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    outs = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(EngineConfig(ModelConfig(str(path)), CacheConfig(block_size=4, num_blocks=64), device=device))
        seqs = [Sequence(f"s{n}", list(range(3, 3 + n)), SamplingParams(temperature=0.0)) for n in (4, 19, 33)]
        HandScheduler(runner, 11).generate(seqs, 8)
        outs.append([s.output_token_ids for s in seqs])
    assert outs[0] == outs[1]
