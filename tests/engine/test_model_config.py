"""A plain Llama config.json is read without transformers (loader.plain_llama_config),
and gives the engine exactly what transformers' AutoConfig would: the same shape,
rotary frequencies, window and EOS. Any other config still goes through AutoConfig."""

import json
import shutil

import pytest
import torch
import transformers

from replica_worker.engine.model import LlamaShape, load_hf_config, sliding_window_of
from replica_worker.engine.model.loader import plain_llama_config
from replica_worker.engine.model.rotary import inverse_frequencies, rope_settings
from replica_worker.engine.model_runner import _read_eos
from tests.support.imports import heavy_modules_after


def _what_the_engine_reads(cfg, folder) -> dict:
    shape = LlamaShape.from_hf_config(cfg)
    return {
        "shape": shape,
        "inv_freq": inverse_frequencies(rope_settings(cfg), shape.head_dim),
        "window": sliding_window_of(cfg, 4096),
        "eos": _read_eos(str(folder), cfg),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["shape"] == b["shape"]
    assert torch.equal(a["inv_freq"], b["inv_freq"])
    assert (a["window"], a["eos"]) == (b["window"], b["eos"])


@pytest.mark.parametrize("arch", ["llama", "llama3"])
def test_a_plain_llama_config_reads_as_transformers_reads_it(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    plain = plain_llama_config(folder)
    assert plain is not None and vars(load_hf_config(folder)) == vars(plain)
    reference = transformers.AutoConfig.from_pretrained(str(folder))
    _assert_same(_what_the_engine_reads(plain, folder), _what_the_engine_reads(reference, folder))


def test_smollm2_reads_as_transformers_reads_it(smollm2_model):
    plain = plain_llama_config(smollm2_model)
    assert plain is not None
    reference = transformers.AutoConfig.from_pretrained(str(smollm2_model))
    _assert_same(_what_the_engine_reads(plain, smollm2_model), _what_the_engine_reads(reference, smollm2_model))


def test_legacy_rope_scaling_and_defaults_read_as_transformers_reads_them(tiny_model_factory, tmp_path):
    """An older Llama 3.1 config (rope_scaling with rope_theta beside it), without the
    keys whose defaults the engine shares with LlamaConfig."""
    folder = tmp_path / "legacy"
    shutil.copytree(tiny_model_factory("llama3"), folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    for key in ("head_dim", "num_key_value_heads", "hidden_act", "attention_bias", "tie_word_embeddings"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    plain = plain_llama_config(folder)
    assert plain is not None
    reference = transformers.AutoConfig.from_pretrained(str(folder))
    _assert_same(_what_the_engine_reads(plain, folder), _what_the_engine_reads(reference, folder))


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_model_types_go_through_transformers(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    assert plain_llama_config(folder) is None
    assert isinstance(load_hf_config(folder), transformers.PretrainedConfig)


@pytest.mark.parametrize("key", ["rms_norm_eps", "max_position_embeddings", "eos_token_id"])
def test_a_llama_config_missing_a_key_transformers_defaults_goes_through_transformers(tiny_model, tmp_path, key):
    folder = tmp_path / "partial"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    assert plain_llama_config(folder) is None
    assert isinstance(load_hf_config(folder), transformers.PretrainedConfig)


def test_an_engine_on_a_plain_llama_config_starts_without_transformers(tiny_model):
    code = ("from replica_worker.engine.config import engine_config\n"
            "from replica_worker.engine.core import EngineCore\n"
            f"EngineCore(engine_config({str(tiny_model)!r}))")
    assert heavy_modules_after(code) == ["torch"]
