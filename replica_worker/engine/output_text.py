"""The text of each request's deltas: its incremental detokenizer and stop strings.

The engine core uses it when it holds a tokenizer (offline, or a worker that
steps the engine on a thread of its own process). A worker whose engine runs
in another process uses it on its own side instead, so that detokenizing
never takes the engine's time (worker/engine_process.py); then a stop string
is found one step after its token, and the worker cancels the request in the
engine, whose next step's tokens for it are dropped.
"""

from __future__ import annotations

from replica_worker.engine.detokenizer import IncrementalDetokenizer
from replica_worker.engine.sampling_params import SamplingParams


class OutputTexts:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        # request id -> (detokenizer, the request's min_tokens, its output token ids)
        self._requests: dict[str, tuple[IncrementalDetokenizer, int, list[int]]] = {}

    def add(self, request_id: str, output_token_ids: list[int], params: SamplingParams,
            resume_text_len: int | None = None, prompt_token_ids=()) -> None:
        """output_token_ids: the list the request's output tokens are appended to,
        by its Sequence or by extend(), holding the tokens resumed from another
        replica, if any. prompt_token_ids: the prompt, the context the first
        output tokens are decoded in."""
        detok = IncrementalDetokenizer(self._tokenizer, output_token_ids, params.stop, resume_text_len,
                                       prompt_token_ids)
        self._requests[request_id] = (detok, params.min_tokens, output_token_ids)

    def step(self, request_id: str, num_output_tokens: int, final: bool,
             stop_token: bool = False) -> tuple[str, bool]:
        """After a token was appended: (text delta, a stop string matched). final:
        the request ends with this token, so everything decodable goes out;
        stop_token: it ended because this token is EOS or a stop token id, whose
        text is left out."""
        entry = self._requests.get(request_id)
        if entry is None:
            return "", False
        detok, min_tokens, _ = entry
        # Stop strings, like EOS, cannot end a request before min_tokens.
        return detok.step(final=final, check_stop=num_output_tokens > min_tokens, stop_token=stop_token)

    def extend(self, request_id: str, token_ids: list[int], final: bool,
               stop_token: bool = False) -> tuple[str, bool]:
        """Appends a delta's tokens to the request's list, then step()."""
        tokens = self._requests[request_id][2]
        tokens.extend(token_ids)
        return self.step(request_id, len(tokens), final, stop_token)

    def retain(self, request_ids) -> None:
        """Forgets every request not in request_ids (those the caller dropped)."""
        for rid in [r for r in self._requests if r not in request_ids]:
            del self._requests[rid]

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests
