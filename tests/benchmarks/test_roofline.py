"""Roofline arithmetic on a known shape: Llama-3.1-8B in bf16."""

import pytest

from benchmarks.harness.roofline import H200, Hardware, Shape, workload_limit

LLAMA_31_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_llama31_8b_weights_and_step():
    s = Shape.from_config(LLAMA_31_8B)
    assert s.params == 8_030_261_248
    assert s.weight_bytes / 1e9 == pytest.approx(16.06, abs=0.01)
    assert s.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2          # 128 KiB
    hw = Hardware(**H200)
    assert hw.decode_step_s(s, 1, 0) * 1e3 == pytest.approx(3.74, abs=0.01)
    # 1000 tokens of context at batch 64 adds 64 * 1000 * 128 KiB of KV reads.
    assert s.decode_step_bytes(64, 1000) == s.weight_bytes + 64 * 1000 * 131072


def test_flops_per_token():
    s = Shape.from_config(LLAMA_31_8B)
    assert s.flops_per_token(0) == 2 * (s.params - 128256 * 4096 - 4096 - 32 * 2 * 4096 + 32 * 2 * 4096)
    assert s.flops_per_token(1000) - s.flops_per_token(0) == 4 * 32 * 32 * 128 * 1000


def test_workload_limit_memory_then_compute_bound():
    s, hw = Shape.from_config(LLAMA_31_8B), Hardware(**H200)
    small = workload_limit(s, hw, mean_prompt=1000, mean_output=200, batch=1)
    assert small["bound"] == "memory"
    assert small["output_tok_s"] < 1 / small["decode_step_s"] * 1.0001
    big = workload_limit(s, hw, mean_prompt=100, mean_output=100, batch=4096)
    assert big["bound"] == "compute"
    two = workload_limit(s, hw, mean_prompt=1000, mean_output=200, batch=1, replicas=2)
    assert two["req_s"] == pytest.approx(2 * small["req_s"])


def test_model_dir_writes_each_known_shape(tmp_path):
    """Config-only folders a replica loads with dummy weights: the 8B shape and the
    CPU shape the prefix figures use, each with the tiny model's tokenizer."""
    import json

    from benchmarks.harness.cli import main

    for shape, hidden, vocab in (("llama-3.1-8b", 4096, 128256), ("cpu-small", 128, 512)):
        out = tmp_path / shape
        assert main(["model-dir", str(out), "--shape", shape]) == 0
        config = json.loads((out / "config.json").read_text())
        assert (config["hidden_size"], config["vocab_size"]) == (hidden, vocab)
        assert (out / "tokenizer.json").exists()


def test_the_harness_names_the_card_it_runs_on():
    """An H100 run's roofline is the H100's, not the H200's the GPU scripts assumed."""
    import argparse

    from benchmarks.harness.cli import hardware_from
    from benchmarks.harness.roofline import H100, gpu_card

    args = dict(bandwidth=None, flops=None)
    h100 = hardware_from(argparse.Namespace(hardware="h100", **args))
    h200 = hardware_from(argparse.Namespace(hardware="h200", **args))
    assert (h100.bandwidth_Bps, h100.flops) == (H100["bandwidth_Bps"], H100["flops"])
    assert h100.bandwidth_Bps < h200.bandwidth_Bps and h100.name.startswith("h100")
    assert hardware_from(argparse.Namespace(hardware="none", **args)) is None
    assert gpu_card("NVIDIA H100 80GB HBM3\n") == "h100" and gpu_card("NVIDIA H200\n") == "h200"
    assert gpu_card("NVIDIA A100-SXM4-80GB\n") == "gpu"   # no rates known: no roofline
