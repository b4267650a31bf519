"""The sampler's cost per call at batch 256 x vocab 49152: the old one and the new one side by side.

    python -m benchmarks.engine.sampler_bench [--device cpu|cuda] [--batch 256] [--vocab 49152] [--iters N]

Cases: greedy; sampled (temperature, top-k 50, top-p 0.95: the usual API mix);
top-p alone; temperature alone; seeded (the sampled mix with a seed per
request); and, new sampler only, penalties and logprobs. The rows are
Sequences as the runner passes them, each with a 64-token prompt and a
32-token output that grows by the sampled token after every call, as in
decode. Each iteration times the old and then the new sampler on fresh
copies of the same logits, so a shared machine's noise hits both alike.

Per call, medians over the iterations:
  host_ms       until the call returns (on CUDA without waiting for the device);
  with_copy_ms  until the tokens are on the host (the step's one copy back);
  device_ms     CUDA only: kernel and copy time on the device, from the profiler.
Saves benchmarks/results/sampler_{device}.json.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time

import torch

from benchmarks.common import save_result
from benchmarks.engine.legacy_sampler import Sampler as LegacySampler
from benchmarks.engine.legacy_sampler import SamplingRow as LegacyRow
from replica_worker.engine.sampler import Sampler
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.sequence import Sequence

SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95)
CASES = {
    "greedy": (lambda i: SamplingParams(temperature=0.0), True),
    "sampled": (lambda i: SamplingParams(**SAMPLED), True),
    "top_p": (lambda i: SamplingParams(temperature=0.8, top_p=0.95), True),
    "temperature": (lambda i: SamplingParams(temperature=0.8), True),
    "seeded": (lambda i: SamplingParams(**SAMPLED, seed=1000 + i), True),
    "penalties": (lambda i: SamplingParams(**SAMPLED, presence_penalty=0.5, frequency_penalty=0.3,
                                           repetition_penalty=1.1), False),
    "logprobs": (lambda i: SamplingParams(temperature=0.0, logprobs=5), False),
}


class Runner:
    """One sampler on one case: its rows, a call, and its result brought to the host."""

    def __init__(self, kind: str, params: list[SamplingParams], vocab: int, device: torch.device, seed: int):
        self.kind = kind
        rng = random.Random(seed)
        self.seqs = []
        for i, p in enumerate(params):
            seq = Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(64)], p)
            for _ in range(32):
                seq.append_token(rng.randrange(vocab))
            self.seqs.append(seq)
        self.sampler = Sampler(device, seed=seed) if kind == "new" else LegacySampler(device, seed=seed)

    def call(self, logits: torch.Tensor):
        if self.kind == "new":
            return self.sampler(logits, self.seqs)
        return self.sampler(logits, [LegacyRow(s.sampling_params, s.num_output_tokens) for s in self.seqs])

    def to_host(self, result) -> list[int]:
        ids = result.to_host().token_ids if self.kind == "new" else result.tolist()
        for seq, token in zip(self.seqs, ids):  # as the engine appends, so penalty counts stay current
            seq.append_token(token)
        return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(runner: Runner, logits: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(host seconds until the call returns, seconds until the tokens are on the host)."""
    x = logits.clone()
    _sync(device)
    start = time.perf_counter()
    result = runner.call(x)
    returned = time.perf_counter()
    runner.to_host(result)
    return returned - start, time.perf_counter() - start


def device_ms(runner: Runner, logits: torch.Tensor, device: torch.device, iters: int) -> float:
    """Mean device time per call (kernels and copies), from the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    inputs = [logits.clone() for _ in range(iters)]
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for x in inputs:
            runner.to_host(runner.call(x))
        _sync(device)
    total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total_us / iters / 1000.0


def run_case(name: str, args, device: torch.device) -> list[dict]:
    make, has_old = CASES[name]
    params = [make(i) for i in range(args.batch)]
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(1)).mul_(3).to(device)
    kinds = ("old", "new") if has_old else ("new",)
    runners = [Runner(kind, params, args.vocab, device, args.seed) for kind in kinds]
    times = {r.kind: ([], []) for r in runners}
    for r in runners:  # warm-up: lazy init, penalty slots
        time_call(r, logits, device)
    for _ in range(args.iters):
        for r in runners:
            host, total = time_call(r, logits, device)
            times[r.kind][0].append(host)
            times[r.kind][1].append(total)
    rows = []
    for r in runners:
        host, total = times[r.kind]
        row = {"case": name, "sampler": r.kind, "host_ms": 1e3 * statistics.median(host),
               "with_copy_ms": 1e3 * statistics.median(total)}
        if device.type == "cuda":
            row["device_ms"] = device_ms(r, logits, device, args.iters)
        rows.append(row)
        print(f"{name:<12}{r.kind:<5}" + "".join(f"{k} {v:9.3f}  " for k, v in row.items() if k.endswith("_ms")),
              flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=None, help="timed calls per sampler and case (cpu 5, cuda 50)")
    # One thread: on a shared machine a spinning second thread makes every op's time erratic.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = p.parse_args(argv)
    args.iters = args.iters or (50 if args.device == "cuda" else 5)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    with torch.inference_mode():
        for name in args.cases:
            rows.extend(run_case(name, args, device))
    given = sys.argv[1:] if argv is None else argv
    path = save_result(f"sampler_{args.device}", {
        "command": " ".join(["flock /tmp/quadriga-bench.lock .venv/bin/python -m benchmarks.engine.sampler_bench",
                             *(shlex.quote(a) for a in given)]),
        "batch": args.batch, "vocab": args.vocab, "iters": args.iters, "threads": args.threads,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "note": "old = the per-row sampler this one replaced (benchmarks/engine/legacy_sampler.py); "
                "medians per call; device_ms sums kernel and copy time",
        "results": rows,
    })
    print(f"saved {path}")


if __name__ == "__main__":
    main()
