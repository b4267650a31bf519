"""Incremental detokenization with stop strings.

Text is decoded from a short window of tokens, so each step costs O(window),
not O(output). A delta is held back while it ends in an incomplete UTF-8
character (U+FFFD from a partial byte sequence) or could be the start of a
stop string, so a delta never splits a character and a stop string is never
half-sent. Joining every delta gives the decoded output (cut before a stop
string when one matched).

The window starts on the prompt's last tokens, as vLLM's detokenizer does: a
tokenizer whose decoder drops a leading space at the start of a text (the
Metaspace decoders of SentencePiece models: Llama 2, Mistral) then keeps the
space of the first output token, so the output joins onto the prompt. A
byte-level tokenizer decodes the same text either way.
"""

from __future__ import annotations

from typing import Callable

# Tokens kept before the read position so that decoding the window sees the
# same context (e.g. leading-space rules) as decoding the whole output.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


def ids_to_text(tokenizer) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True), as one call into the fast
    tokenizer where that gives the same text. transformers' decode wraps that call
    in type checks and list conversions, paid twice per token of every sequence: a
    detokenizer step took 8.7 us a token through it and 4.7 us direct on SmolLM2's
    tokenizer (benchmarks/engine/detokenize_bench.py). Where transformers would
    also clean up spaces, or there is no fast tokenizer, its decode it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        output_token_ids: list[int],
        stop: tuple[str, ...] = (),
        resume_text_len: int | None = None,
        prompt_token_ids=(),
    ):
        """output_token_ids is the live list of the sequence's output tokens.

        Tokens already in it were resumed from another replica. resume_text_len
        is how many characters of their text were delivered; None means all
        of it up to the last complete character. Undelivered text is sent
        with the first delta. prompt_token_ids: the prompt, whose last tokens
        are the window's context for the first output tokens.
        """
        self._to_text = ids_to_text(tokenizer)
        self._tokens = output_token_ids
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # Positions count the context first: position i is self._context[i]
        # below self._offset, else output token i - self._offset.
        self._context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._offset = len(self._context)
        context_text = self._decode(0, self._offset)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character that the output completes: no
            # context, as it would take that character's first bytes from the output.
            self._context, self._offset, context_text = [], 0, ""
        self._read = self._offset + len(output_token_ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        # Never resume inside an incomplete character: step back over its tokens.
        while (self._read > max(self._prefix, self._offset)
               and self._decode(self._prefix, self._read).endswith(_REPLACEMENT)):
            self._read -= 1
        self._held = ""  # decoded but not yet sent (possible stop-string prefix)
        sent = ""
        if self._read > self._offset and (stop or resume_text_len is not None):
            # once per resumed request
            decoded = self._decode(0, self._read)[len(context_text):]
            if resume_text_len is not None:
                sent, self._held = decoded[:resume_text_len], decoded[resume_text_len:]
            else:
                sent = decoded
        # Tail of sent text, for stop strings that span a delta boundary.
        self._recent = sent[-self._max_stop_len:] if stop else ""

    def _decode(self, start: int, end: int) -> str:
        """The text of positions [start, end) (context, then output)."""
        if start >= end:
            return ""
        offset = self._offset
        if start >= offset:
            return self._to_text(self._tokens[start - offset:end - offset])
        return self._to_text(self._context[start:end] + self._tokens[:max(0, end - offset)])

    def _advance(self, final: bool, end: int) -> str:
        """Newly completed text from the read position to `end`; moves the window."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, end)
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        new_text = full_text[len(prefix_text):]
        self._prefix = max(self._read, end - _CONTEXT_TOKENS)
        self._read = end
        return new_text

    def step(self, final: bool = False, check_stop: bool = True,
             stop_token: bool = False) -> tuple[str, bool]:
        """Call after tokens were appended. Returns (text delta, stop string matched).

        With final=True everything decodable is released (the request ends).
        stop_token: the last token ended the request (EOS or a stop token id);
        its text is left out, as vLLM leaves it out. After a stop-string match
        the delta ends just before the stop string and the caller must finish
        the request. With check_stop=False (before min_tokens) stop strings
        neither match nor hold text back; a later step matches only a stop
        string that ends in its new text.
        """
        end = self._offset + len(self._tokens) - (1 if final and stop_token else 0)
        pending = self._held + self._advance(final, max(end, self._read))
        self._held = ""
        if not pending:
            return "", False
        if self._stop:
            window = self._recent + pending
            cut = self._find_stop(window, len(self._recent)) if check_stop else None
            if cut is not None:
                return window[len(self._recent):cut] if cut > len(self._recent) else "", True
            if not final and check_stop:
                keep = self._stop_prefix_len(window)
                keep = min(keep, len(pending))
                if keep:
                    pending, self._held = pending[:-keep], pending[-keep:]
            self._recent = (self._recent + pending)[-self._max_stop_len:]
        return pending, False

    def _find_stop(self, text: str, new_from: int) -> int | None:
        """Start of the first stop string that ends past text[:new_from] (the text sent before)."""
        hits = [i for i in (text.find(s, max(0, new_from - len(s) + 1)) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that begins some stop string."""
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
