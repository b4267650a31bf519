"""A replica worker decodes with tokenizer.json alone (common.tokenizer.load_decoder):
the same EOS id and the same text as transformers' tokenizer, so its process
loads neither transformers nor torch (its engine runs in a process of its own)."""

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.tokenizer import TextDecoder, load_decoder
from replica_worker.engine.detokenizer import IncrementalDetokenizer
from tests.support.imports import heavy_modules_after


@pytest.mark.parametrize("model", ["tiny_model", "smollm2_model"])
def test_the_light_decoder_decodes_as_transformers_does(request, model):
    folder = str(request.getfixturevalue(model))
    decoder = load_decoder(folder)
    assert isinstance(decoder, TextDecoder)
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert decoder.eos_token_id == reference.eos_token_id is not None
    rng = random.Random(0)
    special = list(reference.all_special_ids)
    vocab = len(reference)
    for n in (1, 3, 17, 64):
        for _ in range(20):
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)]
            for skip in (True, False):
                assert decoder.decode(ids, skip_special_tokens=skip) == \
                    reference.decode(ids, skip_special_tokens=skip), (ids, skip)
    # Token by token through the detokenizer, with a stop string: the same deltas.
    text = "The capital of France is Paris. Ünïcödé ✓ 数字\nend"
    ids = reference.encode(text, add_special_tokens=False)
    deltas = {}
    for name, tok in (("light", decoder), ("transformers", reference)):
        out: list[int] = []
        detok = IncrementalDetokenizer(tok, out, stop=("end",))
        deltas[name] = []
        for token in ids:
            out.append(token)
            deltas[name].append(detok.step())
    assert deltas["light"] == deltas["transformers"]


def _edited(src: Path, dest: Path, **changes) -> str:
    shutil.copytree(src, dest)
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return str(dest)


@pytest.mark.parametrize("changes", [
    {"tokenizer_class": "LlamaTokenizer"},     # a class that may rebuild the fast tokenizer
    {"clean_up_tokenization_spaces": True},    # decode's text is edited after the fast tokenizer
    {"add_bos_token": True},                   # a key that rewrites the fast tokenizer
    {"eos_token": "<no such token>"},          # an EOS the vocabulary lacks: transformers decides
])
def test_anything_that_could_decode_differently_keeps_transformers(tiny_model, tmp_path, changes):
    folder = _edited(tiny_model, tmp_path / "edited", **changes)
    assert not isinstance(load_decoder(folder), TextDecoder)


def test_an_eos_named_as_an_added_token_or_in_the_special_tokens_map(tiny_model, tmp_path):
    as_added = _edited(tiny_model, tmp_path / "added", eos_token={"content": "</s>", "special": True})
    assert load_decoder(as_added).eos_token_id == 2
    in_map = _edited(tiny_model, tmp_path / "map", eos_token=None)
    (Path(in_map) / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_decoder(in_map).eos_token_id == 2
    neither = _edited(tiny_model, tmp_path / "none", eos_token=None)
    assert load_decoder(neither).eos_token_id is None


def test_the_worker_loads_neither_transformers_nor_torch(tiny_model):
    """Their imports are seconds of CPU each: a replica worker paid them twice (its
    own process and its engine's), and a 2-core machine starting two replicas
    waited for all four."""
    code = ("from replica_worker.worker.app import build_worker\n"
            "from common.tokenizer import load_decoder\n"
            f"load_decoder({str(tiny_model)!r})")
    assert heavy_modules_after(code) == []
