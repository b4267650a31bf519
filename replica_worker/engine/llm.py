"""Offline batch generation in vLLM's shape:

    from replica_worker import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-folder", scheduler="sarathi", chunk_size=256)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from typing import Sequence as Seq

from common.generation_config import sampling_defaults
from common.tokenizer import encode_prompt, load_tokenizer
from replica_worker.engine.config import engine_config
from replica_worker.engine.core import EngineCore
from replica_worker.engine.detokenizer import ids_to_text
from replica_worker.engine.outputs import (CompletionOutput, Logprob, RequestDelta, RequestMetrics,
                                          RequestOutput)
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence

class _Completion:
    """What the deltas of one completion add up to."""

    def __init__(self, index: int, seq: Sequence, with_logprobs: bool, token_text=None) -> None:
        self.index, self.seq = index, seq
        self.texts: list[str] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if with_logprobs else None
        self.token_text = token_text or (lambda _token: None)
        self.cumulative = 0.0
        self.finish_reason: str | None = None

    def add(self, delta: RequestDelta) -> None:
        self.texts.append(delta.text)
        if self.logprobs is not None and delta.logprobs:
            text = self.token_text
            for token, lp in zip(delta.new_token_ids, delta.logprobs):
                entry = {token: Logprob(lp.logprob, lp.rank, text(token))}
                for place, (top, value) in enumerate(lp.top, 1):
                    entry.setdefault(top, Logprob(value, place, text(top)))
                self.logprobs.append(entry)
                self.cumulative += lp.logprob
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text="".join(self.texts),
            token_ids=list(self.seq.output_token_ids),
            cumulative_logprob=None if self.logprobs is None else self.cumulative,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            metrics=RequestMetrics.of(self.seq),
        )


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **engine_kwargs):
        self.config = engine_config(model, **engine_kwargs)
        try:
            self.tokenizer = load_tokenizer(str(tokenizer or model))
        except (OSError, ValueError):
            if tokenizer is not None:
                raise
            self.tokenizer = None  # dummy weights without a tokenizer: token ids only
        self.engine = EngineCore(self.config, self.tokenizer)
        self._ids = itertools.count()
        self._decode_one = None
        self._sampling_defaults = sampling_defaults(model)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no SamplingParams: the model's
        generation_config.json sampling values (temperature, top_p, top_k, min_p,
        repetition_penalty) over SamplingParams' own defaults, as vLLM's LLM does."""
        return SamplingParams(**self._sampling_defaults)

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks (a no-op with one rank)."""
        self.engine.shutdown()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self._need_tokenizer(), prompt)
        return [int(t) for t in prompt]

    def _token_text(self, token: int) -> str | None:
        """A token's text alone (Logprob.decoded_token); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if self._decode_one is None:
            self._decode_one = ids_to_text(self.tokenizer)
        return self._decode_one([token])

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass token id lists")
        return self.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists.

        Text is encoded as the router encodes it (common.tokenizer.encode_prompt).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        items = [(p if isinstance(p, str) else None, self._encode(p)) for p in prompts]
        return self._run(items, _params_per_prompt(sampling_params or self.get_default_sampling_params(),
                                                   len(items)))

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates after each conversation ({"role", "content"} dicts; one or a list of them).

        A conversation is rendered by the tokenizer's chat template with the
        generation prompt added; the rendered text, which holds whatever
        special tokens the template wants, is encoded without adding more.
        """
        tokenizer = self._need_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)
            items.append((text, tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, _params_per_prompt(sampling_params or self.get_default_sampling_params(),
                                                   len(items)))

    def _run(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams]) -> list[RequestOutput]:
        requests, completions = [], {}
        try:
            for (text, ids), p in zip(items, params):
                rid = f"offline-{next(self._ids)}"
                seq_ids = [rid] if p.n == 1 else [f"{rid}-{i}" for i in range(p.n)]
                for i, sid in enumerate(seq_ids):
                    seq = self.engine.add_request(sid, ids, p.for_completion(i))
                    completions[sid] = _Completion(i, seq, p.logprobs is not None, self._token_text)
                requests.append((rid, text, ids, seq_ids))
            while self.engine.has_unfinished():
                for delta in self.engine.step().deltas:
                    completions[delta.request_id].add(delta)
        finally:
            for sid, c in completions.items():
                if c.finish_reason is None:
                    self.engine.abort_request(sid)
        results = []
        for rid, text, ids, seq_ids in requests:
            outs = [completions[sid].output() for sid in seq_ids]
            results.append(RequestOutput(rid, text, list(ids), outs, finished=True, metrics=outs[0].metrics,
                                         num_cached_tokens=completions[seq_ids[0]].seq.num_cached_tokens))
        return results


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * count
    if len(params_list) != count:
        raise ValueError("give one SamplingParams, or one per prompt")
    return params_list
