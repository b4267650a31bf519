"""OpenAI API request bodies (pydantic) and their translation to plain RequestSpecs.

Only what the API defines is read; unknown fields are ignored, as OpenAI's
own server and vLLM's do. Fields the API defines that would change the answer
and that Quadriga does not implement (a response_format other than text, tools
and functions, echo, suffix, best_of above n) are refused with a 400 that names
them: ignoring them would return an answer the client did not ask for, and it
could not tell. Extensions: top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, priority. Values are checked by the shared
validation (router/validation.py), so both front doors say the same thing
about the same mistake. Fields the API allows to be null take their default
when null. priority reads as in vLLM (lower is served first) and seed as a
signed 64-bit integer too; the gRPC API's priority is the other way round
(higher first) and its seed unsigned, so they are translated here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from common.seeds import derived_seed
from router.requests.spec import RequestSpec, Sampling, bias_pairs
from router.validation import MAX_STREAM_INTERVAL, invalid

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_N = 128
# A call that is answered whole (stream: false) needs no token before its end, so
# its requests ask the replica to coalesce as far as it will: the first token goes
# at once (it times the TTFT), the rest in one message at the finish (or every
# 4096 tokens). The router then handles two deltas a request, not one a token.
# The cost: a replica that dies mid-answer takes its unsent tokens with it, and
# the request resumes elsewhere from the first (recomputed, not lost).
WHOLE_ANSWER_STREAM_INTERVAL = MAX_STREAM_INTERVAL


def _null_is_default(cls, value, info: ValidationInfo):
    """A field the API allows to be null, sent as null, takes its default."""
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    _nulls = field_validator("include_usage", mode="before")(classmethod(_null_is_default))


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions, as vLLM names them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias
    # Defined by the API, not implemented: refused when they would change the answer.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None

    _common_nulls = field_validator("n", "stream", "ignore_eos", "priority",
                                    mode="before")(classmethod(_null_is_default))

    def sampling(self, max_tokens: int | None, logprobs: int | None, defaults=None) -> Sampling:
        """defaults: the model's sampling defaults (common/generation_config.py),
        for the fields this body leaves unset."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = self.seed
        if seed is not None and -2 ** 63 <= seed < 0:
            seed %= 2 ** 64   # a signed seed, as vLLM takes it, as the unsigned one the wire carries
        unset = {k: v for k, v in (defaults or {}).items() if getattr(self, k) is None}
        return Sampling(max_tokens=max_tokens, seed=seed, ignore_eos=self.ignore_eos, stop=stop,
                        min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, logprobs=logprobs,
                        logit_bias=self.bias_pairs(),
                        **{**dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  min_p=self.min_p, repetition_penalty=self.repetition_penalty),
                           **unset})

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        bad = [key for key in (self.logit_bias or {}) if not key.strip().lstrip("-").isdigit()]
        if bad:
            raise invalid(f"logit_bias keys are token ids, not {bad[0]!r}")
        return bias_pairs(self.logit_bias or {})

    def check_n(self) -> None:
        """n, and the fields refused (the module's docstring says why); n > 1 with
        temperature 0 is allowed (n identical greedy answers), as OpenAI allows it."""
        if not 1 <= self.n <= MAX_N:
            raise invalid(f"n {self.n} must lie in [1, {MAX_N}]")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true")
        for field in self.refused_fields():
            raise invalid(f"{field} is not supported by this server")

    def refused_fields(self) -> list[str]:
        refused = []
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            refused.append(f"response_format of type {kind!r} (only 'text')")
        if self.tools and self.tool_choice != "none":
            refused.append("tools (function calling)")
        if self.functions:
            refused.append("functions (function calling)")
        return refused

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    # Checked by prompts(), which says which forms are accepted.
    prompt: Any = Field(default="")
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _completion_nulls = field_validator("echo", mode="before")(classmethod(_null_is_default))

    def refused_fields(self) -> list[str]:
        refused = super().refused_fields()
        if self.echo:
            refused.append("echo")
        if self.suffix:
            refused.append("suffix")
        if self.best_of is not None and self.best_of > self.n:
            refused.append(f"best_of above n ({self.best_of} > {self.n})")
        return refused

    def prompts(self) -> list[str | tuple[int, ...]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise invalid("empty prompt: give prompt or prompt_token_ids")
        if isinstance(p, list):
            if all(_is_int(x) for x in p):
                return [tuple(p)]
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
                return [tuple(x) for x in p]
        raise invalid("prompt must be a string, a list of strings, a list of token ids, "
                      "or a list of lists of token ids")

    def specs(self, request_id: str, defaults=None) -> list[RequestSpec]:
        """One spec per (prompt, completion), in the order choices are numbered."""
        self.check_n()
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return _expand(self, self.prompts(), self.sampling(max_tokens, self.logprobs, defaults), request_id)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    _chat_nulls = field_validator("logprobs", mode="before")(classmethod(_null_is_default))

    def rendered_messages(self) -> list[dict]:
        if not self.messages:
            raise invalid("messages is empty: give at least one message")
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if content is None and m.role in ("system", "developer", "user"):
                raise invalid(f"messages[{i}] ({m.role}) has no content")
            if isinstance(content, list):  # content parts: only text is understood
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise invalid(f"messages[{i}].content: only text parts are supported, "
                                      f"not {part.get('type')!r}")
                    texts.append(str(part.get("text", "")))
                content = "\n".join(texts)   # as vLLM joins text parts
            out.append({**m.model_dump(exclude_none=True), "content": content or ""})
        return out

    def chat_sampling(self, defaults=None) -> Sampling:
        self.check_n()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return self.sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)

    def specs(self, request_id: str, prompt_ids: tuple[int, ...], defaults=None) -> list[RequestSpec]:
        return _expand(self, [prompt_ids], self.chat_sampling(defaults), request_id)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _expand(body: _Common, prompts, sampling: Sampling, request_id: str) -> list[RequestSpec]:
    """n completions of each prompt; with a seed, completion k uses derived_seed(seed, k)
    (completion 0 keeps it), so each call with the same body gets the same answers."""
    specs = []
    interval = 0 if body.stream else WHOLE_ANSWER_STREAM_INTERVAL   # 0: the router's default
    many = len(prompts) * body.n > 1
    for j, prompt in enumerate(prompts):
        for k in range(body.n):
            s = sampling if k == 0 or sampling.seed is None else \
                replace(sampling, seed=derived_seed(sampling.seed, k))
            index = j * body.n + k
            rid = f"{request_id}-{index}" if request_id and many else request_id
            text, ids = (prompt, ()) if isinstance(prompt, str) else ("", prompt)
            specs.append(RequestSpec(request_id=rid, prompt=text, prompt_token_ids=ids,
                                     sampling=s, priority=-body.priority,   # lower first, as vLLM
                                     stream_interval=interval))
    return specs


Role = Literal["system", "user", "assistant", "tool"]
