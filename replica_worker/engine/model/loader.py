"""Builds a Llama-family model on its device and fills its weights.

Parameters are allocated directly on the target device in the target dtype
(no CPU copy of the model first), then filled from the checkpoint's
*.safetensors (one file or sharded) or, with load_format "dummy", with seeded
random values, which needs only config.json.

Under tensor parallelism each rank reads only its shard of each tensor (a
safetensors slice reads the indexed rows or columns, not the whole tensor), and
draws dummy weights full-sized before keeping its shard, so every
tensor-parallel size runs the same dummy model.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from replica_worker.engine.attention import AttentionBackend
from replica_worker.engine.config import ModelConfig
from replica_worker.engine.distributed.group import SINGLE_RANK, TensorGroup
from replica_worker.engine.model.fp8 import check_device
from replica_worker.engine.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


# A Llama config.json stating each of these is read as it stands, without
# transformers: every other value the engine reads has the same default in the
# engine as in transformers' LlamaConfig (head_dim, num_key_value_heads,
# hidden_act, attention_bias, tie_word_embeddings, rope_theta; no window).
_PLAIN_LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "eos_token_id")


def load_hf_config(model_dir: str | Path):
    """The model's configuration, as attributes. A plain Llama config.json
    (plain_llama_config) is read directly; any other goes through transformers'
    AutoConfig, which fills in its model type's defaults and derived fields."""
    plain = plain_llama_config(model_dir)
    if plain is not None:
        return plain
    import transformers

    return transformers.AutoConfig.from_pretrained(str(model_dir))


def plain_llama_config(model_dir: str | Path) -> SimpleNamespace | None:
    """config.json's fields as attributes, where transformers would add nothing
    the engine reads: model_type llama, every _PLAIN_LLAMA_KEYS stated. Else None.
    Importing transformers costs an engine process seconds of CPU at start
    (3.7 s of its 6.9 s on a 2-core machine, tiny model), paid by every replica."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if raw.get("model_type") != "llama" or any(raw.get(key) is None for key in _PLAIN_LLAMA_KEYS):
        return None
    return SimpleNamespace(**raw)


def sliding_window_of(hf_config, max_positions: int) -> int | None:
    """The attention window of every layer (a query at position p sees keys at
    positions > p - window, as transformers masks them), or None where attention
    is full over max_positions. Raises ValueError for windows on some layers only."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    layer_types = set(getattr(hf_config, "layer_types", None) or ["sliding_attention"])
    if layer_types == {"full_attention"}:
        return None
    if layer_types != {"sliding_attention"}:
        raise ValueError(
            f"the model mixes attention kinds across layers ({sorted(layer_types)}); "
            "only a sliding window on every layer is supported"
        )
    return int(window) if max_positions > window else None


@contextlib.contextmanager
def model_context(dtype: torch.dtype, device: torch.device):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_config: ModelConfig,
    backend: AttentionBackend,
    device: torch.device | str,
    max_positions: int,
    hf_config=None,
    group: TensorGroup = SINGLE_RANK,
) -> LlamaForCausalLM:
    device = torch.device(device)
    hf_config = hf_config or load_hf_config(model_config.model)
    if model_config.quantization == "fp8":
        check_device(device, DTYPES[model_config.dtype])
    with model_context(DTYPES[model_config.dtype], device):
        model = LlamaForCausalLM(hf_config, backend, max_positions, group)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        load_safetensors(model, Path(model_config.model))
    if model_config.quantization == "fp8":
        with torch.no_grad():
            model.quantize_fp8()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # dummy draws, bf16 weights replaced: else the KV sizing counts them as used
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    gen = torch.Generator(device=model.embed_tokens.weight.device)
    gen.manual_seed(seed)
    for module in model.weight_modules():
        module.init_dummy(gen, std)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use load_format='dummy' for random weights)")
    return files


_NORM_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.nn.Module, str, str] | None:
    """(the module checkpoint tensor `name` fills, its part in a fused projection, weight
    or bias), or None for a tensor the model does not need."""
    m = _LAYER_RE.match(name)
    if m:
        layer_idx, block, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        module = getattr(model.layers[layer_idx], block)
        if proj in ("q_proj", "k_proj", "v_proj"):
            if kind == "bias" and module.qkv_proj.bias is None:
                raise ValueError(f"checkpoint has {name} but the config declares no qkv bias")
            return module.qkv_proj, proj[0], kind
        if kind == "weight" and proj in ("gate_proj", "up_proj"):
            return module.gate_up_proj, proj.removesuffix("_proj"), kind
        if kind == "weight" and proj in ("o_proj", "down_proj"):
            return getattr(module, proj), "", kind
        raise ValueError(f"unsupported checkpoint tensor {name}")
    m = _NORM_RE.match(name)
    if m:
        return getattr(model.layers[int(m.group(1))], m.group(2)), "", "weight"
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return model.embed_tokens, "", "weight"
    if name in ("model.norm.weight", "norm.weight"):
        return model.norm, "", "weight"
    if name == "lm_head.weight":
        # Some tied checkpoints still ship a copy.
        return None if model.lm_head.tied else (model.lm_head, "", "weight")
    if "rotary_emb" in name:
        return None  # inv_freq buffers in old checkpoints
    raise ValueError(f"unsupported checkpoint tensor {name}")


@torch.no_grad()
def load_safetensors(model: LlamaForCausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    loaded: set[tuple[int, str, str]] = set()
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    continue
                module, part, kind = target
                try:
                    module.load(part, kind, f.get_slice(name))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
                loaded.add((id(module), part, kind))
    names = {id(m): n for n, m in model.named_modules()}
    missing = [f"{names[id(m)]}{'.' + part if part else ''}.{kind}"
               for m in model.weight_modules() for part, kind in sorted(m.expected_loads())
               if (id(m), part, kind) not in loaded]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing weights for: {', '.join(missing[:8])}")
