"""quantization="fp8" on CUDA (skipped without a GPU of compute capability 8.9+):
`_scaled_mm` against the float32 emulation the CPU tests check the engine
with, and the fp8 engine (flashinfer, CUDA graphs, bf16) against its own eager
run."""

from __future__ import annotations

import pytest
import torch

from replica_worker import LLM, SamplingParams
from replica_worker.engine.attention.flashinfer_backend import flashinfer_importable
from replica_worker.engine.model.fp8 import Fp8Weight, quantize_rows
from tests.engine.hf_reference import prefix_agreement

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability 8.9+")

PROMPTS = [[17, 5, 240, 33], list(range(40, 101)), [(i * 37) % 500 + 3 for i in range(150)], [7]]
TINY = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(chunk_size=32, num_blocks=256, max_num_batched_tokens=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from common.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny128fp8"), "llama3", **TINY))


@pytest.mark.parametrize("rows", [1, 7, 64, 128, 129, 300])   # both sides of TENSORWISE_MAX_TOKENS
def test_scaled_mm_equals_the_emulated_product(rows):
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(768, 512, device="cuda", generator=g).to(dtype)
    x = torch.randn(rows, 512, device="cuda", generator=g).to(dtype)
    bias = torch.randn(768, device="cuda", generator=g).to(dtype)
    layer = Fp8Weight(w)
    got = layer.linear(x, bias, dtype).float()
    qx, sx = quantize_rows(x)
    want = (qx.float() * sx) @ (layer.weight.float() * layer.scale.t()).t() + bias.float()
    # The same products summed in another order, rounded once to bf16.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _tokens(model_dir, **kwargs):
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", **ENGINE, **kwargs)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.skipif(not flashinfer_importable(), reason="needs flashinfer")
def test_fp8_graphs_match_eager(model_dir):
    _, eager = _tokens(model_dir, quantization="fp8", enable_cuda_graphs=False)
    llm, graphed = _tokens(model_dir, quantization="fp8")
    assert llm.engine.runner.graphs.replays > 0
    assert prefix_agreement(graphed, eager) >= 0.9
    _, bf16 = _tokens(model_dir)
    rate = prefix_agreement(graphed, bf16)
    # Printed, not bounded: a tiny random model's logits are near-ties, so e4m3's rounding
    # flips early tokens (5% agreed on the H200); benchmarks/engine/dtype_agreement.py
    # measures the agreement on a real model.
    print(f"\nfp8 vs bf16 (tiny random model): {rate:.1%} of tokens before the first divergence")


def test_fp8_on_cuda_refuses_a_float16_model(model_dir):
    with pytest.raises(ValueError, match="runs bfloat16 models"):
        LLM(model_dir, device="cuda", dtype="float16", quantization="fp8", **ENGINE)
