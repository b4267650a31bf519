"""The sampler on CUDA (skipped without a GPU): no host sync, and the CPU's tokens for the same logits."""

from __future__ import annotations

import pytest
import torch

from replica_worker.engine.sampler import Sampler, SamplingRow
from replica_worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

V = 49152
MIX = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=3),
    SamplingParams(temperature=1.0, min_p=0.05, seed=3),
    SamplingParams(temperature=0.9, seed=4, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[5], logprobs=0),
    SamplingParams(temperature=1.2, top_k=2000, seed=6),
]


def batch(n: int) -> list[SamplingRow]:
    return [SamplingRow(MIX[i % len(MIX)], i % 5, list(range(i, i + 30)), [i % 17] * (i % 5)) for i in range(n)]


def test_the_sampler_never_syncs_the_host():
    logits = torch.randn(256, V, device="cuda") * 3
    sampler = Sampler("cuda", eos_token_ids=[2])
    rows = batch(256)
    sampler(logits.clone(), rows).to_host()  # warm-up: lazy init, penalty slots
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler(logits.clone(), rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(pending.to_host().token_ids) == 256


def test_cuda_draws_the_cpu_tokens_for_the_same_logits():
    # Unseeded rows too: the engine generator's draws are made on the host, the same for both.
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 3
    cpu = Sampler("cpu", eos_token_ids=[2])(logits.clone(), batch(64)).to_host()
    gpu = Sampler("cuda", eos_token_ids=[2])(logits.cuda(), batch(64)).to_host()
    assert cpu.token_ids == gpu.token_ids
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
