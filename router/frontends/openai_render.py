"""OpenAI response bodies and stream chunks, built from the router's requests.

Choices are numbered prompt-major: for prompts j and completions k of n,
index = j * n + k. Usage counts each prompt once and every completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pydantic_core import to_json

FINISH = {1: "stop", 2: "length", 3: "abort", 4: "error"}


@dataclass(frozen=True)
class CallMeta:
    id: str
    model: str
    created: int
    chat: bool
    n: int
    include_usage: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def json_bytes(obj) -> bytes:
    """Compact JSON in UTF-8, in about a fifth of json.dumps's time on an answer body
    (benchmarks/router/NOTES.md). A NaN or infinity, which JSON cannot carry, is
    written null (json.dumps with allow_nan=False, as Starlette renders, raised)."""
    return to_json(obj, inf_nan_mode="null")


def sse(obj) -> str:
    return f"data: {json_bytes(obj).decode()}\n\n"


def _token_text(tokenizer):
    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])
    return text


class Logprobs:
    """Formats per-token log probabilities as each endpoint defines them."""

    def __init__(self, tokenizer):
        self.text = _token_text(tokenizer)

    def chat(self, entries, token_ids) -> dict:
        content = []
        for tok, (lp, top) in zip(token_ids, entries):
            s = self.text(tok)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.text(t), "logprob": v,
                                              "bytes": list(self.text(t).encode())} for t, v in top]})
        return {"content": content}

    def completion(self, entries, token_ids, text_offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for tok, (lp, top) in zip(token_ids, entries):
            s = self.text(tok)
            tokens.append(s)
            lps.append(lp)
            top_by_text = {self.text(t): v for t, v in top}
            top_by_text.setdefault(s, lp)   # the sampled token always, as OpenAI and vLLM give it
            tops.append(top_by_text)
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(meta: CallMeta, reqs) -> dict:
    prompts = reqs[::meta.n]
    prompt_tokens = sum(r.prompt_len for r in prompts)
    completion = sum(len(r.tokens) for r in reqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in prompts)}}


def full_response(meta: CallMeta, reqs, tokenizer) -> dict:
    lp = Logprobs(tokenizer) if tokenizer is not None else None
    choices = []
    for i, r in enumerate(reqs):
        text = "".join(r.parts)
        logprobs = None
        if lp is not None:
            logprobs = lp.chat(r.logprobs, r.tokens) if meta.chat else lp.completion(r.logprobs, r.tokens, 0)
        choice = {"index": i, "logprobs": logprobs, "finish_reason": FINISH.get(r.finish_reason)}
        if meta.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": meta.id, "object": meta.object, "created": meta.created, "model": meta.model,
            "choices": choices, "usage": usage(meta, reqs)}


class StreamRenderer:
    def __init__(self, meta: CallMeta, reqs, tokenizer):
        self.meta = meta
        self.reqs = reqs
        self.lp = Logprobs(tokenizer) if tokenizer is not None else None
        self._text_offsets = [0] * len(reqs)

    def _chunk(self, choices: list, usage_=None) -> str:
        body = {"id": self.meta.id, "object": self.meta.chunk_object, "created": self.meta.created,
                "model": self.meta.model, "choices": choices}
        if self.meta.include_usage:
            body["usage"] = usage_
        return sse(body)

    def opening(self) -> str:
        """Chat streams open with the assistant's role, one delta per choice."""
        if not self.meta.chat:
            return ""
        return "".join(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}])
                       for i in range(len(self.reqs)))

    def delta(self, i: int, req, tokens, text: str, offset: int, last: bool) -> str:
        logprobs = None
        if self.lp is not None and tokens:
            entries = req.logprobs[offset:offset + len(tokens)]
            if self.meta.chat:
                logprobs = self.lp.chat(entries, tokens)
            else:
                logprobs = self.lp.completion(entries, tokens, self._text_offsets[i])
        self._text_offsets[i] += len(text)
        choice = {"index": i, "logprobs": logprobs,
                  "finish_reason": FINISH.get(req.finish_reason) if last else None}
        if self.meta.chat:
            choice["delta"] = {"content": text} if text or not last else {}
        else:
            choice["text"] = text
        return self._chunk([choice])

    def closing(self) -> str:
        tail = self._chunk([], usage(self.meta, self.reqs)) if self.meta.include_usage else ""
        return tail + "data: [DONE]\n\n"
