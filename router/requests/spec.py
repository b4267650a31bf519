"""The plain request both front ends build (gRPC Generate, the OpenAI HTTP API).

The router's core sees only these: no protobuf, no HTTP. Absent optional
fields are None, so "unset" and "0" stay distinct as they are on the wire.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields

from pydantic_core import to_json

# Reused: json.dumps builds a new encoder per call unless its arguments are the
# defaults. The digest keeps json's canonical form (sorted keys, ASCII), which
# Redis holds for every stored request: a re-attach compares against it.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None = None       # None: up to the model's length limit
    temperature: float | None = None    # None: 1.0; 0: greedy
    top_p: float | None = None
    top_k: int | None = None            # None, 0 or -1: off
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None         # None: none; k: the sampled token's and the top k
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, sorted by token

    # The fields that are set, as plain JSON values (what Redis keeps), and their
    # JSON: made once, at construction, as every request reads them (digest,
    # submit, Assign). The dict is shared, so callers must not change it.
    set_fields: dict = field(init=False, repr=False, compare=False)
    set_fields_json: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        out = {}
        for k in _SAMPLING_FIELDS:  # a shallow read: asdict's deep copy cost every submit
            v = getattr(self, k)
            if v is None or v == () or v is False:
                continue
            out[k] = list(v) if isinstance(v, tuple) else v
        object.__setattr__(self, "set_fields", out)
        object.__setattr__(self, "set_fields_json", to_json(out).decode())


@dataclass(frozen=True)
class RequestSpec:
    request_id: str = ""                # empty: the router makes one
    prompt: str = ""                    # exactly one of prompt and prompt_token_ids
    prompt_token_ids: tuple[int, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = 0                   # higher first; equal priorities in arrival order
    stream_interval: int = 0            # coalescing; 0: the router's default

    def digest(self) -> str:
        """Identity of the body for the re-attach rule: what is generated, so
        request_id and stream_interval are left out."""
        body = {"p": self.prompt, "ids": list(self.prompt_token_ids), "pr": self.priority,
                "s": self.sampling.set_fields}
        return hashlib.sha256(_CANONICAL.encode(body).encode()).hexdigest()[:32]


_SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling) if f.init)


def sampling_from_fields(d: dict) -> Sampling:
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    if "logit_bias" in kw:   # JSON's [[token, bias], ...] back to pairs
        kw["logit_bias"] = bias_pairs(kw["logit_bias"])
    return Sampling(**kw)


def bias_pairs(items) -> tuple[tuple[int, float], ...]:
    """A logit_bias as (token, bias) pairs sorted by token, from a mapping or pairs."""
    pairs = items.items() if hasattr(items, "items") else items
    return tuple(sorted((int(t), float(b)) for t, b in pairs))
