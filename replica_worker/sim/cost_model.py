"""How long a step of a simulated replica takes, from what the scheduler put in it.

    step_s = intercept + per_prefill_token * P + per_decode_seq * D
             + per_kv_token * K + per_attention_pair * A

P  prefill tokens: the chunks of sequences still in prefill
D  decode sequences (one token each)
K  KV tokens the decodes attend over: the sum of their contexts (num_computed + 1)
A  causal attention pairs of the prefill chunks: a chunk of n tokens after c
   cached ones attends n * c + n * (n + 1) / 2 pairs (the quadratic prefill term)

Coefficients come from a profile in benchmarks/results/sim_cost_model.json,
fitted by `python -m replica_worker.sim.cost_model fit` (fit.py) to figures
measured on real hardware; the file records every data point and its residual.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

PROFILES_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim_cost_model.json"
COEFFICIENTS = ("intercept_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s",
                "per_attention_pair_s")


@dataclass(frozen=True)
class StepFeatures:
    """What a step's cost depends on; sums of steps add up (a job's total is one row)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens: int = 0
    attention_pairs: float = 0.0

    def vector(self) -> tuple[float, ...]:
        """In the order of COEFFICIENTS."""
        return (float(self.steps), float(self.prefill_tokens), float(self.decode_seqs),
                float(self.kv_tokens), float(self.attention_pairs))

    def __add__(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def features_of(chunks) -> StepFeatures:
    """Features of one step's chunks, read before the engine advances num_computed_tokens
    (as the runner sees them). A chunk of a sequence in prefill is prefill, whatever its size."""
    prefill = decodes = kv = 0
    pairs = 0.0
    for chunk in chunks:
        seq, n = chunk.seq, chunk.num_tokens
        cached = seq.num_computed_tokens
        if seq.in_prefill:
            prefill += n
            pairs += n * cached + n * (n + 1) / 2
        else:
            decodes += 1
            kv += cached + n
    return StepFeatures(1, prefill, decodes, kv, pairs)


@dataclass(frozen=True)
class CostModel:
    intercept_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    per_attention_pair_s: float = 0.0

    def __post_init__(self) -> None:
        negative = [name for name in COEFFICIENTS if getattr(self, name) < 0]
        if negative:
            raise ValueError(f"cost model coefficient {negative[0]} is negative")

    @classmethod
    def from_vector(cls, values) -> "CostModel":
        return cls(*(float(v) for v in values))

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    def time_of(self, features: StepFeatures) -> float:
        """Seconds for a step (or, for summed features, for all of them)."""
        return sum(c * x for c, x in zip(self.vector(), features.vector()))


@dataclass(frozen=True)
class Profile:
    """A cost model with the replica shape it was measured on (what the simulated
    replica advertises unless told otherwise)."""

    name: str
    cost: CostModel
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int = 16


def load_profile(name: str, path: Path | str = PROFILES_PATH) -> Profile:
    """A profile by name from the profiles file; a clear error when it is not there."""
    path = Path(path)
    try:
        profiles = json.loads(path.read_text())["profiles"]
    except FileNotFoundError:
        raise ValueError(f"no cost model profiles at {path}: run "
                         "`python -m replica_worker.sim.cost_model fit`") from None
    if name not in profiles:
        raise ValueError(f"unknown cost model profile {name!r}; {path} holds {sorted(profiles)}")
    p = profiles[name]
    shape = p["shape"]
    return Profile(
        name=name,
        cost=CostModel(**{k: p["coefficients"][k] for k in COEFFICIENTS}),
        vocab_size=shape["vocab_size"],
        max_model_len=shape["max_model_len"],
        num_kv_blocks=shape["num_kv_blocks"],
        block_size=shape.get("block_size", 16),
    )


def main(argv: list[str] | None = None) -> int:
    from replica_worker.sim.fit import main as fit_main

    return fit_main(argv)


if __name__ == "__main__":
    sys.exit(main())
