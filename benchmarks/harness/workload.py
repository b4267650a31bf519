"""Request generators: synthetic lengths and arrivals, workload presets, trace CSVs.

Every generator is driven by one numpy Generator seeded from --seed, so the same
flags give the same requests (lengths, arrival times and prompt token ids).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Request:
    index: int
    arrival_s: float          # offset from the start of the run (a later turn: its conversation's)
    prompt_len: int
    output_len: int
    # A later turn of a conversation holds only its new message: the load
    # generator puts the previous prompt and answer before it (prefix_workloads.py).
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    group: int = -1           # shared-prefix: which system prompt
    conversation: int = -1    # multi-turn: which conversation, and which turn of it
    turn: int = 0
    think_s: float = 0.0      # a later turn is sent this long after the previous answer


# Lognormal fits shaped like Sarathi-Serve's traces (median and P90 of each length).
#   openchat_sharegpt4:   prompt median ~1730, P90 ~5700; output median ~415, P90 ~835; total <= 8K
#   arxiv_summarization:  prompt median ~7060, P90 ~13000; output median ~208, P90 ~370; total <= 16K
PRESETS = {
    "sharegpt": {"prompt": (1730, 5700), "output": (415, 835), "max_total": 8192},
    "arxiv": {"prompt": (7060, 13000), "output": (208, 370), "max_total": 16384},
}
PREFIX_WORKLOADS = ("shared-prefix", "multi-turn")
Z90 = 1.2815515655446004


def lognormal_params(median: float, p90: float) -> tuple[float, float]:
    return math.log(median), math.log(p90 / median) / Z90


def _lognormal(rng, median, p90, n):
    mu, sigma = lognormal_params(median, p90)
    return rng.lognormal(mu, sigma, n)


def preset_lengths(name: str, n: int, rng: np.random.Generator, scale: float = 1.0,
                   max_total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of a preset, each scaled by `scale`; pairs whose
    total exceeds the (scaled) limit are drawn again, as trace filtering drops them."""
    p = PRESETS[name]
    limit = max_total if max_total is not None else int(p["max_total"] * scale)
    prompts = np.empty(n, dtype=np.int64)
    outputs = np.empty(n, dtype=np.int64)
    filled = 0
    for _ in range(1000):
        k = max(n - filled, 16) * 2
        pr = np.maximum(1, np.round(_lognormal(rng, *p["prompt"], k) * scale)).astype(np.int64)
        ou = np.maximum(1, np.round(_lognormal(rng, *p["output"], k) * scale)).astype(np.int64)
        ok = (pr + ou) <= limit
        pr, ou = pr[ok][: n - filled], ou[ok][: n - filled]
        prompts[filled: filled + len(pr)] = pr
        outputs[filled: filled + len(ou)] = ou
        filled += len(pr)
        if filled >= n:
            return prompts, outputs
    raise ValueError(f"cannot draw {name} lengths within {limit} tokens")


def synthetic_lengths(dist: str, n: int, rng: np.random.Generator, *, value: int = 128,
                      low: int = 1, high: int = 256, zipf_theta: float = 1.2) -> np.ndarray:
    """fixed: `value`; uniform: integers in [low, high]; zipf: Zipf(theta) over [low, high]
    (rank 1 -> low, as Sarathi's ZipfGenerator: most requests short, a heavy tail long)."""
    if dist == "fixed":
        return np.full(n, value, dtype=np.int64)
    if dist == "uniform":
        return rng.integers(low, high + 1, n, dtype=np.int64)
    if dist == "zipf":
        ranks = np.arange(1, high - low + 2, dtype=np.float64)
        weights = ranks ** -zipf_theta
        return (low + rng.choice(len(ranks), size=n, p=weights / weights.sum())).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}")


def arrivals(kind: str, n: int, rng: np.random.Generator, rate: float | None = None,
             cv: float = 1.0) -> np.ndarray:
    """Arrival offsets in seconds: poisson (exponential gaps at `rate` req/s), gamma
    (gaps with mean 1/rate and coefficient of variation `cv`), or burst (all at 0)."""
    if kind == "burst" or rate is None or rate <= 0 or math.isinf(rate):
        return np.zeros(n)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif kind == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    else:
        raise ValueError(f"unknown arrival process {kind!r}")
    gaps[0] = 0.0
    return np.cumsum(gaps)


_TRACE_COLUMNS = {
    "prompt": ("prompt_tokens", "prompt_len", "num_prefill_tokens", "input_tokens", "prompt"),
    "output": ("output_tokens", "output_len", "num_decode_tokens", "completion_tokens", "output"),
    "arrival": ("arrival_s", "arrived_at", "arrival_time", "timestamp", "arrival"),
}


def read_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A CSV with a header naming prompt and output lengths (Sarathi's num_prefill_tokens /
    num_decode_tokens are accepted) and optionally arrival times in seconds."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        cols = {}
        for key, names in _TRACE_COLUMNS.items():
            cols[key] = next((h for h in header if h.lower() in names), None)
        if cols["prompt"] is None or cols["output"] is None:
            raise ValueError(f"{path}: need prompt and output length columns, got {header}")
        prompts, outputs, times = [], [], []
        for line_no, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
            if not any(row.values()):
                continue
            try:
                prompts.append(int(float(row[cols["prompt"]])))
                outputs.append(int(float(row[cols["output"]])))
                if cols["arrival"]:
                    times.append(float(row[cols["arrival"]]))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from exc
    p, o = np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64)
    if (p < 1).any() or (o < 1).any():
        raise ValueError(f"{path}: lengths must be at least 1")
    t = None
    if cols["arrival"]:
        t = np.array(times, dtype=np.float64)
        t = t - t.min() if len(t) else t
        order = np.argsort(t, kind="stable")
        p, o, t = p[order], o[order], t[order]
    return p, o, t


def vocab_size_of(model_dir: str | Path | None, default: int = 512) -> int:
    if not model_dir:
        return default
    cfg = Path(model_dir) / "config.json"
    if not cfg.exists():
        return default
    return int(json.loads(cfg.read_text()).get("vocab_size", default))


def build_requests(prompt_lens, output_lens, arrival_s, rng: np.random.Generator,
                   vocab_size: int, first_token_id: int = 3) -> list[Request]:
    """Random prompt token ids in [first_token_id, vocab) (skips pad/bos/eos ids)."""
    reqs = []
    for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrival_s)):
        ids = rng.integers(first_token_id, vocab_size, int(p)).tolist()
        reqs.append(Request(i, float(t), int(p), int(o), ids))
    return reqs


@dataclass
class WorkloadSpec:
    """Everything that defines a request list; args of the CLI map onto it one to one."""
    num_requests: int = 100
    workload: str = "synthetic"           # synthetic | sharegpt | arxiv | trace | shared-prefix | multi-turn
    trace: str | None = None
    prompt_dist: str = "fixed"
    prompt_len: int = 128
    prompt_min: int = 16
    prompt_max: int = 512
    output_dist: str = "fixed"
    output_len: int = 64
    output_min: int = 8
    output_max: int = 256
    zipf_theta: float = 1.2
    scale: float = 1.0
    max_total: int | None = None          # default: the preset's limit times scale
    arrival: str = "poisson"              # poisson | gamma | burst | trace
    rate: float | None = None             # req/s; None: burst
    cv: float = 1.0
    seed: int = 0
    vocab_size: int = 512
    # shared-prefix and multi-turn (prefix_workloads.py); --prompt-* give question
    # or message lengths there.
    groups: int = 8
    questions: int = 16
    system_len: int = 256
    conversations: int = 32
    turns: int = 4
    think_s: float = 0.0

    def describe(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    @property
    def rate_unit(self) -> str:
        return rate_unit(self.workload)


def rate_unit(workload: str | None) -> str:
    """What a workload's arrival rate counts: a multi-turn rate starts conversations
    (each brings its turns, so its requests arrive faster); any other, requests."""
    return "conversations/s" if workload == "multi-turn" else "req/s"


def results_rate_unit(results) -> str:
    """The unit of the rates of saved results (their JSON's workload), one for all,
    or both names when they differ."""
    units = {rate_unit(r.get("workload", {}).get("workload")) for r in results}
    return units.pop() if len(units) == 1 else "req/s or conversations/s"


def generate(spec: WorkloadSpec, rate: float | None = None) -> list[Request]:
    """Lengths depend only on the seed, not on the rate, so probes at different rates
    (capacity search) and runs per policy offer the very same requests."""
    rate = spec.rate if rate is None else rate
    rng_len = np.random.default_rng([spec.seed, 1])
    rng_arr = np.random.default_rng([spec.seed, 2])
    rng_tok = np.random.default_rng([spec.seed, 3])
    if spec.workload in PREFIX_WORKLOADS:
        from benchmarks.harness import prefix_workloads

        make = prefix_workloads.shared_prefix if spec.workload == "shared-prefix" else \
            prefix_workloads.multi_turn
        return make(spec, rate, rng_len, rng_arr, rng_tok)
    n = spec.num_requests
    trace_times = None
    if spec.workload in PRESETS:
        p, o = preset_lengths(spec.workload, n, rng_len, spec.scale, spec.max_total)
    elif spec.workload == "trace":
        if not spec.trace:
            raise ValueError("--workload trace needs --trace CSV")
        p, o, trace_times = read_trace(spec.trace)
        if spec.scale != 1.0:
            p = np.maximum(1, np.round(p * spec.scale)).astype(np.int64)
            o = np.maximum(1, np.round(o * spec.scale)).astype(np.int64)
        if n and n < len(p):
            p, o = p[:n], o[:n]
            trace_times = trace_times[:n] if trace_times is not None else None
        n = len(p)
    elif spec.workload == "synthetic":
        p = synthetic_lengths(spec.prompt_dist, n, rng_len, value=spec.prompt_len, low=spec.prompt_min,
                              high=spec.prompt_max, zipf_theta=spec.zipf_theta)
        o = synthetic_lengths(spec.output_dist, n, rng_len, value=spec.output_len, low=spec.output_min,
                              high=spec.output_max, zipf_theta=spec.zipf_theta)
    else:
        raise ValueError(f"unknown workload {spec.workload!r}")
    if spec.arrival == "trace" or (spec.workload == "trace" and trace_times is not None and rate is None):
        if trace_times is None:
            raise ValueError("--arrival trace needs a trace with an arrival column")
        t = trace_times
    else:
        t = arrivals(spec.arrival, n, rng_arr, rate, spec.cv)
    return build_requests(p, o, t, rng_tok, spec.vocab_size)
