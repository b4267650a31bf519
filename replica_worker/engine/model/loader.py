"""Builds a Llama-family model on its device and fills its weights.

Parameters are allocated directly on the target device in the target dtype
(no CPU copy of the model first), then filled from the checkpoint's
*.safetensors (one file or sharded) or, with load_format "dummy", with seeded
random values, which needs only config.json.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from replica_worker.engine.attention import AttentionBackend
from replica_worker.engine.config import ModelConfig
from replica_worker.engine.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def load_hf_config(model_dir: str | Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(str(model_dir))


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
) -> LlamaForCausalLM:
    device = torch.device(device)
    hf_config = hf_config or load_hf_config(model_config.model)
    with model_context(DTYPES[model_config.dtype], device):
        model = LlamaForCausalLM(hf_config, backend, max_positions)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        load_safetensors(model, Path(model_config.model))
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    device = model.embed_tokens.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.fill_(1.0)  # unit norms keep activations from vanishing
        else:
            param.normal_(0.0, std, generator=gen)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use load_format='dummy' for random weights)")
    return files


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, int, int] | None:
    """The destination tensor and the [start, end) rows that checkpoint tensor `name` fills."""
    s = model.shape
    m = _LAYER_RE.match(name)
    if m:
        layer_idx, block, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        module = getattr(model.layers[layer_idx], block)
        if proj in ("q_proj", "k_proj", "v_proj"):
            param = module.qkv_proj if kind == "weight" else module.qkv_bias
            if param is None:
                raise ValueError(f"checkpoint has {name} but the config declares no qkv bias")
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[proj]
            return param, start, start + (q if proj == "q_proj" else kv)
        if proj in ("gate_proj", "up_proj"):
            start = 0 if proj == "gate_proj" else s.intermediate_size
            return module.gate_up_proj, start, start + s.intermediate_size
        if kind == "weight" and proj in ("o_proj", "down_proj"):
            param = getattr(module, proj)
            return param, 0, param.shape[0]
        raise ValueError(f"unsupported checkpoint tensor {name}")
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", name)
    if m:
        param = getattr(model.layers[int(m.group(1))], m.group(2)).weight
    elif name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        param = model.embed_tokens
    elif name in ("model.norm.weight", "norm.weight"):
        param = model.norm.weight
    elif name == "lm_head.weight":
        if s.tie_word_embeddings:
            return None  # some tied checkpoints still ship a copy
        param = model.lm_head
    elif "rotary_emb" in name:
        return None  # inv_freq buffers in old checkpoints
    else:
        raise ValueError(f"unsupported checkpoint tensor {name}")
    return param, 0, param.shape[0]


@torch.no_grad()
def load_safetensors(model: LlamaForCausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    filled: dict[int, int] = {}
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    continue
                param, start, end = target
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != (end - start, *param.shape[1:]):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit rows {start}:{end} of {tuple(param.shape)}")
                param[start:end].copy_(tensor)
                filled[id(param)] = filled.get(id(param), 0) + (end - start)
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing weights for: {', '.join(missing[:8])}")
