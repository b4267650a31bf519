"""Tiny random-weight Llama-family models and a byte-level BPE tokenizer, built offline.

Everything here is deterministic: the same arguments give byte-identical
tokenizer files and identical weights, so tests and the local stack need no
download. Untied embeddings and a wide initializer range make greedy output
vary from token to token instead of repeating one id.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from common.build_once import build_once

ARCHITECTURES = ("llama", "llama3", "mistral", "qwen2")

# Words with multi-byte characters keep the incremental detokenizer honest.
_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or his "
    "model token cache block queue router replica request stream prefill decode chunk "
    "batch latency serving engine paged attention schedule lease redis grpc kernel "
    "river mountain city garden window paper light music story morning winter ocean "
    "café naïve résumé jalapeño crème brûlée Zürich São Paulo 東京 北京 模型 你好 "
    "こんにちは 안녕하세요 Привет мир γειά σου 🙂 🚀 ✨ — … «quoted» ½ €5 ±3°"
).split()


def _corpus(seed: int, num_words: int = 60_000) -> list[str]:
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(num_words):
        line.append(rng.choice(_WORDS))
        if rng.random() < 0.08:
            lines.append(" ".join(line) + rng.choice([".", ",", "!", "?", ":"]))
            line = []
    lines.append(" ".join(line))
    # Digits and punctuation so that any printable ASCII round-trips compactly.
    lines.extend(f"{i} {i * 7 % 1000} ({i}) [{i}] {{x: {i}}}" for i in range(500))
    return lines


# A plain chat template, so the chat API can be tested on tiny models too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int = 512, seed: int = 0):
    """Trains a byte-level BPE on a seeded synthetic corpus and saves it to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _config(arch: str, vocab_size: int, bos: int, eos: int, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    common.update(overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "llama3":
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        common.setdefault("sliding_window", None)  # a window only where a test asks for one
        return tf.MistralConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")


def build_tokenizer_and_config(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    **config_overrides,
):
    """The tokenizer and config.json of a tiny model, no weights: all a router
    reads of a model folder, and it needs no torch. Returns the config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    config = _config(
        arch,
        vocab_size=len(tokenizer),
        bos=tokenizer.bos_token_id,
        eos=tokenizer.eos_token_id,
        **config_overrides,
    )
    config.save_pretrained(str(out))
    return config


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    **config_overrides,
) -> Path:
    """Writes config, float32 safetensors weights and tokenizer to out_dir.

    Skips the work when out_dir already holds a model built from the same
    arguments (a stamp file records them). Safe to call from several
    processes at once (common/build_once.py): stacks started side by side
    share one cached folder.
    """
    stamp = json.dumps(
        {"arch": arch, "seed": seed, "vocab": vocab_size, "format": 2, **config_overrides},
        sort_keys=True,
    )
    digest = hashlib.sha256(stamp.encode()).hexdigest()
    return build_once(Path(out_dir), "quadriga_tiny_model.stamp", digest,
                      lambda folder: _write_tiny_model(folder, arch, seed, vocab_size, **config_overrides))


def _write_tiny_model(out: Path, arch: str, seed: int, vocab_size: int, **config_overrides) -> None:
    import torch
    import transformers as tf

    config = build_tokenizer_and_config(out, arch, seed, vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model_cls = {
        "llama": tf.LlamaForCausalLM,
        "llama3": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
    }[arch]
    model = model_cls(config).to(torch.float32)
    if arch == "qwen2":
        # Default init leaves the qkv biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random-weight model offline.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed))


if __name__ == "__main__":
    main()
