"""The Llama-family model against transformers on the same checkpoint folders."""

from __future__ import annotations


import pytest
import torch
import transformers

from replica_worker.engine.attention import TorchAttentionBackend, build_attention_metadata
from replica_worker.engine.config import ModelConfig
from replica_worker.engine.kv_cache import KVCache
from replica_worker.engine.model import get_model, load_hf_config
from replica_worker.engine.model.rotary import inverse_frequencies, rope_settings

PROMPT = [1, 17, 250, 3, 99, 42, 480, 7, 7, 311, 64, 128, 5, 200, 301, 18, 77, 260, 9, 444, 12, 33, 90]


def full_forward_logits(model_dir, token_ids, dtype="float32", load_format="auto", block_size=4):
    """Our model on one whole prompt through the paged path; float32 logits [T, V]."""
    hf_config = load_hf_config(model_dir)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    backend = TorchAttentionBackend(hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim)
    model = get_model(ModelConfig(str(model_dir), dtype=dtype, load_format=load_format), backend, "cpu", 1024)
    blocks = -(-len(token_ids) // block_size)
    cache = KVCache(model.shape.num_layers, blocks, block_size, model.shape.num_kv_heads, head_dim, model.embed_tokens.weight.dtype, "cpu")
    md, positions, _ = build_attention_metadata([0], [len(token_ids)], [list(range(blocks))], 1, block_size, "cpu")
    backend.prepare(md)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), positions, cache.layers, md)
        return model.compute_logits(hidden)


def hf_logits(model_dir, token_ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2"])
def test_logits_match_transformers(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    ours = full_forward_logits(path, PROMPT)
    torch.testing.assert_close(ours, hf_logits(path, PROMPT), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_applied(tiny_model_factory):
    rope = rope_settings(load_hf_config(tiny_model_factory("llama3")))
    assert rope["rope_type"] == "llama3"
    scaled = inverse_frequencies(rope, 16)
    plain = inverse_frequencies({**rope, "rope_type": "default"}, 16)
    assert not torch.allclose(scaled, plain)
    assert torch.equal(scaled[0], plain[0])  # high frequencies are left alone


def test_sharded_checkpoint_with_index(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path), max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    torch.testing.assert_close(full_forward_logits(tmp_path, PROMPT), hf_logits(src, PROMPT), atol=1e-4, rtol=1e-4)
    # Without the index the shards are found by globbing.
    (tmp_path / "model.safetensors.index.json").unlink()
    torch.testing.assert_close(full_forward_logits(tmp_path, PROMPT), hf_logits(src, PROMPT), atol=1e-4, rtol=1e-4)


def test_tied_embeddings(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama", tie_word_embeddings=True)
    torch.testing.assert_close(full_forward_logits(path, PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=1e-4)


def _custom_config(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=[2, 5],
    )
    config.save_pretrained(str(tmp_path))
    return tmp_path


def test_dummy_weights_custom_shape(tmp_path):
    path = _custom_config(tmp_path)
    assert not list(path.glob("*.safetensors"))
    backend = TorchAttentionBackend(6, 3, 16)
    a = get_model(ModelConfig(str(path), load_format="dummy", seed=3), backend, "cpu", 512)
    b = get_model(ModelConfig(str(path), load_format="dummy", seed=3), backend, "cpu", 512)
    assert a.layers[0].self_attn.qkv_proj.weight.shape == ((6 + 2 * 3) * 16, 96)
    assert a.layers[2].mlp.gate_up_proj.weight.shape == (400, 96)
    assert a.lm_head.weight is a.embed_tokens.weight
    assert torch.equal(a.layers[1].mlp.down_proj.weight, b.layers[1].mlp.down_proj.weight)
    assert abs(a.embed_tokens.weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.norm.weight, torch.ones(96))
    logits = full_forward_logits(path, [3, 4, 5, 6, 7], load_format="dummy")
    assert logits.shape == (5, 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_model_factory, dtype):
    path = tiny_model_factory("llama")
    ref = full_forward_logits(path, PROMPT)
    low = full_forward_logits(path, PROMPT, dtype=dtype)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    scale = ref.abs().max().item()
    assert (low - ref).abs().max().item() < 0.05 * scale
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unsupported_architecture_is_rejected(tmp_path):
    transformers.GPT2Config().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported model_type"):
        get_model(ModelConfig(str(tmp_path), load_format="dummy"), TorchAttentionBackend(12, 12, 64), "cpu", 16)
