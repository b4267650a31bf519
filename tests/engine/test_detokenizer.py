"""Incremental detokenizer: deltas never split a character and join to the full text."""

import random

import pytest

from common.tokenizer import load_tokenizer
from replica_worker.engine.detokenizer import IncrementalDetokenizer

TEXT = "Zürich café 東京 模型 🙂🚀 naïve — «quoted» ½ €5 Привет мир こんにちは ✨ end."


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def stream(tokenizer, ids, stop=(), chunk_sizes=None, resume=0, resume_text_len=None):
    """Feeds ids a few at a time; returns (deltas, stopped)."""
    out = list(ids[:resume])
    detok = IncrementalDetokenizer(tokenizer, out, tuple(stop), resume_text_len)
    deltas, i = [], resume
    rng = random.Random(0)
    while i < len(ids):
        n = chunk_sizes or 1
        n = rng.randint(1, 3) if n == "random" else n
        out.extend(ids[i:i + n])
        i += n
        text, hit = detok.step(final=i >= len(ids))
        deltas.append(text)
        if hit:
            return deltas, True
    return deltas, False


def byte_tokens(tokenizer, text):
    """Single-byte tokens make multi-byte characters span several tokens."""
    vocab = tokenizer.get_vocab()
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    split = []
    for piece, i in zip(pieces, ids):
        if len(piece) > 1 and all(ch in vocab for ch in piece):
            split.extend(vocab[ch] for ch in piece)
        else:
            split.append(i)
    return split


@pytest.mark.parametrize("chunks", [1, 2, "random"])
def test_deltas_join_to_full_decode_and_never_split_characters(tokenizer, chunks):
    ids = byte_tokens(tokenizer, TEXT)
    assert len(ids) > len(tokenizer.encode(TEXT, add_special_tokens=False))
    deltas, stopped = stream(tokenizer, ids, chunk_sizes=chunks)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_cuts_text_and_is_never_half_sent(tokenizer):
    ids = byte_tokens(tokenizer, TEXT)
    deltas, stopped = stream(tokenizer, ids, stop=("模型 🙂",))
    assert stopped
    assert "".join(deltas) == "Zürich café 東京 "
    # held back: no delta ever ended with a prefix of the stop string
    assert not any(d.endswith("模") for d in deltas)


def test_stop_string_that_never_matches_releases_held_text(tokenizer):
    ids = tokenizer.encode("abc abd abe", add_special_tokens=False)
    deltas, stopped = stream(tokenizer, ids, stop=("abz",))
    assert not stopped
    assert "".join(deltas) == "abc abd abe"


@pytest.mark.parametrize("resume", [3, 7, 11])
def test_resumed_output_continues_without_gap_or_repeat(tokenizer, resume):
    ids = byte_tokens(tokenizer, TEXT)
    # What an earlier replica sent before it died (its last step not final,
    # so it may have held back an incomplete character).
    out = []
    detok = IncrementalDetokenizer(tokenizer, out)
    sent = ""
    for t in ids[:resume]:
        out.append(t)
        sent += detok.step()[0]
    rest, _ = stream(tokenizer, ids, resume=resume, resume_text_len=len(sent))
    assert sent + "".join(rest) == TEXT


def test_resume_without_text_length_skips_nothing_complete(tokenizer):
    ids = tokenizer.encode("hello world again", add_special_tokens=False)
    resume = 2
    sent = tokenizer.decode(ids[:resume])
    rest, _ = stream(tokenizer, ids, resume=resume)
    assert sent + "".join(rest) == "hello world again"


def test_stop_strings_unchecked_before_min_tokens_then_only_new_ones_match(tokenizer):
    text = "ab the end ab x ab"
    ids = byte_tokens(tokenizer, text)
    out: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, out, ("ab",))
    sent, hits = "", []
    for i, token in enumerate(ids):
        out.append(token)
        # Checking starts right after the second "ab" has gone out unchecked.
        piece, hit = detok.step(check_stop=len(tokenizer.decode(out)) > len("ab the end ab"))
        sent += piece
        hits.append(hit)
        if hit:
            break
    # Unchecked text is neither held back nor matched; the "ab"s sent before are never matched later.
    assert sent == "ab the end ab x " and hits[-1] and hits.count(True) == 1


def test_the_fast_path_decodes_as_transformers_does(tokenizer, smollm2_model):
    from replica_worker.engine.detokenizer import ids_to_text

    for tok in (tokenizer, load_tokenizer(str(smollm2_model))):
        assert tok.backend_tokenizer is not None and not tok.clean_up_tokenization_spaces
        fast = ids_to_text(tok)
        rng = random.Random(1)
        text_ids = tok.encode(TEXT, add_special_tokens=False)
        special = sorted(tok.all_special_ids)
        for n in range(200):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
            if n % 3 == 0:   # real text cut anywhere, special tokens mixed in
                a = rng.randrange(len(text_ids))
                ids = text_ids[a:a + rng.randint(1, 9)] + [rng.choice(special)]
            assert fast(ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_transformers_decode_is_kept_where_it_would_clean_up_spaces(tokenizer):
    from replica_worker.engine.detokenizer import ids_to_text

    class Wrapped:   # the fast tokenizer, and a decode that says it ran
        def __init__(self, clean_up):
            self.backend_tokenizer = tokenizer.backend_tokenizer
            self.clean_up_tokenization_spaces = clean_up

        def decode(self, ids, skip_special_tokens):
            return "transformers"

    ids = tokenizer.encode("a , b", add_special_tokens=False)
    assert ids_to_text(Wrapped(clean_up=True))(ids) == "transformers"
    assert ids_to_text(Wrapped(clean_up=False))(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, as Llama 2's and Mistral's):
    its decoder drops the leading space at the start of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.train_from_iterator(["hello world the river mountain city"] * 50,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def test_the_first_output_token_keeps_its_space_after_the_prompt(metaspace_tokenizer):
    """As vLLM decodes it: the output's text is what decoding prompt and output
    together adds to the prompt's text, so it joins onto the prompt."""
    tok = metaspace_tokenizer
    ids = tok.encode("hello world river", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    assert not tok.decode(output).startswith(" ")   # the decoder alone drops it
    out: list[int] = []
    detok = IncrementalDetokenizer(tok, out, prompt_token_ids=prompt)
    text = ""
    for i, token in enumerate(output):
        out.append(token)
        text += detok.step(final=i == len(output) - 1)[0]
    assert text == " world river" == tok.decode(ids)[len(tok.decode(prompt)):]


def test_a_resumed_request_sends_the_rest_of_the_same_text(metaspace_tokenizer):
    tok = metaspace_tokenizer
    ids = tok.encode("hello world river city", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    resume = 1
    out = list(output[:resume])
    sent = " world"[:3]                     # the first replica sent this much of it
    detok = IncrementalDetokenizer(tok, out, resume_text_len=len(sent), prompt_token_ids=prompt)
    text = sent
    for i, token in enumerate(output[resume:], resume + 1):
        out.append(token)
        text += detok.step(final=i == len(output))[0]
    assert text == " world river city"


def test_a_stop_token_leaves_its_text_out(tokenizer):
    """EOS or a stop token id ends the request; its text is not in the output
    (vLLM's default), though its id is."""
    ids = tokenizer.encode("the model token cache", add_special_tokens=False)
    out: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, out)
    text = ""
    for i, token in enumerate(ids):
        out.append(token)
        last = i == len(ids) - 1
        text += detok.step(final=last, stop_token=last)[0]
    assert text == tokenizer.decode(ids[:-1])
    assert text != tokenizer.decode(ids)
