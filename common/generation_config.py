"""A model's own sampling defaults, from its generation_config.json, as vLLM's
OpenAI server and LLM apply them: a sampling field a request leaves unset takes
the model's value (a chat model tuned for temperature 0.6 and top_p 0.9 is
served that way unless the request says otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling fields the folder's generation_config.json sets; {} without one."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: data[key] for key in SAMPLING_KEYS
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)}
