"""ModelRunner driven by hand, as the engine would: advance num_computed, append the sampled token."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from replica_worker.engine.config import CacheConfig, EngineConfig, ModelConfig
from replica_worker.engine.kv_cache import bytes_per_block, determine_num_blocks
from replica_worker.engine.model_runner import ModelRunner
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers.base import ScheduledChunk as Chunk
from replica_worker.engine.sequence import Sequence

BLOCK = 4



class HandScheduler:
    """Chunked prefill under a token budget, decodes too; blocks from a shuffled free list."""

    def __init__(self, runner: ModelRunner, budget: int, seed: int = 0) -> None:
        self.runner, self.budget = runner, budget
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)

    def step(self, seqs: list[Sequence]) -> dict[str, int]:
        chunks, left = [], self.budget
        for seq in seqs:
            n = min(seq.num_uncomputed_tokens, left)
            if n <= 0:
                continue
            left -= n
            need = -(-(seq.num_computed_tokens + n) // BLOCK)
            while len(seq.block_ids) < need:
                seq.block_ids.append(self.free.pop())
            chunks.append(Chunk(seq, n))
        # Decodes after prefills, as the real scheduler orders them.
        chunks.sort(key=lambda c: c.num_tokens == 1)
        sampled = iter(self.runner.execute(chunks).token_ids)
        out = {}
        for c in chunks:
            samples = c.samples
            c.seq.num_computed_tokens += c.num_tokens
            if samples:
                token = next(sampled)
                c.seq.append_token(token)
                out[c.seq.seq_id] = token
        return out

    def generate(self, seqs: list[Sequence], max_new: int) -> None:
        while any(s.num_new_output_tokens < max_new for s in seqs):
            self.step([s for s in seqs if s.num_new_output_tokens < max_new])


def make_runner(path, **cache) -> ModelRunner:
    return ModelRunner(EngineConfig(ModelConfig(str(path)), CacheConfig(block_size=BLOCK, num_blocks=cache.pop("num_blocks", 64), **cache)))


@pytest.mark.parametrize("budget", [1000, 9])
def test_greedy_generation_matches_transformers_generate(tiny_model_factory, budget):
    path = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    runner = make_runner(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 30)]
    seqs = [Sequence(f"s{i}", p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    max_new = 10
    HandScheduler(runner, budget).generate(seqs, max_new)
    for prompt, seq in zip(prompts, seqs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt):].tolist()
        assert seq.output_token_ids[: len(ref)] == ref
        if len(ref) < max_new:  # transformers stopped at EOS
            assert ref[-1] == runner.eos_token_id


def test_seeded_sampling_ignores_batch_and_survives_resume(tiny_model_factory):
    path = tiny_model_factory("mistral")
    runner = make_runner(path)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = [5, 9, 44, 101, 7, 300, 12]

    alone = Sequence("a", prompt, params)
    HandScheduler(runner, 1000, seed=1).generate([alone], 8)

    crowd = [Sequence("x", [3, 4, 5] * 5, SamplingParams(temperature=0.8)),
             Sequence("a", prompt, params),
             Sequence("y", [8, 9], SamplingParams(temperature=0.0))]
    HandScheduler(runner, 7, seed=2).generate(crowd, 8)
    assert crowd[1].output_token_ids == alone.output_token_ids

    # Migrated after 3 tokens: the context is recomputed elsewhere, output index continues at 3.
    resumed = Sequence("a", prompt, params, resume_token_ids=alone.output_token_ids[:3])
    HandScheduler(runner, 1000, seed=3).generate([resumed, Sequence("z", [7] * 11, params)], 5)
    assert resumed.output_token_ids == alone.output_token_ids
    assert len(set(alone.output_token_ids)) > 1


def test_runner_properties_and_cache_sizing(tiny_model_factory):
    path = tiny_model_factory("llama3")
    runner = ModelRunner(EngineConfig(ModelConfig(str(path), max_model_len=300), CacheConfig(block_size=8, kv_cache_memory_bytes=1 << 20)))
    per_block = bytes_per_block(2, 8, 2, 16, torch.float32)
    assert runner.bytes_per_block == per_block == 2 * 2 * 8 * 2 * 16 * 4
    assert runner.num_blocks == (1 << 20) // per_block
    assert runner.kv_cache.layers[0].shape == (2, 2, runner.num_blocks, 8, 16)  # the CPU backend's head-major layout
    assert (runner.block_size, runner.max_model_len, runner.vocab_size, runner.eos_token_id) == (8, 300, 512, 2)
    assert make_runner(path).max_model_len == 1024
    assert runner.execute([]).token_ids == []
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(ModelConfig(str(path), max_model_len=5000)))


def test_the_cpu_default_cache_holds_one_whole_length_request():
    """256 MiB, or one request of max_model_len (and a block) when that needs
    more, at most 4 GiB; a budget given is kept as given."""
    cpu, default = torch.device("cpu"), CacheConfig(block_size=16)
    small_blocks = 1 << 10   # 256 MiB holds 262,144 of them: the floor is 256 MiB
    assert determine_num_blocks(default, small_blocks, cpu, max_model_len=8192) == (256 << 20) // (1 << 10)
    big_blocks = 1 << 20     # 256 of them in 256 MiB; 8,192 tokens need 512 and one more
    assert determine_num_blocks(default, big_blocks, cpu, max_model_len=8192) == 513
    assert determine_num_blocks(default, big_blocks, cpu, max_model_len=1 << 20) == 4096   # 4 GiB
    given = CacheConfig(block_size=16, kv_cache_memory_bytes=256 << 20)
    assert determine_num_blocks(given, big_blocks, cpu, max_model_len=8192) == 256


def test_non_sampling_chunks_return_nothing(tiny_model_factory):
    runner = make_runner(tiny_model_factory("llama"))
    seq = Sequence("p", list(range(10, 30)), SamplingParams(temperature=0.0))
    seq.block_ids = [3, 1, 4, 0, 2]
    assert runner.execute([Chunk(seq, 12)]).token_ids == []
    seq.num_computed_tokens = 12
    assert len(runner.execute([Chunk(seq, 8)]).token_ids) == 1
