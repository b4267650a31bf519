"""Tensor parallelism on two GPUs (skipped with fewer): NCCL between cuda:0 and cuda:1.

float32 runs the torch backend eagerly (no float32 flashinfer kernels) and must equal
transformers token for token, prefix-cache hits included; bfloat16 runs flashinfer with
the decode CUDA graphs, whose captured all-reduces and all-gather must agree with the
eager run and with float32.
"""

from __future__ import annotations

import pytest
import torch

from replica_worker import LLM
from tests.engine.hf_reference import prefix_agreement
from tests.engine.test_flashinfer_cuda import (  # noqa: F401 (fixtures)
    ENGINE,
    GREEDY,
    PROMPTS,
    model_dir,
    needs_flashinfer,
    reference,
)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _generate(model_dir, dtype, prompts=PROMPTS, **kw):
    llm = LLM(model_dir, device="cuda", dtype=dtype, tensor_parallel_size=2, **{**ENGINE, **kw})
    try:
        outs = llm.generate(prompts, GREEDY)
        return [o.outputs[0].token_ids for o in outs], outs, llm.engine.runner.graphs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_float32_two_gpus_equal_transformers(model_dir, reference, scheduler):
    tokens, _, _ = _generate(model_dir, "float32", scheduler=scheduler)
    assert tokens == reference


def test_float32_two_gpus_prefix_hits_equal_transformers(model_dir, reference):
    shared = [PROMPTS[2], PROMPTS[2][:100] + [9, 8, 7]]
    tokens, outs, _ = _generate(model_dir, "float32", prompts=shared, max_num_seqs=1)
    assert tokens[0] == reference[2]
    assert outs[1].num_cached_tokens >= 96
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    out = hf.generate(torch.tensor([shared[1]], device="cuda"), max_new_tokens=len(tokens[1]), do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert tokens[1] == out[0, len(shared[1]):].tolist()


@needs_flashinfer
def test_bfloat16_two_gpus_graphs_agree_with_eager_and_float32(model_dir, reference):
    graphed, _, graphs = _generate(model_dir, "bfloat16")
    assert graphs is not None and graphs.replays > 0, "decode steps should replay the captured graphs"
    eager, _, _ = _generate(model_dir, "bfloat16", enable_cuda_graphs=False)
    # Two ranks' all-reduce is a + b whatever NCCL's algorithm: graphs and eager should agree.
    assert prefix_agreement(graphed, eager) >= 0.9
    assert prefix_agreement(graphed, reference) >= 0.5
