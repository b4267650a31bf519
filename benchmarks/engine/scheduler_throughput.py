"""Offline CPU throughput of the engine under each replica scheduler.

    python -m benchmarks.engine.scheduler_throughput [--requests 48] [--output-len 48]

A fixed workload (heavy-tailed prompt lengths, seeded, all arriving at once)
runs through LLM.generate on a small random Llama-shaped model; prints and
saves tokens/s, TTFT and TBT per scheduler to
benchmarks/results/engine_schedulers_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import save_result, summarize
from replica_worker import LLM, SamplingParams
from replica_worker.engine.config import SCHEDULER_NAMES

# Small enough for a 2-core CPU, large enough that compute, not Python, dominates a step.
MODEL_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)


def make_model_dir() -> str:
    from transformers import LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="bench-model-"))
    LlamaConfig(**MODEL_SHAPE, tie_word_embeddings=False).save_pretrained(folder)
    return str(folder)


def workload(n: int, seed: int) -> list[list[int]]:
    """Prompt lengths from a Pareto tail clipped to [16, 1024]: mostly short, a few long."""
    rng = random.Random(seed)
    lengths = [min(1024, int(16 * rng.paretovariate(1.2))) for _ in range(n)]
    return [[rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(L)] for L in lengths]


def run_one(model: str, scheduler: str, prompts, output_len: int, chunk_size: int) -> dict:
    llm = LLM(model, scheduler=scheduler, load_format="dummy", chunk_size=chunk_size,
              max_num_batched_tokens=4096, max_num_seqs=32, num_blocks=2048)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = [r.outputs[0] for r in llm.generate(prompts, params)]
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    tbt = [g for o in outs for g in o.metrics.token_gaps]
    return {
        "scheduler": scheduler,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_s": summarize(ttft),
        "tbt_s": summarize(tbt),
        "preemptions": sum(o.metrics.num_preemptions for o in outs),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = make_model_dir()
    prompts = workload(a.requests, a.seed)
    run_one(model, "sarathi", prompts[:4], 4, a.chunk_size)  # process warm-up (lazy torch init)
    rows = []
    print(f"{len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, output {a.output_len} each")
    print(f"{'scheduler':<20}{'out tok/s':>10}{'all tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p99':>10}")
    for name in SCHEDULER_NAMES:
        row = run_one(model, name, prompts, a.output_len, a.chunk_size)
        rows.append(row)
        print(f"{name:<20}{row['output_tokens_per_s']:>10.1f}{row['total_tokens_per_s']:>10.1f}"
              f"{row['ttft_s']['p50']:>10.3f}{row['ttft_s']['p99']:>10.3f}{row['tbt_s']['p99']:>10.3f}")
    path = save_result("engine_schedulers_cpu", {
        "model_shape": MODEL_SHAPE, "requests": a.requests, "output_len": a.output_len,
        "chunk_size": a.chunk_size, "threads": a.threads,
        "prompt_lengths": [len(p) for p in prompts], "results": rows,
    })
    print(f"saved {path}")


if __name__ == "__main__":
    main()
