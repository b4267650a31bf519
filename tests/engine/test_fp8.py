"""quantization="fp8": e4m3 decoder weights with per-channel scales, inputs
quantized per token (replica_worker/engine/model/fp8.py).

The engine is checked token for token against transformers running the same
arithmetic: its decoder projections' weights replaced by their dequantized fp8
values, and each projection's input quantized and dequantized per token by a
forward pre-hook. On the CPU the engine emulates the fp8 matmul in float32, so
the two compute the same function; on CUDA `_scaled_mm` does (GPU tests)."""

import pytest
import torch
import transformers

from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import ModelConfig
from replica_worker.engine.model.fp8 import FP8, FP8_MAX, Fp8Weight, emulate_in_transformers, quantize_rows
from replica_worker.engine.model.loader import get_model
from replica_worker.engine.attention.torch_backend import TorchAttentionBackend
from replica_worker.worker.config import parse_args
from tests.engine.hf_reference import greedy_of

PROMPTS = [[17, 5, 240, 33], list(range(40, 101)), [(i * 37) % 500 + 3 for i in range(150)]]
MAX_NEW = 16


def fake_quantized_hf(path: str):
    """transformers' model computing what the fp8 engine computes."""
    return emulate_in_transformers(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def test_quantize_rows_maps_each_rows_largest_value_to_the_largest_e4m3():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g) * torch.tensor([1e-3, 0.1, 1, 10, 300, 1e4])[:, None]
    x[2] = 0.0   # an all-zero row: a tiny scale, zeros out
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (6, 1) and s.dtype == torch.float32
    back = q.float() * s
    for row in (0, 1, 3, 4, 5):
        assert q[row].float().abs().max() == FP8_MAX
        # e4m3 keeps 3 mantissa bits: within half a step (1/16 of the value), or of the
        # smallest normal step for values that fall to subnormals.
        err = (back[row] - x[row]).abs()
        assert torch.all(err <= x[row].abs() / 16 + s[row] * 2.0 ** -9), row
    assert torch.equal(back[2], torch.zeros(64))


def test_fp8_linear_on_the_cpu_is_the_dequantized_product():
    g = torch.Generator().manual_seed(1)
    w, x, bias = torch.randn(48, 32, generator=g), torch.randn(5, 32, generator=g), torch.randn(48, generator=g)
    layer = Fp8Weight(w)
    qx, sx = quantize_rows(x)
    qw, sw = quantize_rows(w)
    want = (qx.float() * sx) @ (qw.float() * sw).t() + bias
    torch.testing.assert_close(layer.linear(x, bias, torch.float32), want, rtol=1e-6, atol=1e-6)
    # and it stays close to the float product: a few percent, as e4m3's precision allows
    assert (layer.linear(x, None, torch.float32) - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])   # qwen2: projections with a bias
def test_fp8_engine_equals_transformers_with_the_same_quantization(tiny_model_factory, arch):
    path = str(tiny_model_factory(arch))
    reference = greedy_of(fake_quantized_hf(path), PROMPTS, MAX_NEW)
    plain = greedy_of(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                   PROMPTS, MAX_NEW)
    assert reference != plain, "the quantization changes nothing on this model: the test could not fail"
    llm = LLM(path, quantization="fp8", chunk_size=32, num_blocks=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_the_quantized_model_holds_no_second_copy_of_its_weights(tiny_model_factory):
    path = str(tiny_model_factory("llama3"))
    config = ModelConfig(model=path, quantization="fp8")
    from replica_worker.engine.model.loader import load_hf_config
    hf_config = load_hf_config(path)
    d = hf_config.hidden_size // hf_config.num_attention_heads
    backend = TorchAttentionBackend(hf_config.num_attention_heads, hf_config.num_key_value_heads, d)
    model = get_model(config, backend, "cpu", 256, hf_config)
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert proj.fp8.weight.dtype == FP8 and not hasattr(proj, "weight")
    assert model.embed_tokens.weight.dtype == torch.float32   # embedding and head stay


def test_quantization_is_checked_and_reaches_the_replica():
    with pytest.raises(ValueError, match="quantization must be 'fp8'"):
        ModelConfig(model="m", quantization="int4")
    assert dict(parse_args(["--model", "m", "--quantization", "fp8"]).engine_args)["quantization"] == "fp8"
    assert dict(parse_args(["--model", "m"]).engine_args)["quantization"] is None
