"""Loading a model folder's tokenizer and length limit, shared by router and replicas."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """The folder's Hugging Face tokenizer, loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def has_chat_template(model_dir: str) -> bool:
    """Whether the folder carries a chat template (chat_template.jinja, or one in
    tokenizer_config.json), without loading anything."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").exists():
        return True
    config_path = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(config_path.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


# tokenizer_config.json keys by which transformers' tokenizer classes rewrite
# the fast tokenizer when they load it (its post-processor, its pre-tokenizer):
# with any of them set, tokenizer.json alone may encode differently.
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy")


@lru_cache(maxsize=8)
def load_encoder(model_dir: str):
    """The folder's fast tokenizer alone (`tokenizers`, from tokenizer.json), to
    encode prompts exactly as load_tokenizer's would. It loads in milliseconds,
    where loading transformers takes seconds and holds the GIL meanwhile (a
    router's event loop starves). None when the folder has no tokenizer.json
    or its config asks transformers to rewrite it (_REWRITING_KEYS)."""
    folder = Path(model_dir)
    if not (folder / "tokenizer.json").exists():
        return None
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if any(key in config for key in _REWRITING_KEYS):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


# tokenizer_config.json classes whose tokenizer is tokenizer.json as it stands
# (transformers' TokenizersBackend; PreTrainedTokenizerFast before it): they
# decode as the fast tokenizer does. Other classes may rebuild its parts.
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class TextDecoder:
    """What a replica needs of a tokenizer (its EOS id, decoding), from
    tokenizer.json alone: load_decoder's light path. backend_tokenizer is the
    fast tokenizer, as transformers names it, so the detokenizer calls it
    directly (replica_worker/engine/detokenizer.py)."""

    clean_up_tokenization_spaces = False

    def __init__(self, backend, eos_token_id: int | None) -> None:
        self.backend_tokenizer = backend
        self.eos_token_id = eos_token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an
    AddedToken's fields ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=8)
def load_decoder(model_dir: str):
    """The folder's tokenizer for decoding output and knowing its EOS: a
    TextDecoder from tokenizer.json where that decodes exactly as
    load_tokenizer's would, else load_tokenizer's own. The light path loads in
    milliseconds; transformers' tokenizer imports transformers and torch (about
    6 s of CPU on a 2-core machine), which a replica worker, whose engine runs
    in a process of its own, needs for nothing else.

    It is taken only where nothing can differ: a plain tokenizer class
    (_PLAIN_CLASSES), no key that rewrites the fast tokenizer
    (_REWRITING_KEYS), no space clean-up after decoding, and an EOS token
    named in tokenizer_config.json (or special_tokens_map.json) that the
    vocabulary holds, or none named at all."""
    folder = Path(model_dir)
    config_path = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").exists() or not config_path.exists():
        return load_tokenizer(model_dir)
    config = json.loads(config_path.read_text())
    if (config.get("tokenizer_class") not in _PLAIN_CLASSES
            or any(key in config for key in _REWRITING_KEYS)
            or config.get("clean_up_tokenization_spaces")):
        return load_tokenizer(model_dir)
    eos = config.get("eos_token")
    special_map = folder / "special_tokens_map.json"
    if eos is None and special_map.exists():
        eos = json.loads(special_map.read_text()).get("eos_token")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos_id = None
    if eos is not None:
        text = _token_text(eos)
        eos_id = backend.token_to_id(text) if text is not None else None
        if eos_id is None:
            return load_tokenizer(model_dir)
    return TextDecoder(backend, eos_id)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids, with the special tokens the tokenizer adds (a BOS for
    Llama-style tokenizers), as vLLM's completions API encodes it. The router and
    LLM.generate both encode with this, so a prompt gets the same tokens either way.

    A fast tokenizer is asked directly: transformers' encode wraps the same call in
    about as much Python again, paid on every text request the router admits. Its
    encode_batch_fast gives the same ids without the offsets, at about three
    quarters of encode's CPU on a short prompt (benchmarks/router/NOTES.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "encode_batch"):
        backend = tokenizer   # load_encoder's: the fast tokenizer itself
    if backend is not None:
        if hasattr(backend, "encode_batch_fast"):
            return backend.encode_batch_fast([text], add_special_tokens=True)[0].ids
        return backend.encode(text, add_special_tokens=True).ids
    return list(tokenizer.encode(text, add_special_tokens=True))


def read_model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def max_model_len(model_dir: str | Path) -> int:
    """Longest sequence (prompt plus output) the model allows."""
    config = read_model_config(model_dir)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"{model_dir}/config.json names no maximum length")


def vocab_size(model_dir: str | Path) -> int:
    return int(read_model_config(model_dir)["vocab_size"])
