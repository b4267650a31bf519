"""Async scheduling on CUDA (skipped without it): on by default there, and with
flashinfer and CUDA graphs its tokens equal the synchronous engine's, greedy and
seeded, the graphs' input ids filled on the device from the step in flight."""

from __future__ import annotations

import pytest
import torch

from replica_worker import LLM, SamplingParams
from replica_worker.engine.attention.flashinfer_backend import flashinfer_importable
from tests.engine.test_async_scheduling import _count_filled_launches
from tests.engine.test_flashinfer_cuda import ENGINE, PROMPTS, TINY

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not flashinfer_importable(), reason="needs flashinfer"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from common.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny128"), "llama3", **TINY))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
])
def test_graphs_give_the_synchronous_tokens(model_dir, params):
    # All prompts arrive at once and stop at the same length, so both engines run
    # the same batches (bf16 logits depend on the batch shape).
    sync = LLM(model_dir, device="cuda", dtype="bfloat16", async_scheduling=False, **ENGINE)
    overlapped = LLM(model_dir, device="cuda", dtype="bfloat16", **ENGINE)
    assert overlapped.engine.async_scheduling and not sync.engine.async_scheduling
    filled = _count_filled_launches(overlapped)
    expected = [o.outputs[0] for o in sync.generate(PROMPTS, params)]
    got = [o.outputs[0] for o in overlapped.generate(PROMPTS, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert overlapped.engine.runner.graphs.replays > 0 and filled[0] > 0
    if params.logprobs:
        for a, b in zip(got, expected):
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
