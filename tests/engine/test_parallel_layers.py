"""What each tensor-parallel rank holds, checked in one process: loading a shard needs no
collective, so a model built as rank r of n must hold exactly rank r's slices of the
checkpoint (and of the dummy model every size draws)."""

from __future__ import annotations

import pytest
import torch
import transformers

from replica_worker.engine.attention import TorchAttentionBackend
from replica_worker.engine.config import ModelConfig
from replica_worker.engine.distributed.group import TensorGroup
from replica_worker.engine.model import get_model, load_hf_config
from replica_worker.engine.model.parallel import head_shard, tensor_parallel_problem


class RankOf(TensorGroup):
    """A rank's identity without peers: enough to build and load its shard."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def build_rank(path, rank: int, size: int, load_format: str = "auto"):
    cfg = load_hf_config(path)
    heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    backend = TorchAttentionBackend(heads.num_heads, heads.num_kv_heads, head_dim)
    return get_model(ModelConfig(str(path), load_format=load_format, seed=5), backend, "cpu", 64,
                     cfg, RankOf(rank, size))


def hf_state(path) -> dict[str, torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {k.removeprefix("model."): v for k, v in hf.state_dict().items()}


def test_each_rank_loads_its_heads_and_features(tiny_model_factory):
    path = tiny_model_factory("qwen2")  # 4 heads, 2 kv heads of 16, qkv bias
    ref = hf_state(path)
    d = 16
    for rank in (0, 1):
        m = build_rank(path, rank, 2)
        attn, mlp = m.layers[1].self_attn, m.layers[1].mlp
        q = ref["layers.1.self_attn.q_proj.weight"][rank * 2 * d:(rank + 1) * 2 * d]
        k = ref["layers.1.self_attn.k_proj.weight"][rank * d:(rank + 1) * d]
        v = ref["layers.1.self_attn.v_proj.weight"][rank * d:(rank + 1) * d]
        assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
        kb = ref["layers.1.self_attn.k_proj.bias"][rank * d:(rank + 1) * d]
        assert torch.equal(attn.qkv_proj.bias[2 * d:3 * d], kb)
        assert torch.equal(attn.o_proj.weight, ref["layers.1.self_attn.o_proj.weight"][:, rank * 2 * d:(rank + 1) * 2 * d])
        gate = ref["layers.1.mlp.gate_proj.weight"][rank * 64:(rank + 1) * 64]
        up = ref["layers.1.mlp.up_proj.weight"][rank * 64:(rank + 1) * 64]
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
        assert torch.equal(mlp.down_proj.weight, ref["layers.1.mlp.down_proj.weight"][:, rank * 64:(rank + 1) * 64])
        vocab = ref["embed_tokens.weight"].shape[0]
        rows = vocab // 2
        assert torch.equal(m.embed_tokens.weight, ref["embed_tokens.weight"][rank * rows:(rank + 1) * rows])
        assert torch.equal(m.lm_head.weight, ref["lm_head.weight"][rank * rows:(rank + 1) * rows])
        assert torch.equal(m.norm.weight, ref["norm.weight"])


def test_an_odd_vocabulary_is_padded_and_tied_heads_share_the_shard(tiny_model_factory):
    path = tiny_model_factory("llama", vocab_size=511, tie_word_embeddings=True, num_key_value_heads=1)
    ref = hf_state(path)["embed_tokens.weight"]
    assert ref.shape[0] % 2 == 1
    rows = -(-ref.shape[0] // 2)
    low, high = build_rank(path, 0, 2), build_rank(path, 1, 2)
    assert torch.equal(low.embed_tokens.weight, ref[:rows])
    assert torch.equal(high.embed_tokens.weight[: ref.shape[0] - rows], ref[rows:])
    assert torch.equal(high.embed_tokens.weight[ref.shape[0] - rows:], torch.zeros(1, ref.shape[1]))
    assert high.lm_head.weight is high.embed_tokens.weight
    # One kv head, two ranks: both hold it (replicated), each with its own two q heads.
    k = hf_state(path)["layers.0.self_attn.k_proj.weight"]
    for m in (low, high):
        assert m.layers[0].self_attn.num_kv_heads == 1
        assert torch.equal(m.layers[0].self_attn.qkv_proj.weight[32:48], k)


def test_dummy_shards_put_together_are_the_single_rank_dummy_model(tmp_path):
    transformers.LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attention_bias=True,
    ).save_pretrained(str(tmp_path))
    whole = build_rank(tmp_path, 0, 1, "dummy")
    parts = [build_rank(tmp_path, r, 2, "dummy") for r in (0, 1)]
    qkv = [p.layers[1].self_attn.qkv_proj for p in parts]
    q = torch.cat([m.weight[:32] for m in qkv])
    k = torch.cat([m.weight[32:48] for m in qkv])
    v = torch.cat([m.weight[48:] for m in qkv])
    assert torch.equal(whole.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(whole.layers[1].self_attn.qkv_proj.bias[:64], torch.cat([m.bias[:32] for m in qkv]))
    down = torch.cat([p.layers[0].mlp.down_proj.weight for p in parts], dim=1)
    assert torch.equal(whole.layers[0].mlp.down_proj.weight, down)
    embed = torch.cat([p.embed_tokens.weight for p in parts])
    assert torch.equal(whole.embed_tokens.weight, embed[:301]) and not embed[301:].any()


@pytest.mark.parametrize("heads, kv, inter, size, problem", [
    (4, 2, 128, 2, None),
    (4, 1, 128, 2, None),  # replicated kv head
    (8, 2, 128, 4, None),
    (6, 3, 128, 2, "num_key_value_heads 3 is not divisible"),
    (6, 6, 128, 4, "num_attention_heads 6 is not divisible"),
    (8, 3, 128, 4, "not a multiple of num_key_value_heads 3"),
    (4, 2, 100, 8, "intermediate_size 100"),
])
def test_shapes_that_do_not_split_are_named(heads, kv, inter, size, problem):
    found = tensor_parallel_problem(heads, kv, inter, size)
    assert (found is None) if problem is None else (problem in found)
